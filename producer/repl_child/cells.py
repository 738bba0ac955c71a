"""The cell runner of a Python REPL: the persistent namespace, one cell at a time, its output and
its answer; and the conversation file (``.messages``) written before a cell."""

from __future__ import annotations

import ast
import io
import linecache
import os
import sys
import time
import traceback
from typing import Any, TextIO

__all__ = ["CellRunner", "runner_note", "write_history"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
"""This package's folder as it was loaded: frames of its files are none of the cell's business."""


def _strip_internal_frames(exc: traceback.TracebackException) -> None:
    """Drop the frames of this package's files from ``exc`` and the exceptions chained to it, in place."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        te = todo.pop()
        if id(te) in seen:
            continue
        seen.add(id(te))
        te.stack = traceback.StackSummary.from_list(
            [fs for fs in te.stack if os.path.dirname(os.path.abspath(fs.filename)) != _PACKAGE_DIR]
        )
        for nxt in (te.__cause__, te.__context__):
            if nxt is not None:
                todo.append(nxt)
        todo.extend(getattr(te, "exceptions", None) or [])


def _format_exception(exc: BaseException) -> str:
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__, compact=True)
    _strip_internal_frames(te)
    return "".join(te.format())


class CellRunner:
    """The child's side: the persistent namespace and the runner of cells in it."""

    def __init__(
        self, namespace: dict[str, Any], out: TextIO, err: TextIO, max_answer_length: int, reference: bool = False
    ) -> None:
        self.namespace = namespace
        self.max_answer_length = max_answer_length
        self.out = out
        self.err = err
        self.cells = 0
        self.pid = os.getpid()
        self.reference = reference
        """verifiers 0.1.14's output format (the ``output_format`` ``"reference"`` of the init message)."""

    def _register_source(self, filename: str, code: str) -> None:
        lines = code.splitlines(keepends=True)
        linecache.cache[filename] = (len(code), None, lines, filename)

    def run(self, code: str) -> dict[str, Any]:
        self.cells += 1
        filename = f"<cell-{self.cells}>"
        self._register_source(filename, code)
        started = time.perf_counter()
        if self.reference:
            self._run_reference(code, filename)
        else:
            try:
                value = self._exec(code, filename)
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

    def _exec(self, code: str, filename: str) -> Any:
        """Run ``code``; the value of its last statement when that is an expression, else ``None``."""
        try:
            tree = ast.parse(code, filename, "exec")
        except (SyntaxError, ValueError) as exc:  # ValueError: null bytes in the source
            raise exc.with_traceback(None) from None
        last: ast.Expression | None = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body[-1].value)
            tree.body.pop()
        exec(compile(tree, filename, "exec"), self.namespace)  # noqa: S102
        if last is None:
            return None
        return eval(compile(last, filename, "eval"), self.namespace)  # noqa: S307

    def _run_reference(self, code: str, filename: str) -> None:
        """Run a cell with verifiers 0.1.14's output: what it printed, then what it wrote to
        ``sys.stderr`` after a ``stderr:`` line, then ``Out[n]: repr`` of its last expression
        or its traceback. (What subprocesses write to the file descriptors stays in place.)"""
        saved, caught = sys.stderr, io.StringIO()
        sys.stderr = caught
        tail = ""
        try:
            value = self._exec(code, filename)
            if value is not None:
                tail = f"Out[{self.cells}]: {value!r}\n"
        except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt too
            tail = _format_exception(exc)
        finally:
            sys.stderr = saved
        self._flush()
        stderr = caught.getvalue().rstrip()
        if stderr:
            self._write(self.out, f"stderr:\n{stderr}\n")
        if tail:
            self._write(self.out, tail)

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
        if not isinstance(content, str):  # a str subclass whose __str__ returns something else
            content = "<answer['content'] is not a str>"
        if len(content) > self.max_answer_length:
            self._write(
                self.err,
                f"[answer['content'] has {len(content)} characters; only the first {self.max_answer_length} "
                "reach the producer]\n",
            )
            content = str.__getitem__(content, slice(0, self.max_answer_length))
        return ready, str.__str__(content)


def write_history(home: str, text: str) -> None:
    """Overwrite ``<home>/.messages`` with the conversation (JSON lines), as the REPL's own uid;
    a link planted there is replaced, never written through."""
    path = os.path.join(home, ".messages")
    try:
        if os.path.islink(path):
            os.unlink(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with open(fd, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(text)
    except OSError as exc:  # a full scratch space, a folder the cell removed: said in the output
        runner_note(sys.stderr, f"[.messages could not be written: {exc}]")


def runner_note(err: TextIO, text: str) -> None:
    """A line of the REPL's own on the cell's stderr."""
    try:
        err.write(text + "\n")
        err.flush()
    except Exception:  # noqa: BLE001
        pass
