"""The REPL child: a standalone, stdlib-only program that runs model-written cells.

Started by :class:`producer.repl.Repl` as::

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
        "cpu_seconds": int | null, "memory_bytes": int | null}

   The child applies the resource limits, loads ``context`` from the JSON file
   and answers ``{"type": "ready", "pid": int}``.
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
import io
import json
import linecache
import os
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


def _apply_limits(cpu_seconds: int | None, memory_bytes: int | None) -> None:
    """Set RLIMIT_CORE=0, RLIMIT_AS and RLIMIT_CPU on this process (inherited by its children).

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


def _make_llm_batch(url: str, token: str, timeout: float, channel: _Channel) -> Callable[[list[str]], list[str]]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
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
    _apply_limits(init.get("cpu_seconds"), init.get("memory_bytes"))
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
            "llm_batch": _make_llm_batch(init["url"], init["token"], float(init["llm_batch_timeout"]), channel),
            "answer": {"content": "", "ready": False},
        }
    )
    sys.modules["__main__"] = main_module
    del init, context
    repl = _Repl(main_module.__dict__, out, err)

    channel.send({"type": "ready", "pid": os.getpid()})
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
