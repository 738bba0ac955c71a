"""A userspace TCP delay proxy: every byte waits half a round trip in each direction, in order.

The test fleet's hosts are network namespaces on one kernel, whose links add no delay (and this
kernel has no ``netem``), so a service host runs one of these in front of each service (Redis, the
model): a client on another host then sees a round trip of ``--rtt-ms`` more than the link's.

``python -m tests.hosts.delay_proxy --listen HOST:PORT --to HOST:PORT --rtt-ms MS`` prints
``delay proxy listening on HOST:PORT`` once it listens, and runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import sys


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk sent ``delay`` seconds after it arrived, in order."""
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def receive() -> None:
        while True:
            data = await reader.read(1 << 16)
            await chunks.put((loop.time() + delay, data))
            if not data:
                return

    receiving = asyncio.create_task(receive())
    try:
        while True:
            due, data = await chunks.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
    finally:
        receiving.cancel()
        await asyncio.gather(receiving, return_exceptions=True)


async def _handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, to: tuple[str, int],
                  delay: float) -> None:  # fmt: skip
    try:
        server_r, server_w = await asyncio.open_connection(*to)
    except OSError:
        client_w.close()
        return
    for w in (client_w, server_w):
        sock = w.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        await asyncio.gather(_pump(client_r, server_w, delay), _pump(server_r, client_w, delay))
    except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):  # closed, or the proxy stops
        pass
    finally:
        for w in (client_w, server_w):
            w.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def _main(listen: tuple[str, int], to: tuple[str, int], rtt_ms: float) -> None:
    delay = rtt_ms / 2000.0
    server = await asyncio.start_server(lambda r, w: _handle(r, w, to, delay), *listen, reuse_address=True)
    print(f"delay proxy listening on {listen[0]}:{listen[1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    """Run the proxy (see the module docstring)."""
    parser = argparse.ArgumentParser(description="TCP proxy adding a round trip (test fleet)")
    parser.add_argument("--listen", required=True, help="HOST:PORT to listen on")
    parser.add_argument("--to", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="round trip added, in milliseconds")
    args = parser.parse_args(argv)
    asyncio.run(_main(_address(args.listen), _address(args.to), args.rtt_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
