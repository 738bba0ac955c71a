"""Preparing a REPL child's start: its environment, its interpreter, its packages, its folder."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rlmq.common.errors import ReplStartupError
from rlmq.producer.repl.cgroup import ReplCgroup
from rlmq.producer.repl.handle import REAP_GRACE, ChildHandle, killpg
from rlmq.producer.repl.output import OutputBuffer
from rlmq.producer.repl_child import reachable_by_others  # the child is stdlib-only; the parent shares its check

__all__ = ["check_limits", "child_env", "child_interpreter", "pip_install", "rmtree", "spawn_child"]

_PIP_ENV_KEYS = ("PATH", "HOME", "XDG_CACHE_HOME", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE")


def check_limits(
    lengths: tuple[int, int], positive: dict[str, float], positive_or_none: dict[str, float | None]
) -> None:
    """Refuse a REPL's limits out of range: ``lengths`` (``max_output_length``, ``max_answer_length``)
    below 0, a value of ``positive`` not above 0, one of ``positive_or_none`` neither ``None``
    nor above 0.

    Raises:
        ValueError: naming the first such limit.
    """
    if min(lengths) < 0:
        raise ValueError("max_output_length and max_answer_length must be >= 0")
    for name, value in positive.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    for name, maybe in positive_or_none.items():
        if maybe is not None and maybe <= 0:
            raise ValueError(f"{name} must be > 0 or None")


def child_env(workdir: str, site_packages: str | None) -> dict[str, str]:
    """The child's whole environment, built from scratch (no variable of the producer's).

    Args:
        workdir: the REPL's folder (HOME and TMPDIR until the child moves into its scratch space).
        site_packages: the folder of installed packages (put on ``PYTHONPATH``), or ``None``.
    """
    python_bin = os.path.dirname(sys.executable)
    env = {
        "PATH": os.pathsep.join([python_bin, "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if site_packages:
        env["PYTHONPATH"] = site_packages
    return env


def _is_network_setting(key: str) -> bool:
    lower = key.lower()
    return lower.startswith("pip_") or lower in ("http_proxy", "https_proxy", "no_proxy", "all_proxy")


async def pip_install(packages: Sequence[str], target: str, workdir: str, timeout: float) -> None:
    """``pip install --target <target> <packages>`` in a process group of its own.

    Args:
        packages: pip requirement specifiers.
        target: the folder the packages go to.
        workdir: cwd and TMPDIR of pip.
        timeout: seconds pip may take; then its group is killed.

    Raises:
        ReplStartupError: pip failed or did not finish within ``timeout``.
    """
    env = {k: v for k, v in os.environ.items() if k in _PIP_ENV_KEYS or _is_network_setting(k)}
    env.update({"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TMPDIR": workdir, "PYTHONDONTWRITEBYTECODE": "1"})
    cmd = [
        sys.executable, "-m", "pip", "install", "--quiet", "--no-input", "--disable-pip-version-check",
        "--target", target, *packages,
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        cwd=workdir,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except BaseException as exc:
        killpg(proc.pid)
        await proc.wait()
        if isinstance(exc, asyncio.TimeoutError):
            raise ReplStartupError(f"pip install of {list(packages)} did not finish within {timeout:g} s") from None
        raise
    if proc.returncode != 0:
        tail = out.decode("utf-8", "replace")[-2000:]
        raise ReplStartupError(f"pip install of {list(packages)} failed (exit code {proc.returncode}):\n{tail}")


def child_interpreter(run_as: str | int | None) -> str:
    """The Python that runs the REPL child: this one, unless the child will drop to its own
    uid and this interpreter's stdlib is private to root (pyenv under /root, say); then a
    system Python of the same version, when there is one, so the dropped child can import."""
    import sysconfig

    if run_as is None or os.geteuid() != 0 or reachable_by_others(sysconfig.get_paths()["stdlib"]):
        return sys.executable
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (f"/usr/local/bin/python{version}", f"/usr/bin/python{version}"):
        if os.access(candidate, os.X_OK) and reachable_by_others(candidate):
            return candidate
    return sys.executable  # the child then stays root (see repl_child.privileges.drop_privileges)


def rmtree(path: str) -> None:
    """Remove ``path`` even when cells made parts of it read-only."""

    def onerror(func: Callable[..., Any], p: str, _exc: Any) -> None:
        try:  # never through a symlink the REPL planted: chmod would follow it
            for q in (os.path.dirname(p), p):
                if not os.path.islink(q):
                    os.chmod(q, stat.S_IRWXU)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=onerror)


async def spawn_child(
    argv: list[str],
    *,
    workdir: str,
    env: dict[str, str],
    init: dict[str, Any],
    max_message_bytes: int,
    max_output_length: int,
    timeout: float,
    cgroup: ReplCgroup | None = None,
) -> tuple[ChildHandle, dict[str, Any]]:
    """Start a REPL child (``argv`` + its two pipe fds), send it ``init`` and wait for ``ready``.

    Args:
        argv: interpreter, flags and the child program.
        workdir: its cwd.
        env: its whole environment.
        init: the init message (see ``repl_child``).
        max_message_bytes: the longest reply line the parent reads.
        max_output_length: characters of a cell's output kept.
        timeout: seconds until ``ready``.
        cgroup: the REPL's cgroup; the child is moved into it before it reads ``init`` (before
            any cell, before it starts a process).

    Returns:
        (the handle, the ``ready`` message).

    Raises:
        ReplStartupError: not ready within ``timeout``, or the child failed to start.
    """
    loop = asyncio.get_running_loop()
    cmd_r, cmd_w = os.pipe()
    reply_r, reply_w = os.pipe()
    out_r, out_w = os.pipe()
    parent_fds = [cmd_w, reply_r, out_r]
    child_fds = [cmd_r, reply_w, out_w]
    proc: asyncio.subprocess.Process | None = None
    child: ChildHandle | None = None
    try:
        for fd in parent_fds:
            os.set_blocking(fd, False)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            str(cmd_r),
            str(reply_w),
            cwd=workdir,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out_w,
            stderr=out_w,
            pass_fds=(cmd_r, reply_w),
            start_new_session=True,
        )
        if cgroup is not None:
            cgroup.add(proc.pid)
        for fd in child_fds:
            os.close(fd)
        child_fds = []
        reader = asyncio.StreamReader(limit=max_message_bytes)
        reply_file = os.fdopen(reply_r, "rb", buffering=0)
        parent_fds.remove(reply_r)  # owned by reply_file, then by the transport
        try:
            transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), reply_file)
        except BaseException:
            # uvloop has already closed the descriptor when the connect is cancelled: the EBADF
            # of a second close must not replace the cancellation (it read as a failed start).
            with contextlib.suppress(OSError):
                reply_file.close()
            raise
        child = ChildHandle(proc, reader, transport, cmd_w, out_r, OutputBuffer(max_output_length))
        child.cgroup = cgroup
        parent_fds = []
        ready = await asyncio.wait_for(_handshake(child, init), timeout)
    except BaseException as exc:
        output = await _abandon(proc, child, parent_fds + child_fds)
        if isinstance(exc, asyncio.TimeoutError):
            raise ReplStartupError(f"the REPL was not ready within {timeout:g} s" + _tail(output)) from None
        if isinstance(exc, (ReplStartupError, OSError)):
            raise ReplStartupError(f"the REPL failed to start: {exc}" + _tail(output)) from None
        raise
    child.output.take()  # start-up noise (warnings) is nobody's cell output
    return child, ready


async def _abandon(proc: asyncio.subprocess.Process | None, child: ChildHandle | None, fds: list[int]) -> str:
    """Kill a child that did not get ready (its handle ``child`` once made, else ``proc`` once
    started), wait for it and close ``fds``; returns what it wrote to fd 1/2 (once it has a handle)."""
    output = ""
    if child is not None:
        child.kill()
        await child.proc.wait()
        child.drain_output()
        output, _ = child.output.take()
        child.release()
    elif proc is not None:
        killpg(proc.pid)
        await proc.wait()
    for fd in fds:
        os.close(fd)
    return output


async def _handshake(child: ChildHandle, init: dict[str, Any]) -> dict[str, Any]:
    await child.send(init)
    message = await child.receive()
    if message is None or message.get("type") != "ready":
        status = await child.reap(REAP_GRACE)
        raise ReplStartupError(f"the child exited before it was ready (status {status})")
    if message.get("helper_error"):  # bash: llm_batch & co would fail in every cell (repl_child.helper.probe_helper)
        raise ReplStartupError(f"the bash REPL's commands (llm_batch, ...) cannot start: {message['helper_error']}")
    return message


def _tail(output: str, limit: int = 2000) -> str:
    output = output.strip()
    return f"; its output:\n{output[-limit:]}" if output else ""
