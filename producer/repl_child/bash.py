"""The bash REPL (``repl_language="bash"``): the sandboxed child's side, stdlib only.

Imported by the REPL child (:mod:`.helper`) before it drops its privileges. Meanings follow
verifiers' ``RLMEnv`` (0.1.14, its bash worker and root-tool helper):

* Each cell is a fresh ``bash`` (here ``--noprofile --norc``: no host start-up file runs) in
  the directory the previous cell ended in; what persists between cells is that directory,
  the files, and the two answer variables. Other shell variables and functions do not.
* The answer: ``ANSWER_CONTENT`` holds it; ``export ANSWER_READY=1`` (or ``true``, ``yes``,
  ``y``, ``on``, any case) ends the rollout. Both are set in the environment of every cell
  from the last cell's values.
* ``llm_batch``, ``rlm_batch`` and each root tool are shell functions that run this child's
  interpreter as a helper (:mod:`.helper`, then :func:`command`), which posts to the rollout's
  interception endpoint as the Python REPL's globals do. ``llm_batch "p1" "p2"`` (one prompt per argument;
  a single argument that is a JSON list or object is decoded), ``llm_batch --json '{"prompts":
  [...]}'``, ``llm_batch --lines`` (one prompt per stdin line), or a JSON or text on stdin;
  prints the JSON list of answers (the batch summary goes to stderr). A tool: each argument is
  decoded as JSON where it is JSON, else taken as a str; ``--json '{"args": [...], "kwargs":
  {...}}'``; prints a str result as it is, anything else as JSON. A failure: ``Error: ...`` on
  stderr and exit status 1.

The cell's stdout and stderr are the child's own (the producer reads and bounds them); the
cell's state comes back in a file of the REPL's own scratch space, read once bash has exited
(a background process the cell left running does not hold the cell up).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

READY_WORDS = frozenset({"1", "true", "yes", "y", "on"})
"""Values of ``ANSWER_READY`` that mean ready (the reference's ``_parse_bool``), case-insensitive."""

EXPORT_MAX = 100_000
"""Bytes of ``ANSWER_CONTENT`` up to which a cell gets it exported (the kernel refuses to start a
program whose one environment string passes 128 KiB); a longer one is a shell variable only."""

_STATE_MAX = 8 * 1024 * 1024  # bytes of a cell's state read back (answer content included)


CANNOT_START = (2, 126, 127)
"""Exit statuses of a command whose helper did not start (Python's "can't open file", a shell's
"not executable" / "not found"); the helper itself exits 0 or 1 (``Error: ...``)."""


def _functions(names: list[str]) -> str:
    """One shell function per command; the helper runs with ``-S`` (no ``site``: stdlib only, ~60 ms
    less). A helper that could not start (:data:`CANNOT_START`) is written to ``$__RLMQ_FAILED``."""
    codes = "|".join(map(str, CANNOT_START))
    return "".join(
        f'{n}() {{ "$RLMQ_PYTHON" -I -S "$RLMQ_HELPER" --command {n} "$@"; local s=$?; '
        f'case $s in {codes}) printf "%s %s\\n" {n} "$s" >> "$__RLMQ_FAILED";; esac; return $s; }}\n'
        for n in names
    )


def _script(names: list[str]) -> str:
    """The bash program of one cell: defines the commands, reads the cell's code from stdin, runs
    it with stdin from /dev/null, and on exit writes ``status NUL pwd NUL ready NUL content`` to
    the file ``$__RLMQ_STATE`` (a cell that removes the trap or the variable keeps the last state).
    ``ANSWER_CONTENT`` comes from the file ``$__RLMQ_CONTENT`` (an environment string is limited to
    128 KiB by the kernel); it is exported when it is at most :data:`EXPORT_MAX` bytes, else only set."""
    return (
        _functions(names)
        + 'ANSWER_CONTENT="$(cat "$__RLMQ_CONTENT"; printf x)"; ANSWER_CONTENT="${ANSWER_CONTENT%x}"\n'
        + f'if [ "$(wc -c < "$__RLMQ_CONTENT")" -le {EXPORT_MAX} ]; then export ANSWER_CONTENT; fi\n'
        + "__rlmq_code=$(cat); exec </dev/null\n"
        + 'trap \'__rlmq_s=$?; { printf "%s\\0%s\\0%s\\0" "$__rlmq_s" "$PWD" "${ANSWER_READY-}"; '
        + 'printf "%s" "${ANSWER_CONTENT-}"; } > "$__RLMQ_STATE"\' EXIT\n'
        + 'eval "$__rlmq_code"\n'
    )


class BashRunner:
    """Runs bash cells for the child: the same result messages as the Python cell runner.

    Args:
        cwd: the working directory of the first cell (the REPL's home, holding the context files).
        env: the cells' environment besides the answer variables (the child's own, plus what the
            helper needs: ``RLMQ_PYTHON``, ``RLMQ_HELPER`` and the endpoint's ``RLMQ_*``).
        commands: the names defined as commands (``llm_batch``, ``rlm_batch``, root tools).
        max_answer_length: characters of ``ANSWER_CONTENT`` passed on (the rest is cut, with a note).
        note: writes a line to the cell's stderr.
    """

    def __init__(
        self, cwd: str, env: dict[str, str], commands: list[str], max_answer_length: int, note: Callable[[str], None]
    ) -> None:
        self.cwd = cwd
        self.env = env
        self.commands = commands
        self.max_answer_length = max_answer_length
        self.note = note
        self.ready = ""
        self.content = ""

    def run(self, code: str) -> dict[str, Any]:
        """Run one cell; returns ``{"type": "result", "answer_ready", "answer_content", "seconds"}``,
        plus ``"helper_error": str`` when a command's helper could not start (see :func:`_functions`)."""
        started = time.perf_counter()
        folder = tempfile.mkdtemp(prefix=".rlmq-cell-")
        state_path = os.path.join(folder, "state")
        content_path = os.path.join(folder, "content")
        with open(content_path, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(self.content)
        failed_path = os.path.join(folder, "failed")
        env = {**self.env, "ANSWER_READY": self.ready, "__RLMQ_STATE": state_path, "__RLMQ_CONTENT": content_path,
               "__RLMQ_FAILED": failed_path}  # fmt: skip
        cwd = self.cwd if os.path.isdir(self.cwd) else os.environ.get("HOME", "/")
        try:
            try:
                proc = subprocess.Popen(
                    ["bash", "--noprofile", "--norc", "-c", _script(self.commands)],
                    cwd=cwd, env=env, stdin=subprocess.PIPE,
                )  # fmt: skip
            except OSError as exc:
                self.note(f"[bash could not start: {exc}]")
                return self._result(started)
            assert proc.stdin is not None
            try:
                proc.stdin.write(code.encode("utf-8", "surrogateescape"))
                proc.stdin.close()
            except OSError:
                pass  # bash is gone already: its state (if any) says how
            proc.wait()
            self._take(_read_bounded(state_path))
            failed = _read_bounded(failed_path).decode("utf-8", "replace").split()
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        result = self._result(started)
        if failed:
            name, status = failed[0], failed[1] if len(failed) > 1 else "?"
            why = f"exit status {status[:8]}; its error is in the output"
            result["helper_error"] = f"{name[:64]} could not start ({why})"
            self.note(f"[{result['helper_error']}]")
        return result

    def _take(self, state: bytes) -> None:
        parts = state.split(b"\0", 3)
        if len(parts) != 4:
            self.note("[the cell's shell ended without its state: ANSWER_CONTENT and the directory are unchanged]")
            return
        _status, pwd, ready, content = (p.decode("utf-8", "replace") for p in parts)
        self.cwd = pwd or self.cwd
        self.ready = ready[:64]  # only its meaning counts; it travels in the next cell's environment
        if len(content) > self.max_answer_length:
            self.note(
                f"[ANSWER_CONTENT has {len(content)} characters; only the first {self.max_answer_length} "
                "reach the producer]"
            )
            content = content[: self.max_answer_length]
        self.content = content

    def _result(self, started: float) -> dict[str, Any]:
        return {
            "type": "result",
            "answer_ready": self.ready.strip().lower() in READY_WORDS,
            "answer_content": self.content,
            "seconds": time.perf_counter() - started,
        }


def _read_bounded(path: str) -> bytes:
    """The first :data:`_STATE_MAX` bytes of the file at ``path`` (``b""`` when there is none)."""
    try:
        with open(path, "rb") as f:
            return f.read(_STATE_MAX)
    except OSError:
        return b""


# --------------------------------------------------------------------------- the helper's side


def _decode(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _as_prompts(data: Any) -> list[Any]:
    if isinstance(data, dict):
        for key in ("prompts", "tasks"):
            if key in data:
                return list(data[key])
        return [data.get("prompt", data)] if "prompt" in data else [data]
    return list(data) if isinstance(data, list) else [data]


def _batch_input(args: list[str]) -> list[Any]:
    """The prompts (tasks) of ``llm_batch`` / ``rlm_batch`` from its arguments or stdin."""
    if args[:1] == ["--json"]:
        _no_extra_args(args)
        payload = args[1] if len(args) > 1 else sys.stdin.read()
        return _as_prompts(json.loads(payload))
    if args[:1] == ["--lines"]:
        return [line for line in sys.stdin.read().splitlines() if line]
    if len(args) == 1 and args[0].strip()[:1] in ("[", "{"):
        decoded = _decode(args[0].strip())
        return _as_prompts(decoded) if not isinstance(decoded, str) else [args[0]]
    if args:
        return list(args)
    raw = sys.stdin.read().strip()
    if not raw:
        raise RuntimeError("no prompts: give them as arguments, --json, --lines or on stdin")
    decoded = _decode(raw)
    return _as_prompts(decoded) if not isinstance(decoded, str) else [raw]


def _no_extra_args(args: list[str]) -> None:
    """``--json PAYLOAD`` takes nothing after the payload, as the reference's helper (verifiers
    0.1.14) refuses it: a stray word is a mistake, not an argument to drop silently."""
    if len(args) > 2:
        raise RuntimeError(f"--json does not accept extra args: {' '.join(args[2:])}")


def _call_of(data: Any) -> tuple[list[Any], dict[str, Any]]:
    """A tool's ``--json`` payload as arguments: ``{"args": [...], "kwargs": {...}}``; another
    object is the keyword arguments; a list the positional ones; anything else the one argument."""
    if isinstance(data, dict) and ("args" in data or "kwargs" in data):
        call_args, kwargs = data.get("args", []), data.get("kwargs", {})
        if not isinstance(call_args, list) or not isinstance(kwargs, dict):
            raise RuntimeError('--json takes {"args": [...], "kwargs": {...}}')
        return call_args, kwargs
    if isinstance(data, dict):
        return [], data
    return (data, {}) if isinstance(data, list) else ([data], {})


def command(argv: list[str], make: Callable[[str], Callable[..., Any]]) -> int:
    """The helper process of one command: ``--command NAME ARGS...``; ``make(name)`` builds the
    callable (the same ``llm_batch`` / ``rlm_batch`` / root-tool stub the Python REPL has).
    Returns the exit status (1 with ``Error: ...`` on stderr for a failure)."""
    name, args = argv[0], argv[1:]
    try:
        func = make(name)
        if name in ("llm_batch", "rlm_batch"):
            out = sys.stdout
            sys.stdout = sys.stderr  # the batch summary: stderr, so stdout is the JSON answers
            try:
                result = func(_batch_input(args))
            finally:
                sys.stdout = out
            print(json.dumps(result))
            return 0
        if args[:1] == ["--json"]:
            _no_extra_args(args)
            call_args, kwargs = _call_of(json.loads(args[1] if len(args) > 1 else sys.stdin.read()))
            result = func(*call_args, **kwargs)
        else:
            result = func(*(_decode(a) for a in args))
        print(result if isinstance(result, str) else json.dumps(result))
        return 0
    except Exception as exc:  # noqa: BLE001 - the command's failure is its exit status and message
        sys.stderr.write(f"Error: {exc}\n")
        return 1
