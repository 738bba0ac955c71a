"""A fault-injecting TCP proxy in front of a real Redis (asyncio, 127.0.0.1 only, a thread of its own).

It parses the RESP commands clients send and the replies Redis returns, one by one, so it can
fail a connection at the worst moment for a client:

* **drops** (``drop_rate``, per command): the command is forwarded to Redis, Redis runs it,
  its reply is read and thrown away, and both connections are closed. The client sees a
  dropped connection after its command took effect (redis-py then reconnects and sends it
  again), and every command it had pipelined behind it may have run too;
* **error replies** (:meth:`FaultProxy.refuse_writes` for a burst of seconds): write commands
  are answered ``-READONLY`` (as a replica after a failover answers) without reaching Redis;
  reads still pass.

Pub/sub connections (after ``SUBSCRIBE``) are passed through as raw bytes, never dropped;
:meth:`FaultProxy.silence_pubsub` black-holes them instead (bytes either way are read and
thrown away, nothing is closed: a half-open link, as a NAT that forgot an idle flow leaves).
Counters (:attr:`FaultProxy.stats`) say how many commands were forwarded, dropped and refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

WRITES = frozenset(
    b"EVAL EVALSHA HSET HMSET HINCRBY HDEL RPUSH LPUSH LTRIM LREM XADD XTRIM ZADD ZREM ZREMRANGEBYSCORE "
    b"SADD SREM SET SETEX INCRBY DECRBY INCR DECR DEL UNLINK EXPIRE PEXPIRE PERSIST BLPOP LPOP RPOP "
    b"BLMOVE LMOVE".split()
)
"""Commands refused during a write-refusal burst (what a read-only replica refuses)."""
HANDSHAKE = frozenset({b"HELLO", b"CLIENT", b"AUTH", b"SELECT", b"PING"})
"""Never dropped: a drop there is a failed connect, not a lost reply."""
READONLY = b"-READONLY You can't write against a read only replica.\r\n"


@dataclass
class ProxyStats:
    """What the proxy did (counts of commands)."""

    forwarded: int = 0
    dropped: int = 0
    refused: int = 0
    connections: int = 0
    by_command: dict[str, int] = field(default_factory=dict)
    dropped_by_command: dict[str, int] = field(default_factory=dict)


async def _read_command(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One RESP command (an array of bulk strings): its raw bytes and its upper-cased name."""
    head = await reader.readuntil(b"\r\n")
    if not head.startswith(b"*"):
        return head, head.split()[0].upper() if head.strip() else b""  # inline command
    n = int(head[1:-2])
    parts = [head]
    name = b""
    for i in range(n):
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line[1:-2])
        data = await reader.readexactly(size + 2)
        parts += [size_line, data]
        if i == 0:
            name = data[:-2].upper()
    return b"".join(parts), name


async def _read_reply(reader: asyncio.StreamReader) -> bytes:
    """One RESP2 or RESP3 reply, raw (redis-py 8 speaks RESP3 after ``HELLO 3``)."""
    line = await reader.readuntil(b"\r\n")
    kind = line[:1]
    if kind in (b"$", b"!", b"="):  # bulk string, bulk error, verbatim string
        size = int(line[1:-2])
        return line if size < 0 else line + await reader.readexactly(size + 2)
    if kind in (b"*", b"~", b">", b"%", b"|"):  # array, set, push, map (pairs), attribute (pairs)
        n = int(line[1:-2])
        count = 2 * n if kind in (b"%", b"|") else n
        parts = [line]
        for _ in range(max(0, count)):
            parts.append(await _read_reply(reader))
        if kind == b"|":  # an attribute comes before the reply it annotates
            parts.append(await _read_reply(reader))
        return b"".join(parts)
    return line  # + - : _ # , (


class FaultProxy:
    """Listens on 127.0.0.1 (a free port) and forwards to the Redis at ``target_url``.

    Args:
        target_url: the real Redis (``redis://[user:password@]host:port/db``).
        drop_rate: probability (0..1) that a command's connection is dropped after Redis ran it.
        seed: random seed of the drop decisions.
    """

    def __init__(self, target_url: str, *, drop_rate: float = 0.0, seed: int | None = None) -> None:
        target = urlsplit(target_url)
        assert target.port is not None, target_url
        self.target = target
        self.target_host, self.target_port = target.hostname or "127.0.0.1", target.port
        self.drop_rate = drop_rate
        self.drop_containing: tuple[bytes, ...] = ()
        """When set, only commands whose raw bytes hold one of these are dropped (a key's name, say)."""
        self.stats = ProxyStats()
        self._rng = random.Random(seed)
        self._refuse_until = 0.0
        self._refuse_containing: tuple[bytes, ...] = ()
        self._silent_pubsub = False
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        """The target URL with ``127.0.0.1:<proxy port>`` as its host and port."""
        userinfo = self.target.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@127.0.0.1:{self.port}" if userinfo else f"127.0.0.1:{self.port}"
        return urlunsplit(self.target._replace(netloc=netloc))

    def refuse_writes(self, seconds: float, *, containing: tuple[bytes, ...] = ()) -> None:
        """Answer every write command ``-READONLY`` for the next ``seconds``; with ``containing``,
        only those whose raw command holds one of these byte strings (a script's SHA, say)."""
        self._refuse_containing = containing
        self._refuse_until = time.monotonic() + seconds

    def silence_pubsub(self, silent: bool = True) -> None:
        """From now on, drop every byte of every pub/sub connection both ways, closing nothing."""
        self._silent_pubsub = silent

    def _refusing(self) -> bool:
        return time.monotonic() < self._refuse_until

    async def _raw(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                if self._silent_pubsub:
                    continue  # black-holed: read and thrown away, the connection stays open
                writer.write(data)
                await writer.drain()

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        try:
            ureader, uwriter = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            cwriter.close()
            return
        plan: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()

        def close_all() -> None:
            for w in (cwriter, uwriter):
                with contextlib.suppress(Exception):
                    w.close()

        async def requests() -> None:
            while True:
                raw, name = await _read_command(creader)
                self.stats.by_command[name.decode(errors="replace")] = (
                    self.stats.by_command.get(name.decode(errors="replace"), 0) + 1
                )
                if name in (b"SUBSCRIBE", b"PSUBSCRIBE", b"SSUBSCRIBE"):
                    uwriter.write(raw)
                    await uwriter.drain()
                    await plan.put(("raw", b""))
                    await self._raw(creader, uwriter)
                    return
                if (
                    name in WRITES
                    and self._refusing()
                    and (not self._refuse_containing or any(part in raw for part in self._refuse_containing))
                ):
                    self.stats.refused += 1
                    await plan.put(("err", READONLY))
                    continue
                uwriter.write(raw)
                await uwriter.drain()
                self.stats.forwarded += 1
                drop = self.drop_rate > 0 and name not in HANDSHAKE and self._rng.random() < self.drop_rate
                if drop and self.drop_containing and not any(part in raw for part in self.drop_containing):
                    drop = False
                if drop:
                    key = name.decode(errors="replace")
                    self.stats.dropped_by_command[key] = self.stats.dropped_by_command.get(key, 0) + 1
                await plan.put(("drop" if drop else "up", b""))

        async def replies() -> None:
            while True:
                what, data = await plan.get()
                if what == "err":
                    cwriter.write(data)
                elif what == "up":
                    cwriter.write(await _read_reply(ureader))
                elif what == "drop":
                    await _read_reply(ureader)  # Redis ran it; the client never hears so
                    self.stats.dropped += 1
                    return
                else:  # pub/sub: raw bytes from here on
                    await self._raw(ureader, cwriter)
                    return
                await cwriter.drain()

        tasks = [asyncio.ensure_future(requests()), asyncio.ensure_future(replies())]
        with contextlib.suppress(Exception):
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        close_all()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def start(self) -> FaultProxy:
        """Start listening (returns once the port is known)."""
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fault proxy did not start")
        return self

    def stop(self) -> None:
        """Stop listening, close every connection and end the proxy's thread."""

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
