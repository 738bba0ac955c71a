"""The REPL child's own plumbing: the reply pipe, its stdio, the descriptors it keeps, and dying
with the producer."""

from __future__ import annotations

import io
import json
import os
import threading
from typing import Any, BinaryIO

__all__ = ["close_other_descriptors", "die_with_the_producer", "stdio"]


class _Channel:
    """The reply pipe; writes are serialised because cells may call ``llm_batch`` from threads.

    Its name is the one the hostile-REPL tests look for among the garbage collector's objects,
    as a cell could, to forge replies through it."""

    def __init__(self, fd: int) -> None:
        self._file: BinaryIO = open(fd, "wb", buffering=1 << 16)  # noqa: SIM115
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        # UTF-8, not \u escapes: at most 6 bytes a character (control characters), which the
        # parent's line limit (6 * max_answer_length + slack) admits
        data = (json.dumps(message, ensure_ascii=False) + "\n").encode("utf-8", "surrogatepass")
        with self._lock:
            self._file.write(data)
            self._file.flush()


def die_with_the_producer(cmd_fd: int, own_uid: bool) -> None:
    """Watch the command pipe from a daemon thread: when its write end closes (the producer
    closed the REPL, or died, even of SIGKILL), kill this REPL's whole process group and, with a
    uid of its own, every process of that uid (``kill(-1)``), so a cell sleeping forever, or its
    processes, cannot outlive a dead producer. ``poll`` with no event asked reports only the
    hang-up and consumes nothing the main loop reads."""
    import select
    import signal

    def watch() -> None:
        poller = select.poll()
        poller.register(cmd_fd, 0)
        while True:
            try:
                events = poller.poll()
            except InterruptedError:
                continue
            if any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in events):
                break
        if own_uid:
            try:
                os.kill(-1, signal.SIGKILL)  # every process of this REPL's own uid, this one last
            except OSError:
                pass
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="rlmq-producer-watch", daemon=True).start()


def stdio(fd: int) -> io.TextIOWrapper:
    # Unbuffered text over the raw fd, as ``python -u`` does: nothing is lost on os._exit.
    return io.TextIOWrapper(
        io.FileIO(fd, "w", closefd=False),
        encoding="utf-8",
        errors="backslashreplace",
        write_through=True,
    )


def close_other_descriptors(keep: tuple[int, ...]) -> None:
    """Close every descriptor from 3 up but ``keep``: the child starts with exactly the ones it
    is given (fd 0-2 and its two pipes), whatever the parent's event loop left inheritable (uvloop
    keeps a launcher's inheritable descriptors open across the spawn: a log file, a socket to a
    Redis). ``os.closerange`` is ``close_range(2)`` where the kernel has it."""
    low = 3
    for fd in sorted(set(keep)):
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    os.closerange(low, 1 << 20)
    try:  # descriptors above the probe (a soft limit raised past 2**20): close them one by one
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor, already closed
