"""The parent's handle on one running REPL child process: its pipes, output and killing it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import Any

from rlmq.producer.repl.cgroup import ReplCgroup
from rlmq.producer.repl.output import OutputBuffer
from rlmq.producer.repl_child import UID_BASE

__all__ = ["ChildHandle", "describe_death", "kill_uid", "killpg"]

_READ_CHUNK = 1 << 18  # bytes per read of the child's output pipe

REAP_GRACE = 2.0
"""Seconds a child that closed its reply pipe gets to exit before SIGKILL."""


class ChildHandle:
    """The parent's side of one running child interpreter: the process and the parent's ends
    of its three pipes (commands to the child, the child's replies, the child's fd 1/2).

    Args:
        proc: the child process.
        reader: reads the reply pipe; its ``limit`` (bytes) bounds one message, and a longer
            one is never buffered whole (see :meth:`receive`).
        reply_transport: the transport feeding ``reader``.
        cmd_fd: the write end of the command pipe (non-blocking).
        out_fd: the read end of the child's fd 1/2 pipe (non-blocking).
        output: where the child's fd 1/2 output goes (bounded).
    """

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        reader: asyncio.StreamReader,
        reply_transport: asyncio.ReadTransport,
        cmd_fd: int,
        out_fd: int,
        output: OutputBuffer,
    ) -> None:
        self.proc = proc
        self.reader = reader
        self.reply_transport = reply_transport
        self.cmd_fd = cmd_fd
        self.out_fd = out_fd
        self.output = output
        self.out_open = True
        self.released = False
        self.oversized = False  # the child sent a message over the reader's limit
        self.uid: int | None = None  # the child's own uid when it dropped privileges
        self.cgroup: ReplCgroup | None = None  # the REPL's cgroup: killed with it
        loop = asyncio.get_running_loop()
        loop.add_reader(out_fd, self._on_output)

    def _read_once(self) -> bool:
        """Move one chunk of the child's fd 1/2 output into the buffer; False when nothing more
        is there now (or ever: the pipe closed)."""
        try:
            data = os.read(self.out_fd, _READ_CHUNK)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self._stop_output()
            return False
        self.output.feed(data)
        return True

    def _on_output(self) -> None:
        self._read_once()

    def _stop_output(self) -> None:
        if self.out_open:
            self.out_open = False
            asyncio.get_running_loop().remove_reader(self.out_fd)

    def drain_output(self, max_chunks: int = 256) -> None:
        """Read what the child already wrote to fd 1/2 (bounded, for writers that never stop)."""
        for _ in range(max_chunks):
            if not self.out_open or not self._read_once():
                return

    async def send(self, message: dict[str, Any]) -> None:
        """Write one JSON line to the child's command pipe without blocking the loop.

        Raises:
            OSError: the child closed its end (``BrokenPipeError``).
        """
        loop = asyncio.get_running_loop()
        view = memoryview((json.dumps(message) + "\n").encode("utf-8", "surrogatepass"))
        while view:
            try:
                written = os.write(self.cmd_fd, view)
            except BlockingIOError:
                writable: asyncio.Future[None] = loop.create_future()
                loop.add_writer(self.cmd_fd, _resolve, writable)
                try:
                    await writable
                finally:
                    loop.remove_writer(self.cmd_fd)
                continue
            view = view[written:]

    async def receive(self) -> dict[str, Any] | None:
        """Read one message from the child; ``None`` on EOF (the child died or closed the pipe),
        on a line that is not a JSON object, and on a line longer than the reader's limit
        (then :attr:`oversized` is set; the line's bytes were discarded as they came)."""
        try:
            line = await self.reader.readline()
        except (ValueError, asyncio.LimitOverrunError):
            self.oversized = True
            return None
        except ConnectionError:
            return None
        if not line.endswith(b"\n"):
            return None
        try:
            message = json.loads(line)
        except ValueError:
            return None
        return message if isinstance(message, dict) else None

    def kill(self) -> None:
        """SIGKILL the child's whole process group, every process of its own uid and of its
        cgroup (idempotent)."""
        killpg(self.proc.pid)
        if self.uid is not None:
            kill_uid(self.uid)
        if self.cgroup is not None:
            self.cgroup.kill()
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass

    def release(self) -> None:
        """Close the parent's pipe ends, once (the process is reaped by asyncio's child watcher)."""
        if self.released:
            return
        self.released = True
        self._stop_output()
        self.reply_transport.close()
        for fd in (self.cmd_fd, self.out_fd):
            try:
                os.close(fd)
            except OSError:
                pass

    async def reap(self, grace: float) -> int | None:
        """Wait up to ``grace`` seconds for the exit status; kill the group then. ``None``: still alive."""
        try:
            return await asyncio.wait_for(self.proc.wait(), grace)
        except TimeoutError:
            self.kill()
            await self.proc.wait()
            return None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def kill_uid(uid: int) -> None:
    """SIGKILL every process running as ``uid`` (a REPL's own uid; never below 100000).

    As root: a forked helper becomes ``uid`` and sends ``kill(-1, SIGKILL)``, which the
    kernel delivers to every process of that uid at once (no race with a process forking
    meanwhile) and which needs no file descriptor, so it works even when a cell has used up
    the producer's (many connections to the interception socket, say). Otherwise, or if
    the fork fails: a sweep of ``/proc``, three times.
    """
    if uid < UID_BASE or uid == os.getuid():
        return
    if os.geteuid() == 0:
        try:
            pid = os.fork()
        except OSError:
            pid = -1
        if pid == 0:  # the helper: only system calls, then out
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)  # every process this uid may signal: its own
            finally:
                os._exit(0)
        if pid > 0:
            os.waitpid(pid, 0)
            return
    for _ in range(3):  # a process forking meanwhile: sweep again
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                if os.stat(f"/proc/{name}").st_uid != uid:
                    continue
                os.kill(int(name), signal.SIGKILL)
                found = True
            except (OSError, ValueError):
                continue
        if not found:
            return


def killpg(pid: int) -> None:
    """SIGKILL the process group ``pid`` (gone or not ours: nothing)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def describe_death(
    status: int | None, cpu_seconds: int | None, memory_bytes: int | None, out_of_memory: bool = False
) -> str:
    """A sentence for the model about how the child ended (``status``: its exit status, negative
    for a signal, ``None``: it stopped answering and was killed; ``out_of_memory``: the kernel
    ended a process of the REPL's cgroup for memory)."""
    if out_of_memory and memory_bytes is not None:
        return (
            f"the REPL ran out of memory (at most {memory_bytes} bytes for all its processes, shared memory "
            "and files in memory together) and was killed"
        )
    if status is None:
        return "the REPL process stopped answering (its control pipe was closed) and was killed"
    if status >= 0:
        return f"the REPL process died (exit code {status})"
    try:
        name = signal.Signals(-status).name
    except ValueError:
        name = f"signal {-status}"
    detail = ""
    if -status == signal.SIGXCPU and cpu_seconds is not None:
        detail = f"; CPU time limit of {cpu_seconds} s reached"
    elif -status == signal.SIGKILL and memory_bytes is not None:
        detail = "; possibly out of memory"
    return f"the REPL process died (killed by {name}{detail})"
