"""The :class:`Repl`: one persistent Python subprocess per rollout, as the producer sees it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any

from rlmq.common.errors import ReplError, ReplStartupError
from rlmq.common.settings import setting_default
from rlmq.producer.repl.cell import CellClock, CellResult, run_cell
from rlmq.producer.repl.cgroup import ReplCgroup
from rlmq.producer.repl.cgroup import create as create_cgroup
from rlmq.producer.repl.containment import Containment, note_containment
from rlmq.producer.repl.files import ContextFiles, prepare_files, retain_working_directory
from rlmq.producer.repl.handle import REAP_GRACE, ChildHandle, describe_death
from rlmq.producer.repl.launch import check_limits, child_env, child_interpreter, pip_install, rmtree, spawn_child
from rlmq.producer.repl.output import with_marker
from rlmq.producer.repl.sweep import sweep_uid
from rlmq.producer.repl_child import HOME, PROGRAM, UID_BASE

__all__ = ["Repl"]

log = logging.getLogger("rlmq.repl")

_CHILD = PROGRAM
_MESSAGE_SLACK = 64 * 1024  # bytes of a reply line besides the answer's characters
_RESET_NOTE = "its state (variables, imports) was reset. `context`, `llm_batch` and `answer` are available again."


class Repl:
    """One persistent Python subprocess per rollout, running model-written cells.

    The child interpreter (``sys.executable -I producer/repl_child/__main__.py``) keeps its
    globals across cells: ``context`` (the rollout's input, reloaded from JSON at
    every start), ``llm_batch(prompts: list[str]) -> list[str]`` (POSTs
    ``{"prompts": [...]}`` to ``endpoint_url`` with ``Authorization: Bearer
    <token>``, prints the response's ``summary`` and returns its ``results``) and
    ``answer = {"content": "", "ready": False}``.

    Everything is asyncio; the event loop is never blocked while a cell runs, so an
    interception server in the same loop can serve the cell's ``llm_batch`` calls.
    Use as ``async with Repl(...) as repl:`` or call :meth:`start` and :meth:`close`.

    What is contained, and what shows it (``tests/faults/test_repl_hostile.py``, run with
    namespaces and with ``namespaces=False``): the cell timeout is counted by the parent
    (the child cannot pause it); what the child sends the parent is bounded (cell output,
    answer, ``llm_batch`` bodies) and a child that sends more is killed; no variable of the
    producer's environment reaches the child; CPU time, memory, processes and file size are
    limited; every process the cell starts dies with the REPL (and with a producer killed by
    SIGKILL: the child watches its command pipe); a seccomp filter refuses it
    user namespaces of its own. As root, the child runs under a uid of its own and, once it
    is dead, what that uid left in the host's world-writable folders and System V IPC is
    removed (:func:`~.sweep.sweep_uid`). Where the kernel allows namespaces (as root, or
    through an unprivileged user namespace), also: no network but the interception Unix
    socket; a read-only host file system; host ``/tmp``, ``/run``, ``/var/run``,
    ``/dev/shm``, ``/var/tmp`` and listening host Unix sockets hidden; a private tmpfs of
    ``scratch_bytes`` as the only writable place, gone with the REPL (and with a restart);
    as root, other uids' processes hidden.
    :attr:`containment` says which of these the running child got.

    Args:
        context: the rollout's input (str, list or dict; must be JSON-serializable;
            a few MB is fine), the REPL variable ``context``.
        endpoint_url: the rollout's interception URL that ``llm_batch`` POSTs to.
        token: the bearer token ``llm_batch`` sends; reaches the child only through
            a private pipe (never argv nor environment).
        max_output_length: characters of a cell's output kept; the rest is counted and
            replaced by a marker (see :func:`truncate_output`).
        max_answer_length: characters of ``answer["content"]`` that reach the producer; the
            child cuts it (and prints a note for the model), the parent cuts again, and a
            reply line longer than ``6 * max_answer_length + 64 KiB`` bytes kills the child.
        code_execution_timeout: seconds a cell may run before the REPL is killed and
            restarted with its state reset. Unless ``pause_timeout_during_llm_batch``
            is false, time during which the parent serves an ``llm_batch`` request that
            reached it during the cell (see :meth:`serving`) does not count; the child's word
            plays no part.
        max_startup_wait_seconds: seconds allowed for a (re)start of the child, and
            separately for the ``pip install`` of ``pip_install_packages``.
        pip_install_packages: pip requirement specifiers installed once, before the
            first start, with ``pip install --target <workdir>/site-packages`` and put
            first on the child's ``sys.path`` (and on ``PYTHONPATH``).
        cpu_seconds: RLIMIT_CPU of the child (CPU seconds since its last restart); on
            reaching it the child dies of SIGXCPU and is restarted. ``None``: no limit.
        memory_bytes: the REPL's memory (bytes). With a cgroup (see ``cgroup``) every page its
            processes allocate counts, together (anonymous memory, ``memfd``, shared memory,
            files in its tmpfs); over it the kernel kills a process of the REPL and the REPL
            is restarted. Also RLIMIT_AS of each process: beyond it ``MemoryError``.
        max_processes: RLIMIT_NPROC of the child (processes and threads at once), and the
            ``pids.max`` of its cgroup.
        scratch_bytes: size of the private tmpfs (bytes) and the child's RLIMIT_FSIZE.
        max_open_files: RLIMIT_NOFILE of each of the child's processes (``None``: inherited).
        run_as: ``"auto"``: as root the child drops to a uid of its own
            (``100000 + its pid``, no groups, no_new_privs) before any cell runs. ``None``: no.
        unix_socket: path of the interception server's Unix socket; when given, ``llm_batch``
            speaks HTTP over it instead of TCP to ``endpoint_url``'s host.
        isolate_network: with ``unix_socket``, give the child a network namespace of its own.
        namespaces: ``False`` forces the fallback of a host without namespaces (no network
            or mount namespace); :attr:`containment` and the log then say what is not contained.
        max_batch_bytes / max_batch_prompts: the largest ``llm_batch`` the child sends
            (bytes of JSON body, prompts); the interception server checks again.
        llm_batch_timeout: socket timeout (seconds) of an ``llm_batch`` HTTP request.
        pause_timeout_during_llm_batch: see ``code_execution_timeout``.
        tools: root tools, ``{"name": str, "doc": str}`` each: REPL globals that post their
            arguments to the interception server's ``/root_tool`` (see ``repl_child``).
        tool_timeout: seconds the producer gives one root-tool call (the child waits a
            little longer for the answer).
        max_tool_bytes: largest JSON body of one root-tool call (bytes); the server checks again.
        cgroup: ``True``: as root, a cgroup of its own bounds the REPL's memory and processes
            together (v2 where the host offers it, else v1; see :mod:`.cgroup`); where none
            can be made, ``memfd_create``, ``memfd_secret`` and ``shmget`` are refused instead
            and :attr:`containment` says so. A path: a delegated cgroup v2 folder to make it
            in. ``False``: no cgroup (that fallback).
        files: the context as files (:mod:`.files`): written once into the host folder, and
            copied by the child into its working directory at every (re)start, so a restarted
            REPL finds them as they were at first. ``None``: an empty working directory.
        language: ``"python"`` (cells are Python) or ``"bash"`` (cells are bash, as the
            verifiers RLMEnv's ``repl_language="bash"``: see ``producer/repl_child/bash.py``).
        output_format: ``"rlmq"`` or ``"reference"`` (verifiers 0.1.14's ``RLMEnv``: a Python
            cell's Python-level stderr after a ``stderr:`` line, its last expression as
            ``Out[n]: repr``; a cell of either language with no output reads ``(no output)``).
        sub_llms: ``False``: the REPL has no ``llm_batch`` nor ``rlm_batch`` (``enable_sub_llms``).

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
        max_output_length: int = setting_default("max_output_length"),
        max_answer_length: int = 1_000_000,
        code_execution_timeout: float = setting_default("code_execution_timeout"),
        max_startup_wait_seconds: float = setting_default("max_startup_wait_seconds"),
        pip_install_packages: Sequence[str] = (),
        cpu_seconds: int | None = 600,
        memory_bytes: int | None = 2 * 1024**3,
        max_processes: int | None = 64,
        scratch_bytes: int = 256 * 1024**2,
        max_open_files: int | None = 256,
        run_as: str | int | None = "auto",
        unix_socket: str | None = None,
        isolate_network: bool = True,
        namespaces: bool = True,
        max_batch_bytes: int = setting_default("max_batch_bytes"),
        max_batch_prompts: int = setting_default("max_batch_prompts"),
        llm_batch_timeout: float = 3600.0,
        pause_timeout_during_llm_batch: bool = True,
        tools: Sequence[dict[str, str]] = (),
        tool_timeout: float = 60.0,
        max_tool_bytes: int = 1024 * 1024,
        cgroup: bool | str = True,
        files: ContextFiles | None = None,
        language: str = "python",
        output_format: str = "rlmq",
        sub_llms: bool = True,
    ) -> None:
        check_limits(
            (max_output_length, max_answer_length),
            {
                "code_execution_timeout": code_execution_timeout,
                "max_startup_wait_seconds": max_startup_wait_seconds,
                "llm_batch_timeout": llm_batch_timeout,
                "scratch_bytes": scratch_bytes,
                "max_batch_bytes": max_batch_bytes,
                "max_batch_prompts": max_batch_prompts,
            },
            {"cpu_seconds": cpu_seconds, "memory_bytes": memory_bytes},
        )
        try:
            self._context_json = json.dumps(context, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"context must be JSON-serializable: {exc}") from exc
        self._endpoint_url = endpoint_url
        self._token = token
        self.max_output_length = max_output_length
        self.max_answer_length = max_answer_length
        self.output_format = output_format
        self.sub_llms = sub_llms
        self._max_message_bytes = 6 * max_answer_length + _MESSAGE_SLACK
        self.code_execution_timeout = code_execution_timeout
        self.max_startup_wait_seconds = max_startup_wait_seconds
        self._pip_packages = list(pip_install_packages)
        self._cpu_seconds = cpu_seconds
        self._memory_bytes = memory_bytes
        self._max_processes = max_processes
        self._scratch_bytes = scratch_bytes
        self._max_open_files = max_open_files
        self._run_as = run_as
        self._unix_socket = unix_socket
        self._isolate_network = isolate_network and unix_socket is not None
        self._namespaces = namespaces
        self._max_batch_bytes = max_batch_bytes
        self._max_batch_prompts = max_batch_prompts
        self.containment: Containment | None = None
        """After start: what the running child is contained by (see :class:`Containment`)."""
        self._llm_batch_timeout = llm_batch_timeout
        self._pause_during_llm_batch = pause_timeout_during_llm_batch
        self._tools = [dict(t) for t in tools]
        self._tool_timeout = tool_timeout
        self._max_tool_bytes = max_tool_bytes
        self._want_cgroup = cgroup
        if language not in ("python", "bash"):
            raise ValueError(f"language must be python or bash, not {language!r}")
        self.language = language
        self._files = files
        self._files_ready = files is None
        self._cgroup: ReplCgroup | None = None
        self._no_cgroup_why = "not asked (cgroup=False)"

        self._workdir: str | None = None
        self._packages_installed = not self._pip_packages
        self._child: ChildHandle | None = None
        self._clock: CellClock | None = None
        self._to_sweep: set[int] = set()
        self._lock = asyncio.Lock()
        self._closed = False
        self.restarts = 0  # times the child was restarted after a timeout or a death

    # ------------------------------------------------------------------ properties

    @property
    def network_isolated(self) -> bool | None:
        """After start: whether the child runs in a network namespace of its own."""
        return None if self.containment is None else self.containment.network

    @property
    def workdir(self) -> str | None:
        """The REPL's host folder (context, packages); ``None`` before start / after close."""
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
                ``max_startup_wait_seconds``, or it failed; or the context files were refused
                (a ``context_dir`` with a symlink, too large for the scratch space).
            ReplError: the REPL was closed.
        """
        async with self._lock:
            await self._ensure_started()

    async def retain_files(self) -> str | None:
        """Copy the working directory out of the running REPL into a new host folder (the
        reference's ``retain_filesystem_after_rollout``); ``None``: no REPL is running.
        What could not be copied (pipes, sockets) is logged."""
        child = self._child
        if child is None or self._workdir is None or self.containment is None:
            return None
        private = self.containment.private_fs
        dest, skipped = await asyncio.to_thread(
            retain_working_directory,
            child.proc.pid,
            private,
            self._workdir,
            HOME,
        )
        if skipped:
            log.warning("the REPL's files kept in %s lack %d entries: %s", dest, len(skipped), skipped[:5])
        return dest

    async def close(self) -> None:
        """Kill the child's process group (and uid) and remove the work dir. Idempotent.

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
        await self._sweep()
        await self._remove_cgroup()
        workdir, self._workdir = self._workdir, None
        if workdir is not None:
            rmtree(workdir)

    @property
    def cgroup(self) -> ReplCgroup | None:
        """The REPL's cgroup (see ``cgroup``), once started; ``None``: none."""
        return self._cgroup

    async def _remove_cgroup(self) -> None:
        """Kill what is left in the cgroup and remove it (waits up to 10 s for its processes)."""
        cgroup, self._cgroup = self._cgroup, None
        if cgroup is None:
            return
        deadline = time.monotonic() + 10.0
        while True:
            cgroup.kill()
            if not cgroup.pids() and cgroup.remove():
                return
            if time.monotonic() > deadline:
                log.warning("the REPL's cgroup %s could not be removed (processes left in it)", cgroup.folders)
                return
            await asyncio.sleep(0.05)  # dying processes leave the cgroup; polled against the deadline

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """Wrap the parent's serving of one ``llm_batch`` request of this REPL (the handler the
        interception server calls for this REPL's token): while at least one request that
        arrived during the running cell is being served, that cell's timeout is paused. This is
        the parent's own account; nothing the child sends can pause the timeout, and a request
        still in flight from an earlier cell does not pause a later one."""
        clock = self._clock
        if clock is not None:
            clock.add_serving(+1)
        try:
            yield
        finally:
            if clock is not None:
                clock.add_serving(-1)

    # ------------------------------------------------------------------ cells

    async def execute(self, code: str, history: str | None = None) -> CellResult:
        """Run one cell of Python ``code`` in the persistent globals.

        Starts the child first if needed. A cell running past
        ``code_execution_timeout`` seconds, a child that dies (``os._exit``, a
        signal, RLIMIT_CPU), or one that sends a message over the size limit, is not an
        error: the REPL is restarted and the :class:`CellResult` says so
        (``timed_out`` / ``restarted``, with a note in ``output``). Cells run one at a time.

        Args:
            code: Python source, any number of statements; the repr of a last
                expression statement is printed when it is not ``None`` (bash with ``language="bash"``).
            history: the conversation so far as JSON lines (the reference's ``.messages``,
                ``expose_message_history``): written to ``.messages`` in the REPL's first
                working directory before the cell runs; ``None``: not written.

        Returns:
            The cell's :class:`CellResult`.

        Raises:
            ReplStartupError: the child could not be (re)started.
            ReplError: the REPL was closed (before or during the cell).
        """
        async with self._lock:
            child = await self._ensure_started()
            oom_kills = child.cgroup.oom_kills() if child.cgroup is not None else 0
            started = time.monotonic()
            try:
                reply, timed_out = await self._run_cell(child, code, history)
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
                return self._result(child, reply, seconds)

            self._child = None
            try:
                if timed_out:
                    child.kill()
                    await child.proc.wait()
                    note = (
                        f"[code execution timed out after {self.code_execution_timeout:g} s; the REPL "
                        f"was restarted and {_RESET_NOTE}]"
                    )
                elif child.oversized:
                    child.kill()
                    await child.proc.wait()
                    note = (
                        f"[the REPL sent the producer a message of more than {self._max_message_bytes} bytes "
                        f"(answer['content'] is limited to {self.max_answer_length} characters); it was killed, "
                        f"restarted and {_RESET_NOTE}]"
                    )
                else:
                    status = await child.reap(REAP_GRACE)
                    oom = child.cgroup is not None and child.cgroup.oom_kills() > oom_kills
                    death = describe_death(status, self._cpu_seconds, self._memory_bytes, oom)
                    note = f"[{death}; it was restarted and {_RESET_NOTE}]"
                child.kill()  # whatever the cell started in the process group goes too
                child.drain_output()
                text, dropped = child.output.take()
            finally:
                child.kill()
                child.release()
            self.restarts += 1
            await self._sweep()
            await self._ensure_started()
            return CellResult(
                output=_append(with_marker(text, dropped), note),
                answer_ready=False,
                answer_content="",
                seconds=seconds,
                timed_out=timed_out,
                restarted=True,
            )

    def _result(self, child: ChildHandle, reply: dict[str, Any], seconds: float) -> CellResult:
        """The result of a cell the child answered: its output (drained now) and its answer,
        cut again to ``max_answer_length`` characters."""
        child.drain_output()
        text, dropped = child.output.take()
        output = with_marker(text, dropped)
        if not output and self.output_format == "reference":
            output = "(no output)"
        content = reply.get("answer_content", "")
        content = content if isinstance(content, str) else ""
        if len(content) > self.max_answer_length:  # the child's own cut was bypassed
            output = _append(
                output,
                f"[answer['content'] has {len(content)} characters; only the first {self.max_answer_length} are kept]",
            )
            content = content[: self.max_answer_length]
        return CellResult(
            output=output,
            answer_ready=reply.get("answer_ready") is True,
            answer_content=content,
            seconds=seconds,
            timed_out=False,
            restarted=False,
            helper_error=str(reply["helper_error"])[:1000] if reply.get("helper_error") else None,
        )

    async def _run_cell(
        self, child: ChildHandle, code: str, history: str | None = None
    ) -> tuple[dict[str, Any] | None, bool]:
        """Send the cell and wait for its result: (result message or None if the child died, timed out)."""
        clock = CellClock(self.code_execution_timeout, self._pause_during_llm_batch)
        self._clock = clock
        try:
            return await run_cell(child, code, clock, self._llm_batch_timeout, history)
        finally:
            self._clock = None

    # ------------------------------------------------------------------ start-up

    async def _ensure_started(self) -> ChildHandle:
        if self._closed:
            raise ReplError("the REPL is closed")
        if self._child is not None:
            return self._child
        if self._workdir is None:
            self._workdir = tempfile.mkdtemp(prefix="rlmq-repl-")
        if not self._files_ready:
            assert self._files is not None
            try:
                await asyncio.to_thread(prepare_files, self._files, self._files_dir(), self._scratch_bytes)
            except (ValueError, OSError) as exc:
                raise ReplStartupError(f"the REPL's context files: {exc}") from exc
            self._files_ready = True
        if not self._packages_installed:
            await pip_install(self._pip_packages, self._site_packages(), self._workdir, self.max_startup_wait_seconds)
            self._packages_installed = True
        if self._cgroup is None and self._want_cgroup is not False:
            parent = self._want_cgroup if isinstance(self._want_cgroup, str) else None
            limit = self._memory_bytes if self._memory_bytes is not None else 1 << 62
            self._cgroup, self._no_cgroup_why = await asyncio.to_thread(
                create_cgroup, limit, self._max_processes, parent
            )
        child = await self._spawn()
        if self._closed:  # close() ran while the child was starting
            child.kill()
            child.release()
            await child.proc.wait()
            if self._workdir is not None:
                rmtree(self._workdir)
                self._workdir = None
            raise ReplError("the REPL is closed")
        self._child = child
        return child

    def _files_dir(self) -> str:
        assert self._workdir is not None
        return os.path.join(self._workdir, "files")

    def _site_packages(self) -> str:
        assert self._workdir is not None
        return os.path.join(self._workdir, "site-packages")

    async def _spawn(self) -> ChildHandle:
        """Start a child and wait for its ``ready`` message."""
        assert self._workdir is not None
        context_path = os.path.join(self._workdir, "context.json")
        # The folder is the producer's (the REPL may only read it); O_NOFOLLOW all the same.
        fd = os.open(context_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with open(fd, "w", encoding="utf-8") as f:
            f.write(self._context_json)
        init = {
            "op": "init",
            "url": self._endpoint_url,
            "token": self._token,
            "llm_batch_timeout": self._llm_batch_timeout,
            "workdir": self._workdir,
            "context_path": context_path,
            "files_dir": self._files_dir() if self._files is not None else None,
            "language": self.language,
            "output_format": self.output_format,
            "sub_llms": self.sub_llms,
            "sys_path": [self._site_packages()] if self._pip_packages else [],
            "cpu_seconds": self._cpu_seconds,
            "memory_bytes": self._memory_bytes,
            "max_processes": self._max_processes,
            "scratch_bytes": self._scratch_bytes,
            "max_open_files": self._max_open_files,
            "run_as": self._run_as,
            "unix_socket": self._unix_socket,
            "isolate_network": self._isolate_network,
            "namespaces": self._namespaces,
            "max_answer_length": self.max_answer_length,
            "max_batch_bytes": self._max_batch_bytes,
            "max_batch_prompts": self._max_batch_prompts,
            "tools": self._tools,
            "tool_timeout": self._tool_timeout,
            "max_tool_bytes": self._max_tool_bytes,
            "refuse_shared_memory": self._cgroup is None,
        }
        child, ready = await spawn_child(
            [child_interpreter(self._run_as), "-I", _CHILD],
            workdir=self._workdir,
            env=child_env(self._workdir, self._site_packages() if self._pip_packages else None),
            init=init,
            max_message_bytes=self._max_message_bytes,
            max_output_length=self.max_output_length,
            timeout=self.max_startup_wait_seconds,
            cgroup=self._cgroup,
        )
        uid = ready.get("uid")
        child.uid = uid if isinstance(uid, int) and uid >= UID_BASE else None
        self.containment = Containment.from_ready(
            ready,
            isolate_network=self._isolate_network,
            cgroup=self._cgroup.version if self._cgroup is not None else None,
            no_cgroup_why=self._no_cgroup_why,
        )
        if child.uid is not None and not self.containment.private_fs:
            self._to_sweep.add(child.uid)  # its files in /tmp & co. are removed once it is dead
        note_containment(self.containment)
        return child

    async def _sweep(self) -> None:
        """Remove what dead children's own uids left in the host's world-writable folders and
        System V IPC (only children without a private file system; see :mod:`.sweep`)."""
        alive = self._child.uid if self._child is not None else None
        for uid in sorted(self._to_sweep - {alive}):
            self._to_sweep.discard(uid)
            await asyncio.to_thread(sweep_uid, uid)


def _append(output: str, note: str) -> str:
    return f"{output}\n{note}" if output and not output.endswith("\n") else output + note
