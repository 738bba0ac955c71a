"""The REPL child: a standalone, stdlib-only program that runs model-written cells.

Started by :class:`rlmq.producer.repl.Repl` as::

    python -I repl_child.py <cmd_fd> <reply_fd>

It must not import rlmq nor any third-party package: it runs model-written code
and only needs the standard library.

Protocol (JSON lines, UTF-8, one object per line)
-------------------------------------------------
``cmd_fd`` (parent -> child) and ``reply_fd`` (child -> parent) are dedicated
pipes passed with ``pass_fds``; fd 0 is ``/dev/null`` and fd 1 and fd 2 are one
pipe the parent drains: everything the cell prints (``print``, tracebacks, the
repr of a last expression, output of subprocesses) goes there, in order.

1. parent -> child, first line, the init message (secrets never travel through
   argv or the environment, which other users of the host can read)::

       {"op": "init", "url": str, "token": str, "llm_batch_timeout": float (s),
        "context_path": str, "sys_path": [str, ...],
        "cpu_seconds": int | null, "memory_bytes": int | null,
        "max_processes": int | null, "run_as": "auto" | int | null}

   The child drops to a uid of its own when it runs as root (``run_as``), applies
   the resource limits, loads ``context`` from the JSON file and answers
   ``{"type": "ready", "pid": int, "uid": int | null}``.
2. parent -> child, per cell: ``{"op": "exec", "code": str}``; the child answers
   ``{"type": "result", "answer_ready": bool, "answer_content": str,
   "seconds": float}`` once the cell is done (its output having been written to
   fd 1/2 before).
3. child -> parent, at any time (also from threads of the cell):
   ``{"type": "llm_batch", "inflight": int}`` whenever an ``llm_batch`` HTTP
   request starts or ends, ``inflight`` being the number now in flight. The
   parent may pause its cell timeout while it is positive.

EOF on ``cmd_fd`` makes the child exit. Death of the child (``os._exit``, a
signal, a crash) shows as EOF on ``reply_fd``.
"""

from __future__ import annotations

import ast
import builtins
import http.client
import io
import json
import linecache
import os
import socket
import sys
import threading
import time
import traceback
import types
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, BinaryIO, TextIO

_HERE = os.path.abspath(__file__)


class _Channel:
    """The reply pipe; writes are serialised because cells may call ``llm_batch`` from threads."""

    def __init__(self, fd: int) -> None:
        self._file: BinaryIO = open(fd, "wb", buffering=1 << 16)  # noqa: SIM115
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode("utf-8", "surrogatepass")
        with self._lock:
            self._file.write(data)
            self._file.flush()


UID_BASE = 100_000
"""When started as root, the child runs as uid/gid ``UID_BASE + its pid`` (no name, no groups)."""


def _drop_privileges(spec: str | int | None) -> int | None:
    """When running as root, become an unprivileged uid of this REPL's own; return it.

    ``spec``: ``"auto"`` (``UID_BASE + pid``: unique among live REPLs of this host, so one
    REPL's processes, files and RLIMIT_NPROC count are its own), an int uid, or ``None``
    (stay as is). Its work dir (the cwd) is handed to that uid first. Not root: nothing
    changes (returns ``None``). Also sets ``no_new_privs`` so setuid programs cannot regain
    privileges.
    """
    if spec is None or os.geteuid() != 0:
        return None
    if spec == "auto" and not _reachable_by_others(os.path.dirname(os.__file__)):
        return None  # this interpreter's stdlib is private to root: imports would fail after the drop
    uid = UID_BASE + os.getpid() if spec == "auto" else int(spec)
    if uid <= 0:
        raise ValueError("the REPL never runs as root when asked to drop privileges")
    os.chown(".", uid, uid)
    os.chmod(".", 0o700)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    except (ImportError, OSError, AttributeError):  # some Pythons ship without ctypes
        pass
    return uid


CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000


def _isolate_network() -> bool:
    """Move this process into a network namespace of its own; return whether it worked.

    The new namespace has only a loopback interface, and it is down: no TCP or UDP peer is
    reachable, not even the host's 127.0.0.1. The interception server stays reachable through
    its Unix socket, which lives in the file system, not in the network namespace. As root
    this is a plain network namespace (before privileges are dropped); otherwise a user
    namespace with it, where the kernel allows unprivileged user namespaces, mapping the
    process's own uid and gid so files keep their owners. Must run while single-threaded.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if int(libc.unshare(CLONE_NEWNET)) == 0:
            return True
        if os.geteuid() == 0:
            return False
        uid, gid = os.getuid(), os.getgid()
        if int(libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)) != 0:
            return False
    except (ImportError, OSError, AttributeError):
        return False
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        except OSError:
            pass  # the network is isolated all the same; only ids read back differently
    return True


def _reachable_by_others(path: str) -> bool:
    """Whether a user with no rights of its own can read ``path`` (every parent searchable)."""
    import stat

    path = os.path.realpath(path)
    try:
        if not os.stat(path).st_mode & stat.S_IROTH:
            return False
        while True:
            if not os.stat(path).st_mode & stat.S_IXOTH:
                return False
            parent = os.path.dirname(path)
            if parent == path:
                return True
            path = parent
    except OSError:
        return False


def _tasks_of(uid: int) -> int:
    """Processes and threads now running as ``uid`` (what RLIMIT_NPROC counts)."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return n


def _apply_limits(
    cpu_seconds: int | None, memory_bytes: int | None, max_processes: int | None = None, own_uid: bool = False
) -> None:
    """Set RLIMIT_CORE=0, RLIMIT_AS, RLIMIT_CPU and RLIMIT_NPROC on this process (inherited by its children).

    RLIMIT_NPROC counts every process and thread of the real uid: with a uid of its own
    (root parent, see :func:`_drop_privileges`) it is ``max_processes``; otherwise the uid's
    current count plus ``max_processes``. Root ignores RLIMIT_NPROC.

    Done here rather than in a ``preexec_fn`` of the parent, which is unsafe when the
    parent has threads; it runs before any model-written code.
    """
    import resource

    def lower(which: int, soft: int, hard: int) -> None:
        _, cur_hard = resource.getrlimit(which)
        if cur_hard != resource.RLIM_INFINITY:
            hard = min(hard, cur_hard)
            soft = min(soft, hard)
        resource.setrlimit(which, (soft, hard))

    lower(resource.RLIMIT_CORE, 0, 0)
    if max_processes is not None and os.getuid() != 0:
        n = max_processes if own_uid else _tasks_of(os.getuid()) + max_processes
        lower(resource.RLIMIT_NPROC, n, n)
    if memory_bytes is not None:
        lower(resource.RLIMIT_AS, memory_bytes, memory_bytes)
    if cpu_seconds is not None:
        # The soft limit sends SIGXCPU (which kills: Python keeps the default action);
        # the hard limit one second later is SIGKILL, for code that ignores SIGXCPU.
        lower(resource.RLIMIT_CPU, cpu_seconds, cpu_seconds + 1)


def _server_message(err: urllib.error.HTTPError) -> str:
    try:
        raw = err.read()
    except Exception:  # noqa: BLE001
        raw = b""
    text = raw.decode("utf-8", "replace").strip()
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict) and "error" in body:
        return str(body["error"])
    return text or str(err.reason)


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over the interception server's Unix socket."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class _UnixHandler(urllib.request.HTTPHandler):
    """Sends every ``http://`` request of the opener through the Unix socket (replaces the
    opener's default HTTP handler)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._path = path

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        path = self._path
        return self.do_open(lambda host, timeout=60.0, **kw: _UnixHTTPConnection(path, timeout), req)


def _make_llm_batch(
    url: str, token: str, timeout: float, channel: _Channel, unix_socket: str | None = None
) -> Callable[[list[str]], list[str]]:
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if unix_socket:
        handlers.append(_UnixHandler(unix_socket))
    opener = urllib.request.build_opener(*handlers)
    inflight = [0]
    lock = threading.Lock()

    def _notify(delta: int) -> None:
        with lock:
            inflight[0] += delta
            try:
                channel.send({"type": "llm_batch", "inflight": inflight[0]})
            except OSError:
                pass

    def llm_batch(prompts: list[str]) -> list[str]:
        """Send a batch of prompts to sub-LLMs and return their answers, in order.

        Args:
            prompts: a list of prompt strings; each becomes one sub-LLM call and the
                calls run in parallel.

        Returns:
            One answer string per prompt, in the order of ``prompts``. A summary of
            the batch (tokens, turns, seconds per prompt, budget) is printed.

        Raises:
            TypeError: ``prompts`` is not a list of str.
            RuntimeError: the batch was refused (for example the budget is spent)
                or the sub-LLM service could not be reached.
        """
        if not isinstance(prompts, list):
            raise TypeError(f"llm_batch(prompts) expects a list of str, got {type(prompts).__name__}")
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                raise TypeError(
                    f"llm_batch(prompts) expects a list of str, but prompts[{i}] is {type(prompt).__name__}"
                )
        if not prompts:
            return []
        body = json.dumps({"prompts": prompts}).encode("utf-8", "surrogatepass")
        request = urllib.request.Request(
            url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
        )
        error: str | None = None
        raw = b""
        _notify(+1)
        try:
            with opener.open(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            error = f"llm_batch failed (HTTP {exc.code}): {_server_message(exc)}"
        except (urllib.error.URLError, OSError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            error = f"llm_batch could not reach the sub-LLM service: {reason}"
        finally:
            _notify(-1)
        if error is not None:
            raise RuntimeError(error)
        try:
            payload = json.loads(raw)
            results = payload["results"]
            summary = payload.get("summary", "")
        except (ValueError, KeyError, TypeError, AttributeError):
            raise RuntimeError("llm_batch got a malformed response from the sub-LLM service") from None
        if (
            not isinstance(results, list)
            or len(results) != len(prompts)
            or not all(isinstance(r, str) for r in results)
        ):
            raise RuntimeError(f"llm_batch got a malformed response: expected {len(prompts)} string results")
        if summary:
            print(summary if isinstance(summary, str) else str(summary))
        return list(results)

    return llm_batch


def _strip_internal_frames(exc: traceback.TracebackException) -> None:
    """Drop this file's frames from ``exc`` and the exceptions chained to it, in place."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        te = todo.pop()
        if id(te) in seen:
            continue
        seen.add(id(te))
        te.stack = traceback.StackSummary.from_list([fs for fs in te.stack if os.path.abspath(fs.filename) != _HERE])
        for nxt in (te.__cause__, te.__context__):
            if nxt is not None:
                todo.append(nxt)
        todo.extend(getattr(te, "exceptions", None) or [])


def _format_exception(exc: BaseException) -> str:
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__, compact=True)
    _strip_internal_frames(te)
    return "".join(te.format())


class _Repl:
    """The persistent namespace and the cell runner."""

    def __init__(self, namespace: dict[str, Any], out: TextIO, err: TextIO) -> None:
        self.namespace = namespace
        self.out = out
        self.err = err
        self.cells = 0
        self.pid = os.getpid()

    def _register_source(self, filename: str, code: str) -> None:
        lines = code.splitlines(keepends=True)
        linecache.cache[filename] = (len(code), None, lines, filename)

    def run(self, code: str) -> dict[str, Any]:
        self.cells += 1
        filename = f"<cell-{self.cells}>"
        self._register_source(filename, code)
        started = time.perf_counter()
        try:
            try:
                tree = ast.parse(code, filename, "exec")
            except (SyntaxError, ValueError) as exc:  # ValueError: null bytes in the source
                raise exc.with_traceback(None) from None
            last: ast.Expression | None = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body[-1].value)
                tree.body.pop()
            exec(compile(tree, filename, "exec"), self.namespace)  # noqa: S102
            if last is not None:
                value = eval(compile(last, filename, "eval"), self.namespace)  # noqa: S307
                if value is not None:
                    self._write(self.out, repr(value) + "\n")
        except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt too
            self._write(self.err, _format_exception(exc))
        if os.getpid() != self.pid:
            os._exit(0)  # a process the cell forked came back here: it must not answer nor read commands
        seconds = time.perf_counter() - started
        self._flush()
        ready, content = self._answer()
        return {
            "type": "result",
            "answer_ready": ready,
            "answer_content": content,
            "seconds": seconds,
        }

    def _write(self, stream: TextIO, text: str) -> None:
        try:
            stream.write(text)
            stream.flush()
        except Exception:  # noqa: BLE001 - the cell may have closed or replaced streams
            try:
                os.write(2, text.encode("utf-8", "backslashreplace"))
            except OSError:
                pass

    def _flush(self) -> None:
        for stream in (sys.stdout, sys.stderr, self.out, self.err):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass

    def _answer(self) -> tuple[bool, str]:
        answer = self.namespace.get("answer")
        if not isinstance(answer, dict):
            return False, ""
        try:
            ready = bool(answer.get("ready", False))
        except Exception:  # noqa: BLE001
            ready = False
        try:
            content = answer.get("content", "")
            content = content if isinstance(content, str) else str(content)
        except Exception as exc:  # noqa: BLE001
            content = f"<answer['content'] could not be converted to str: {exc!r}>"
        return ready, content


def _stdio(fd: int) -> io.TextIOWrapper:
    # Unbuffered text over the raw fd, as ``python -u`` does: nothing is lost on os._exit.
    return io.TextIOWrapper(
        io.FileIO(fd, "w", closefd=False),
        encoding="utf-8",
        errors="backslashreplace",
        write_through=True,
    )


def main(argv: list[str]) -> int:
    cmd_fd, reply_fd = int(argv[1]), int(argv[2])
    for fd in (cmd_fd, reply_fd):
        os.set_inheritable(fd, False)  # not leaked to processes the cell starts
    commands = open(cmd_fd, "rb")  # noqa: SIM115
    channel = _Channel(reply_fd)

    line = commands.readline()
    if not line:
        return 0
    init = json.loads(line)
    net_isolated = bool(init.get("isolate_network")) and _isolate_network()
    uid = _drop_privileges(init.get("run_as"))
    _apply_limits(init.get("cpu_seconds"), init.get("memory_bytes"), init.get("max_processes"), uid is not None)
    for path in reversed(init.get("sys_path") or []):
        sys.path.insert(0, path)

    out, err = _stdio(1), _stdio(2)
    sys.stdout = sys.__stdout__ = out  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = err  # type: ignore[misc]
    sys.argv = [""]
    sys.dont_write_bytecode = True  # -I ignores PYTHONDONTWRITEBYTECODE

    with open(init["context_path"], encoding="utf-8") as f:
        context = json.load(f)

    # Cells run in a fresh ``__main__`` module, so objects they define pickle normally
    # (multiprocessing) and this program's own names stay out of their sight.
    main_module = types.ModuleType("__main__")
    main_module.__dict__.update(
        {
            "__builtins__": builtins,
            "context": context,
            "llm_batch": _make_llm_batch(
                init["url"], init["token"], float(init["llm_batch_timeout"]), channel, init.get("unix_socket")
            ),
            "answer": {"content": "", "ready": False},
        }
    )
    sys.modules["__main__"] = main_module
    del init, context
    repl = _Repl(main_module.__dict__, out, err)

    channel.send({"type": "ready", "pid": os.getpid(), "uid": uid, "net_isolated": net_isolated})
    while True:
        line = commands.readline()
        if not line:
            return 0
        message = json.loads(line)
        if message.get("op") == "exec":
            channel.send(repl.run(message["code"]))


if __name__ == "__main__":
    _self = sys.modules["__main__"]  # keep this module alive once __main__ is replaced
    sys.exit(main(sys.argv))
