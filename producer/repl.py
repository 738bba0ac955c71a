"""The REPL sandbox: one persistent Python subprocess per rollout.

The root model's code runs in a child interpreter (``producer/repl_child.py``,
stdlib only) in which the long input is the variable ``context``, ``llm_batch``
posts prompts to the rollout's interception server, and ``answer`` holds the
final answer. See :class:`Repl`.

Isolation (DESIGN.md, invariant 3): the child gets an environment built from
scratch (no variable of the parent's), its own temporary folder as cwd, HOME and
TMPDIR, resource limits (CPU seconds, address space, no core files), its own
process group, and the interception URL and token only through a private pipe.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from rlmq.common.errors import ReplError, ReplStartupError
from rlmq.producer.repl_child import _reachable_by_others  # the child is stdlib-only; the parent shares its check

__all__ = ["CellResult", "Repl", "truncate_output"]

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "repl_child.py")
_MAX_MESSAGE = 1 << 30  # bytes: longest protocol line accepted (answers can be large)
_READ_CHUNK = 1 << 18  # bytes per read of the child's output pipe
_REAP_GRACE = 2.0  # seconds a child that closed its reply pipe gets to exit before SIGKILL
_PIP_ENV_KEYS = ("PATH", "HOME", "XDG_CACHE_HOME", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE")

_RESET_NOTE = "its state (variables, imports) was reset. `context`, `llm_batch` and `answer` are available again."


def _truncation_marker(dropped: int) -> str:
    return f"...\n[output truncated: {dropped} more characters]"


def truncate_output(text: str, limit: int) -> str:
    """Cut ``text`` to its first ``limit`` characters and append a visible marker.

    Args:
        text: the output to shorten.
        limit: the number of characters kept (>= 0).

    Returns:
        ``text`` unchanged when it has at most ``limit`` characters; otherwise its
        first ``limit`` characters followed by
        ``"...\\n[output truncated: N more characters]"`` (so the result is longer
        than ``limit`` by the marker).

    Raises:
        ValueError: ``limit`` is negative.
    """
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if len(text) <= limit:
        return text
    return text[:limit] + _truncation_marker(len(text) - limit)


@dataclass
class CellResult:
    """What one :meth:`Repl.execute` call produced.

    Attributes:
        output: stdout + stderr (tracebacks included) + the repr of a last expression,
            cut to ``max_output_length`` characters with a marker, plus a note when
            the REPL timed out or died.
        answer_ready: ``bool(answer["ready"])`` after the cell.
        answer_content: ``str(answer["content"])`` after the cell.
        seconds: wall time of the cell (seconds), up to its end, timeout or death.
        timed_out: the cell hit ``code_execution_timeout`` (the REPL was restarted).
        restarted: the REPL was restarted during or after this cell (timeout or crash);
            its variables and imports are gone.
    """

    output: str
    answer_ready: bool
    answer_content: str
    seconds: float
    timed_out: bool
    restarted: bool


class _OutputBuffer:
    """Keeps the first ``limit`` characters of a byte stream and counts the rest."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._parts: list[str] = []
        self._kept = 0
        self._dropped = 0
        self._decoder = _new_decoder()

    def feed(self, data: bytes, final: bool = False) -> None:
        self._add(self._decoder.decode(data, final))

    def _add(self, text: str) -> None:
        room = self._limit - self._kept
        if room <= 0:
            self._dropped += len(text)
            return
        head = text[:room]
        self._parts.append(head)
        self._kept += len(head)
        self._dropped += len(text) - len(head)

    def take(self) -> tuple[str, int]:
        """Return (kept text, characters dropped) and start afresh."""
        self.feed(b"", final=True)
        text, dropped = "".join(self._parts), self._dropped
        self._parts, self._kept, self._dropped = [], 0, 0
        self._decoder = _new_decoder()
        return text, dropped


def _new_decoder() -> Any:
    import codecs

    return codecs.getincrementaldecoder("utf-8")(errors="replace")


class _Child:
    """One running child interpreter and the parent's ends of its three pipes."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        reader: asyncio.StreamReader,
        reply_transport: asyncio.ReadTransport,
        cmd_fd: int,
        out_fd: int,
        output: _OutputBuffer,
    ) -> None:
        self.proc = proc
        self.reader = reader
        self.reply_transport = reply_transport
        self.cmd_fd = cmd_fd
        self.out_fd = out_fd
        self.output = output
        self.out_open = True
        self.released = False
        self.inflight = 0  # llm_batch requests in flight, as last reported by the child
        self.uid: int | None = None  # the child's own uid when it dropped privileges
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
        """Write one JSON line to the child's command pipe without blocking the loop."""
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
        """Read one message from the child; ``None`` on EOF (the child died or closed the pipe)."""
        try:
            line = await self.reader.readline()
        except (ValueError, asyncio.LimitOverrunError, ConnectionError):
            return None
        if not line.endswith(b"\n"):
            return None
        try:
            message = json.loads(line)
        except ValueError:
            return None
        return message if isinstance(message, dict) else None

    def kill(self) -> None:
        """SIGKILL the child's whole process group, and every process of its own uid (idempotent)."""
        _killpg(self.proc.pid)
        if self.uid is not None:
            _kill_uid(self.uid)
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


class Repl:
    """One persistent Python subprocess per rollout, running model-written cells.

    The child interpreter (``sys.executable -I producer/repl_child.py``) keeps its
    globals across cells: ``context`` (the rollout's input, reloaded from JSON at
    every start), ``llm_batch(prompts: list[str]) -> list[str]`` (POSTs
    ``{"prompts": [...]}`` to ``endpoint_url`` with ``Authorization: Bearer
    <token>``, prints the response's ``summary`` and returns its ``results``) and
    ``answer = {"content": "", "ready": False}``.

    Everything is asyncio; the event loop is never blocked while a cell runs, so an
    interception server in the same loop can serve the cell's ``llm_batch`` calls.
    Use as ``async with Repl(...) as repl:`` or call :meth:`start` and :meth:`close`.

    Args:
        context: the rollout's input (str, list or dict; must be JSON-serializable;
            a few MB is fine), the REPL variable ``context``.
        endpoint_url: the rollout's interception URL that ``llm_batch`` POSTs to.
        token: the bearer token ``llm_batch`` sends; reaches the child only through
            a private pipe (never argv nor environment).
        max_output_length: characters of a cell's output kept; the rest is replaced
            by a marker (see :func:`truncate_output`).
        code_execution_timeout: seconds a cell may run before the REPL is killed and
            restarted with its state reset. Unless ``pause_timeout_during_llm_batch``
            is false, time during which an ``llm_batch`` request is in flight does not
            count (sub-LLM batches can legitimately take long; the timeout is there
            for runaway code).
        max_startup_wait_seconds: seconds allowed for a (re)start of the child, and
            separately for the ``pip install`` of ``pip_install_packages``.
        pip_install_packages: pip requirement specifiers installed once, before the
            first start, with ``pip install --target <workdir>/site-packages`` and put
            first on the child's ``sys.path`` (and on ``PYTHONPATH`` for programs
            the cells start).
        cpu_seconds: RLIMIT_CPU of the child, in CPU seconds over its whole life
            (all cells since the last restart); on reaching it the child dies of
            SIGXCPU and is restarted. ``None``: no limit.
        max_processes: RLIMIT_NPROC of the child: processes and threads it (and what it
            starts) may run at once, so a fork bomb is refused (``BlockingIOError``) after
            that many. ``None``: no limit. Root ignores it, hence ``run_as``.
        run_as: ``"auto"`` (default): when the producer runs as root, the child drops to an
            unprivileged uid/gid of its own (``100000 + its pid``, no groups, no_new_privs)
            before any model-written code runs: it cannot write outside its folder (except
            world-writable places such as /tmp), cannot read the producer's
            ``/proc/<pid>/environ``, and every process it starts is killed with it, even one
            that left its process group. ``None``: stay as the producer's user.
        memory_bytes: RLIMIT_AS of the child (address space, bytes); allocations
            beyond it raise ``MemoryError`` in the cell. ``None``: no limit.
        unix_socket: path of the interception server's Unix socket; when given, ``llm_batch``
            speaks HTTP over it instead of TCP to ``endpoint_url``'s host.
        isolate_network: with ``unix_socket``, put the REPL in a network namespace of its own
            (no interface up, not even loopback), so model-written code can reach nothing but
            that socket. As root a plain network namespace; otherwise inside an unprivileged
            user namespace where the kernel allows those. Where neither works the REPL keeps
            the host's network, and ``network_isolated`` says so.
        llm_batch_timeout: socket timeout (seconds) of an ``llm_batch`` HTTP request.
        pause_timeout_during_llm_batch: see ``code_execution_timeout``.

    Raises:
        TypeError: ``context`` is not JSON-serializable.
        ValueError: a limit is not positive.
    """

    def __init__(
        self,
        *,
        context: str | list[Any] | dict[str, Any],
        endpoint_url: str,
        token: str,
        max_output_length: int = 8192,
        code_execution_timeout: float = 120.0,
        max_startup_wait_seconds: float = 120.0,
        pip_install_packages: Sequence[str] = (),
        cpu_seconds: int | None = 600,
        memory_bytes: int | None = 2 * 1024**3,
        max_processes: int | None = 64,
        run_as: str | int | None = "auto",
        unix_socket: str | None = None,
        isolate_network: bool = True,
        llm_batch_timeout: float = 3600.0,
        pause_timeout_during_llm_batch: bool = True,
    ) -> None:
        if max_output_length < 0:
            raise ValueError("max_output_length must be >= 0")
        for name, value in (
            ("code_execution_timeout", code_execution_timeout),
            ("max_startup_wait_seconds", max_startup_wait_seconds),
            ("llm_batch_timeout", llm_batch_timeout),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if cpu_seconds is not None and cpu_seconds <= 0:
            raise ValueError("cpu_seconds must be > 0 or None")
        if memory_bytes is not None and memory_bytes <= 0:
            raise ValueError("memory_bytes must be > 0 or None")
        try:
            self._context_json = json.dumps(context, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"context must be JSON-serializable: {exc}") from exc
        self._endpoint_url = endpoint_url
        self._token = token
        self.max_output_length = max_output_length
        self.code_execution_timeout = code_execution_timeout
        self.max_startup_wait_seconds = max_startup_wait_seconds
        self._pip_packages = list(pip_install_packages)
        self._cpu_seconds = cpu_seconds
        self._memory_bytes = memory_bytes
        self._max_processes = max_processes
        self._run_as = run_as
        self._unix_socket = unix_socket
        self._isolate_network = isolate_network and unix_socket is not None
        self.network_isolated: bool | None = None
        """After start: whether the child runs in a network namespace of its own."""
        self._llm_batch_timeout = llm_batch_timeout
        self._pause_during_llm_batch = pause_timeout_during_llm_batch

        self._workdir: str | None = None
        self._packages_installed = not self._pip_packages
        self._child: _Child | None = None
        self._lock = asyncio.Lock()
        self._closed = False
        self.restarts = 0  # times the child was restarted after a timeout or a death

    # ------------------------------------------------------------------ properties

    @property
    def workdir(self) -> str | None:
        """The REPL's temporary folder (cwd, HOME, TMPDIR); ``None`` before start / after close."""
        return self._workdir

    @property
    def pid(self) -> int | None:
        """Process id of the running child (also its process-group id), or ``None``."""
        return self._child.proc.pid if self._child is not None else None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Repl:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Create the work dir, install packages (first time) and start the child.

        Does nothing when the child is already running.

        Raises:
            ReplStartupError: the child (or the pip install) was not ready within
                ``max_startup_wait_seconds``, or it failed.
            ReplError: the REPL was closed.
        """
        async with self._lock:
            await self._ensure_started()

    async def close(self) -> None:
        """Kill the child's process group and remove the work dir. Idempotent.

        A cell running concurrently ends with :class:`ReplError`.
        """
        self._closed = True
        child, self._child = self._child, None
        if child is not None:
            child.kill()
            child.release()
            try:
                await asyncio.wait_for(child.proc.wait(), 10.0)
            except TimeoutError:  # pragma: no cover - SIGKILL does not fail
                pass
        workdir, self._workdir = self._workdir, None
        if workdir is not None:
            _rmtree(workdir)

    # ------------------------------------------------------------------ cells

    async def execute(self, code: str) -> CellResult:
        """Run one cell of Python ``code`` in the persistent globals.

        Starts the child first if needed. A cell running past
        ``code_execution_timeout`` seconds, or a child that dies (``os._exit``, a
        signal, RLIMIT_CPU), is not an error: the REPL is restarted and the
        :class:`CellResult` says so (``timed_out`` / ``restarted``, with a note in
        ``output``). Cells of one Repl run one at a time.

        Args:
            code: Python source, any number of statements; the repr of a last
                expression statement is printed when it is not ``None``.

        Returns:
            The cell's :class:`CellResult`.

        Raises:
            ReplStartupError: the child could not be (re)started.
            ReplError: the REPL was closed (before or during the cell).
        """
        async with self._lock:
            child = await self._ensure_started()
            started = time.monotonic()
            try:
                reply, timed_out = await self._run_cell(child, code)
            except BaseException:
                # Cancelled (or an internal failure) mid-cell: the child's state is
                # unknown and it may still be running; start afresh next time.
                if self._child is child:
                    self._child = None
                    child.kill()
                    child.release()
                raise
            seconds = time.monotonic() - started

            if self._closed:
                raise ReplError("the REPL was closed while a cell was running")

            if reply is not None:
                child.drain_output()
                text, dropped = child.output.take()
                return CellResult(
                    output=_with_marker(text, dropped),
                    answer_ready=bool(reply.get("answer_ready", False)),
                    answer_content=str(reply.get("answer_content", "")),
                    seconds=seconds,
                    timed_out=False,
                    restarted=False,
                )

            self._child = None
            try:
                if timed_out:
                    child.kill()
                    await child.proc.wait()
                    note = (
                        f"[code execution timed out after {self.code_execution_timeout:g} s; the REPL "
                        f"was restarted and {_RESET_NOTE}]"
                    )
                else:
                    status = await child.reap(_REAP_GRACE)
                    note = f"[{self._describe_death(status)}; it was restarted and {_RESET_NOTE}]"
                child.kill()  # whatever the cell started in the process group goes too
                child.drain_output()
                text, dropped = child.output.take()
            finally:
                child.kill()
                child.release()
            self.restarts += 1
            await self._ensure_started()
            output = _with_marker(text, dropped)
            output = f"{output}\n{note}" if output and not output.endswith("\n") else output + note
            return CellResult(
                output=output,
                answer_ready=False,
                answer_content="",
                seconds=seconds,
                timed_out=timed_out,
                restarted=True,
            )

    async def _run_cell(self, child: _Child, code: str) -> tuple[dict[str, Any] | None, bool]:
        """Send the cell and wait for its result: (result message or None if the child died, timed out)."""
        loop = asyncio.get_running_loop()
        remaining = self.code_execution_timeout
        mark = loop.time()

        def account() -> None:
            nonlocal remaining, mark
            now = loop.time()
            if not (self._pause_during_llm_batch and child.inflight > 0):
                remaining -= now - mark
            mark = now

        try:
            await asyncio.wait_for(child.send({"op": "exec", "code": code}), remaining)
        except TimeoutError:
            return None, True
        except OSError:  # BrokenPipeError: the child is gone
            return None, False
        while True:
            account()
            if remaining <= 0:
                return None, True
            if self._pause_during_llm_batch and child.inflight > 0:
                # Paused, but never unbounded: one batch's own timeout plus slack.
                wait = self._llm_batch_timeout + self.code_execution_timeout
            else:
                wait = remaining
            try:
                message = await asyncio.wait_for(child.receive(), wait)
            except TimeoutError:
                return None, True
            if message is None:
                return None, False
            kind = message.get("type")
            if kind == "llm_batch":
                account()
                inflight = message.get("inflight")
                child.inflight = inflight if isinstance(inflight, int) and inflight > 0 else 0
            elif kind == "result":
                return message, False

    def _describe_death(self, status: int | None) -> str:
        if status is None:
            return "the REPL process stopped answering (its control pipe was closed) and was killed"
        if status >= 0:
            return f"the REPL process died (exit code {status})"
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        detail = ""
        if -status == signal.SIGXCPU and self._cpu_seconds is not None:
            detail = f"; CPU time limit of {self._cpu_seconds} s reached"
        elif -status == signal.SIGKILL and self._memory_bytes is not None:
            detail = "; possibly out of memory"
        return f"the REPL process died (killed by {name}{detail})"

    # ------------------------------------------------------------------ start-up

    async def _ensure_started(self) -> _Child:
        if self._closed:
            raise ReplError("the REPL is closed")
        if self._child is not None:
            return self._child
        if self._workdir is None:
            self._workdir = tempfile.mkdtemp(prefix="rlmq-repl-")
        if not self._packages_installed:
            await self._pip_install()
            self._packages_installed = True
        child = await self._spawn()
        if self._closed:  # close() ran while the child was starting
            child.kill()
            child.release()
            await child.proc.wait()
            if self._workdir is not None:
                _rmtree(self._workdir)
                self._workdir = None
            raise ReplError("the REPL is closed")
        self._child = child
        return child

    def _site_packages(self) -> str:
        assert self._workdir is not None
        return os.path.join(self._workdir, "site-packages")

    def _child_env(self) -> dict[str, str]:
        assert self._workdir is not None
        python_bin = os.path.dirname(sys.executable)
        env = {
            "PATH": os.pathsep.join([python_bin, "/usr/local/bin", "/usr/bin", "/bin"]),
            "HOME": self._workdir,
            "TMPDIR": self._workdir,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        if self._pip_packages:
            env["PYTHONPATH"] = self._site_packages()
        return env

    async def _pip_install(self) -> None:
        assert self._workdir is not None
        env = {k: v for k, v in os.environ.items() if k in _PIP_ENV_KEYS or _is_network_setting(k)}
        env.update({"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TMPDIR": self._workdir, "PYTHONDONTWRITEBYTECODE": "1"})
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-input",
            "--disable-pip-version-check",
            "--target",
            self._site_packages(),
            *self._pip_packages,
        ]
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            cwd=self._workdir,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self.max_startup_wait_seconds)
        except BaseException as exc:
            _killpg(proc.pid)
            await proc.wait()
            if isinstance(exc, asyncio.TimeoutError):
                raise ReplStartupError(
                    f"pip install of {self._pip_packages} did not finish within {self.max_startup_wait_seconds:g} s"
                ) from None
            raise
        if proc.returncode != 0:
            tail = out.decode("utf-8", "replace")[-2000:]
            raise ReplStartupError(f"pip install of {self._pip_packages} failed (exit code {proc.returncode}):\n{tail}")

    async def _spawn(self) -> _Child:
        """Start a child and wait for its ``ready`` message."""
        assert self._workdir is not None
        loop = asyncio.get_running_loop()
        context_path = os.path.join(self._workdir, "context.json")
        with open(context_path, "w", encoding="utf-8") as f:
            f.write(self._context_json)

        cmd_r, cmd_w = os.pipe()
        reply_r, reply_w = os.pipe()
        out_r, out_w = os.pipe()
        parent_fds = [cmd_w, reply_r, out_r]
        child_fds = [cmd_r, reply_w, out_w]
        proc: asyncio.subprocess.Process | None = None
        child: _Child | None = None
        try:
            for fd in parent_fds:
                os.set_blocking(fd, False)
            proc = await asyncio.create_subprocess_exec(
                _child_interpreter(self._run_as),
                "-I",
                _CHILD,
                str(cmd_r),
                str(reply_w),
                cwd=self._workdir,
                env=self._child_env(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out_w,
                stderr=out_w,
                pass_fds=(cmd_r, reply_w),
                start_new_session=True,
            )
            for fd in child_fds:
                os.close(fd)
            child_fds = []
            reader = asyncio.StreamReader(limit=_MAX_MESSAGE)
            reply_file = os.fdopen(reply_r, "rb", buffering=0)
            parent_fds.remove(reply_r)  # owned by reply_file, then by the transport
            try:
                transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), reply_file)
            except BaseException:
                reply_file.close()
                raise
            child = _Child(proc, reader, transport, cmd_w, out_r, _OutputBuffer(self.max_output_length))
            parent_fds = []
            await asyncio.wait_for(self._handshake(child), self.max_startup_wait_seconds)
        except BaseException as exc:
            output = ""
            if child is not None:
                child.kill()
                await child.proc.wait()
                child.drain_output()
                output, _ = child.output.take()
                child.release()
            elif proc is not None:
                _killpg(proc.pid)
                await proc.wait()
            for fd in parent_fds + child_fds:
                os.close(fd)
            if isinstance(exc, asyncio.TimeoutError):
                raise ReplStartupError(
                    f"the REPL was not ready within {self.max_startup_wait_seconds:g} s" + _tail(output)
                ) from None
            if isinstance(exc, (ReplStartupError, OSError)):
                raise ReplStartupError(f"the REPL failed to start: {exc}" + _tail(output)) from None
            raise
        child.output.take()  # start-up noise (warnings) is nobody's cell output
        return child

    async def _handshake(self, child: _Child) -> None:
        await child.send(
            {
                "op": "init",
                "url": self._endpoint_url,
                "token": self._token,
                "llm_batch_timeout": self._llm_batch_timeout,
                "context_path": os.path.join(self._workdir or "", "context.json"),
                "sys_path": [self._site_packages()] if self._pip_packages else [],
                "cpu_seconds": self._cpu_seconds,
                "memory_bytes": self._memory_bytes,
                "max_processes": self._max_processes,
                "run_as": self._run_as,
                "unix_socket": self._unix_socket,
                "isolate_network": self._isolate_network,
            }
        )
        message = await child.receive()
        if message is None or message.get("type") != "ready":
            status = await child.reap(_REAP_GRACE)
            raise ReplStartupError(f"the child exited before it was ready (status {status})")
        uid = message.get("uid")
        child.uid = uid if isinstance(uid, int) and uid >= _MIN_OWN_UID else None
        self.network_isolated = bool(message.get("net_isolated"))


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _with_marker(text: str, dropped: int) -> str:
    return text + _truncation_marker(dropped) if dropped else text


def _tail(output: str, limit: int = 2000) -> str:
    output = output.strip()
    return f"; its output:\n{output[-limit:]}" if output else ""


def _is_network_setting(key: str) -> bool:
    lower = key.lower()
    return lower.startswith("pip_") or lower in ("http_proxy", "https_proxy", "no_proxy", "all_proxy")


def _child_interpreter(run_as: str | int | None) -> str:
    """The Python that runs the REPL child: this one, unless the child will drop to its own
    uid and this interpreter's stdlib is private to root (pyenv under /root, say); then a
    system Python of the same version, when there is one, so the dropped child can import."""
    import sysconfig

    if run_as is None or os.geteuid() != 0 or _reachable_by_others(sysconfig.get_paths()["stdlib"]):
        return sys.executable
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (f"/usr/local/bin/python{version}", f"/usr/bin/python{version}"):
        if os.access(candidate, os.X_OK) and _reachable_by_others(candidate):
            return candidate
    return sys.executable  # the child then stays root (see repl_child._drop_privileges)


_MIN_OWN_UID = 100_000  # repl_child.UID_BASE: uids of REPL children (never a real user's)


def _kill_uid(uid: int) -> None:
    """SIGKILL every process running as ``uid`` (a REPL's own uid; never below 100000)."""
    if uid < _MIN_OWN_UID or uid == os.getuid():
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


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _rmtree(path: str) -> None:
    """Remove ``path`` even when cells made parts of it read-only."""

    def onerror(func: Callable[..., Any], p: str, _exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            os.chmod(p, stat.S_IRWXU)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=onerror)
