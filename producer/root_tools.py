"""Root tools: an environment author's Python callables that the root model's code calls from the REPL.

As the verifiers ``RLMEnv``'s ``tools`` / ``root_tools``: each tool is a REPL global of its
own name. The REPL is sandboxed, so the tool runs here, in the producer: the global is a stub
(:mod:`rlmq.producer.repl_child`) that posts its JSON arguments to the rollout's own
interception endpoint (``POST /root_tool``), which hands them to :class:`RootToolService`.

A call is bounded: its arguments by ``root_tool_max_args_bytes`` (the interception server),
its time by ``root_tool_timeout`` seconds (a sync callable runs in a daemon thread of its own,
one at a time per rollout, and its result is encoded there; an async one is awaited), its result
by ``root_tool_max_result_bytes`` bytes of JSON (encoded incrementally, so an oversized result
is refused without a second copy of it). A result that is not JSON becomes its ``repr``. A
tool that raises, times out or returns too much gives the cell a ``RuntimeError`` with the
message; nothing of it reaches the producer's own flow. Each call is recorded in the rollout's
trajectory (``{"type": "root_tool", ...}``) and figures (``root_tool_call_count``,
``<name>_root_calls``).
"""

from __future__ import annotations

import asyncio
import builtins
import inspect
import json
import keyword
import pkgutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from rlmq.common.aio import OverrunThreads
from rlmq.common.errors import ConfigError
from rlmq.producer.rollout import Rollout

RESERVED_NAMES: Final = frozenset({"llm_batch", "rlm_batch", "context", "answer"})
"""REPL globals a tool may not take (and no builtin name either)."""
TRAJECTORY_PREVIEW = 2000
"""Characters of a call's arguments and result kept in the trajectory."""
DOC_CHARS = 2000
"""Characters of a tool's docstring sent to the REPL (``help(tool)``) and the scaffold."""

ToolLike = Callable[..., Any] | str
"""A tool as an author passes it: the callable, or its dotted import path (``pkg.mod:func``)."""


def resolve_tool(tool: ToolLike) -> Callable[..., Any]:
    """The callable of ``tool``: itself, or the object its dotted path (``pkg.mod:func`` or
    ``pkg.mod.func``) names.

    Raises:
        ConfigError: the path does not import (also when its module has a syntax error, raises
            or calls ``sys.exit`` on import), or names something that is not callable.
    """
    if not isinstance(tool, str):
        if not callable(tool):
            raise ConfigError(f"a tool must be a callable or a dotted import path, not {type(tool).__name__}")
        return tool
    try:
        obj = pkgutil.resolve_name(tool.strip())
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"tool {tool!r}: cannot import it ({exc}); use 'pkg.mod:func'") from exc
    except (Exception, SystemExit) as exc:  # its module fails: a syntax error, raises or exits on import
        raise ConfigError(f"tool {tool!r}: cannot import it ({type(exc).__name__}: {_message(exc)})") from exc
    if not callable(obj):
        raise ConfigError(f"tool {tool!r} is not callable")
    return obj  # type: ignore[no-any-return]


def import_path(fn: Callable[..., Any]) -> str | None:
    """``module:qualname`` of ``fn`` when importing that path gives ``fn`` back, else ``None``
    (a lambda, a nested function, a bound method)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        return None
    path = f"{module}:{qualname}"
    try:
        return path if pkgutil.resolve_name(path) is fn else None
    except (ImportError, AttributeError, ValueError):
        return None


def hosted_sub_tool_path(fn: Callable[..., Any]) -> str:
    """The path a sub-LLM-only tool travels under when the rollout's process runs it (a hosted
    tool): its import path when it has one (a worker that allow-lists it runs it itself), else
    ``module:qualname`` with ``<locals>`` spelled ``locals`` (a nested function: no worker can
    import that path, so every call comes back to the rollout's process)."""
    path = import_path(fn)
    if path is not None:
        return path
    module = getattr(fn, "__module__", None) or "__main__"
    qualname = str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or "tool")
    return f"{module}:{qualname.replace('<locals>', 'locals').replace('<lambda>', 'lambda')}"


def _no_import_path(tool: Any) -> str:
    return (
        f"tool {getattr(tool, '__name__', tool)!r} has no import path (a lambda or a nested function), "
        "so the sub-LLMs' workers cannot run it: pass it in root_tools= for the REPL only"
    )


def shared_tool_paths(tools: Sequence[ToolLike], refusal: Callable[[Any], str] = _no_import_path) -> list[str]:
    """The dotted paths the sub-LLMs' workers import ``tools`` (shared tools) by.

    Args:
        tools: callables or dotted paths.
        refusal: the error text for a callable without an import path (the caller's words).

    Raises:
        ConfigError: a callable has no import path (a lambda, a nested function): the workers
            could not run it, so it belongs in ``root_tools``.
    """
    paths: list[str] = []
    for tool in tools:
        path = tool if isinstance(tool, str) else import_path(tool)
        if path is None:
            raise ConfigError(refusal(tool))
        paths.append(path.strip())
    return paths


@dataclass(frozen=True)
class RootTool:
    """One tool of the REPL: its global name, the callable, and what the model is told of it."""

    name: str
    func: Callable[..., Any]
    signature: str
    """``name(a, b=1)``; ``name(...)`` when the signature cannot be read."""
    doc: str

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> RootTool:
        """Describe ``fn``; its name is its ``__name__``.

        Raises:
            ConfigError: the name cannot be a REPL global of its own (not an identifier, a
                keyword, private, a builtin, or a fixed REPL name: ``llm_batch``, ``rlm_batch``,
                ``context``, ``answer``).
        """
        name = getattr(fn, "__name__", None)
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise ConfigError(f"tool {fn!r} has no usable __name__ (a Python identifier) to be a REPL global")
        if name in RESERVED_NAMES:
            fixed = ", ".join(sorted(RESERVED_NAMES))
            raise ConfigError(f"tool name {name!r} collides with a fixed REPL name ({fixed})")
        if name.startswith("_") or hasattr(builtins, name):
            raise ConfigError(f"tool name {name!r} is private or a Python builtin; rename the function")
        try:
            signature = f"{name}{inspect.signature(fn, eval_str=True)}"
        except Exception:  # noqa: BLE001 - annotations that do not evaluate: as written
            try:
                signature = f"{name}{inspect.signature(fn)}"
            except (TypeError, ValueError):
                signature = f"{name}(...)"
        doc = inspect.cleandoc(getattr(fn, "__doc__", None) or "")[:DOC_CHARS]
        return cls(name=name, func=fn, signature=signature, doc=doc)

    def summary(self) -> str:
        """``signature: first line of the docstring`` (for the scaffold)."""
        first = self.doc.strip().splitlines()[0] if self.doc.strip() else ""
        return f"`{self.signature}`" + (f": {first}" if first else "")


class ToolFailure(Exception):
    """A root-tool call failed (raised, timed out, returned too much); the message goes to the cell."""


class _TooLarge(Exception):
    pass


def _walk_size(value: Any, limit: int) -> None:
    """Raise :class:`_TooLarge` when ``value`` surely encodes to more than ``limit`` characters: a
    walk that adds up string lengths and one per other item, stopping past the limit (so a
    100 MB string is refused before any copy of it is made)."""
    size, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            size += len(item) + 2
        elif isinstance(item, dict):
            size += 2
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            size += 2
            stack.extend(item)
        else:
            size += 1
        if size > limit:
            raise _TooLarge


def encode_result(value: Any, limit: int) -> str:
    """The JSON text of a tool's result, at most ``limit`` characters (ASCII, so bytes too).

    A value that is not JSON-serializable (or has NaN, a cycle, nesting deeper than the
    recursion limit) becomes the JSON string of its ``repr``. Encoded incrementally: memory
    stays within the limit plus one piece (and the ``repr``, when it comes to that).

    Raises:
        ToolFailure: the encoding is longer than ``limit``, or the value is not JSON and its
            ``repr`` raised.
    """
    too_large = f"result is over the limit of {limit} bytes of JSON: return less (a summary, a page)"
    try:
        _walk_size(value, limit)
        parts: list[str] = []
        size = 0
        try:
            for piece in json.JSONEncoder(allow_nan=False).iterencode(value):
                size += len(piece)
                if size > limit:
                    raise _TooLarge
                parts.append(piece)
            return "".join(parts)
        except (TypeError, ValueError, RecursionError):
            del parts
        try:
            text = repr(value)
        except Exception as exc:  # noqa: BLE001 - an author's __repr__ (or one too deep to print)
            raise ToolFailure(
                f"result is not JSON and its repr failed: {type(exc).__name__}: {_message(exc)}"
            ) from None
        if len(text) + 2 > limit:
            raise _TooLarge from None
        encoded = json.dumps(text)
        if len(encoded) > limit:
            raise _TooLarge from None
        return encoded
    except _TooLarge:
        raise ToolFailure(too_large) from None


def _message(exc: BaseException) -> str:
    """``str(exc)`` cut to :data:`TRAJECTORY_PREVIEW` characters; never raises."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails
        return "(its message could not be read)"
    if len(text) > TRAJECTORY_PREVIEW:
        return text[:TRAJECTORY_PREVIEW] + f"... ({len(text) - TRAJECTORY_PREVIEW} more characters)"
    return text


@dataclass
class _Held:
    """One sync call's thread, held by its owner while it runs: which tool."""

    name: str


class RootToolbox:
    """The root tools of one environment and the threads their sync calls run in.

    Args:
        tools: callables or dotted import paths (``pkg.mod:func``).
        timeout: seconds one call may run (``root_tool_timeout``); encoding its result counts.
        max_result_bytes: largest JSON result of one call (``root_tool_max_result_bytes``).
        max_threads: most threads of sync calls kept running past their timeout. Each sync call
            runs in a daemon thread of its own (so a hung one never keeps the process from
            exiting); a thread past its timeout cannot be stopped (a Python thread cannot) and
            stays until its tool returns. When that many are hung, a sync call fails at once,
            saying so; calls within their timeout are not counted (a slow tool is not a hung one).

    Raises:
        ConfigError: a tool does not resolve, its name is refused (see :meth:`RootTool.of`),
            or two tools share a name.
    """

    def __init__(
        self, tools: Sequence[ToolLike], *, timeout: float, max_result_bytes: int, max_threads: int = 8
    ) -> None:
        self.tools: dict[str, RootTool] = {}
        for tool in tools:
            described = RootTool.of(resolve_tool(tool))
            if described.name in self.tools:
                raise ConfigError(
                    f"tool name collision: two tools are named {described.name!r}; each must be its own REPL global"
                )
            self.tools[described.name] = described
        self.timeout = timeout
        self.max_result_bytes = max_result_bytes
        self._threads = OverrunThreads(max_threads)
        """Threads of sync calls still running past their call's timeout."""
        self._held: dict[str, _Held] = {}
        """Per owner (a rollout), the thread of its sync call while that thread runs."""
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        """The tools' REPL global names, in the order given."""
        return list(self.tools)

    def close(self) -> None:
        """Nothing to let go of: each sync call's thread is a daemon thread that ends when its tool
        returns (or with the process). The toolbox stays usable (an environment started again)."""

    async def _in_thread(self, name: str, call: Callable[[], Any], owner: str | None) -> Any:
        held = _Held(name)
        with self._lock:
            previous = None if owner is None else self._held.get(owner)
            if previous is not None:
                raise ToolFailure(
                    f"{name}: this rollout's previous call of {previous.name} is still running past its "
                    "timeout and holds the rollout's tool thread until it returns; try again later"
                )
            if self._threads.full:
                raise ToolFailure(
                    f"all {self._threads.limit} threads of the root tools are busy (calls still running past "
                    "their timeout); try again later"
                )
            if owner is not None:
                self._held[owner] = held

        def release() -> None:
            with self._lock:
                if owner is not None and self._held.get(owner) is held:
                    del self._held[owner]

        try:
            waiting = self._threads.start(call, name=f"rlmq-root-tool-{name}", on_end=release)
        except RuntimeError as exc:  # "can't start new thread": the process is out of threads or memory
            release()
            raise ToolFailure(
                f"{name}: the producer could not start a thread for it ({exc}); try again later"
            ) from None
        return await waiting  # cancelled (the call's timeout, its rollout's end): the thread runs on, counted

    async def call(self, name: str, args: list[Any], kwargs: dict[str, Any], *, owner: str | None = None) -> str:
        """Run tool ``name`` with ``args``/``kwargs``; returns its result as JSON text.

        Args:
            owner: who calls (a rollout's id): an owner whose earlier sync call still runs past
                its timeout gets a :class:`ToolFailure` at once, so it holds one thread at most.

        Raises:
            ToolFailure: no such tool, it raised (the message names the exception; also
                ``SystemExit``, ``KeyboardInterrupt`` or a ``CancelledError`` of its own), it ran
                past the timeout, its result is over the limit or not JSON with a failing
                ``repr``, or no thread may be taken (see the class).
        """
        tool = self.tools.get(name)
        if tool is None:
            raise ToolFailure(f"no root tool named {name!r} (tools: {', '.join(self.tools) or 'none'})")
        limit = self.max_result_bytes

        def run_sync() -> tuple[bool, Any]:
            value = tool.func(*args, **kwargs)
            if inspect.isawaitable(value):
                return False, value
            return True, encode_result(value, limit)  # off the event loop, inside the timeout

        deadline = asyncio.timeout(self.timeout)
        try:
            async with deadline:
                if inspect.iscoroutinefunction(tool.func):
                    encoded, value = False, await tool.func(*args, **kwargs)
                else:
                    encoded, value = await self._in_thread(name, run_sync, owner)
                    if not encoded:
                        value = await value
        except ToolFailure as exc:
            raise ToolFailure(str(exc) if str(exc).startswith(name) else f"{name}: {exc}") from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # cancelled from outside (the rollout ended)
                raise
            raise ToolFailure(f"{name} raised CancelledError") from None
        except Exception as exc:
            if isinstance(exc, TimeoutError) and deadline.expired():
                raise ToolFailure(f"{name} did not return within its timeout of {self.timeout:g} s") from None
            raise ToolFailure(f"{name} raised {type(exc).__name__}: {_message(exc)}") from None
        except BaseException as exc:  # SystemExit (argparse given flags it refuses), KeyboardInterrupt: the
            # tool's own, never the producer's: let through, it would end the event loop (every rollout)
            message = _message(exc)
            raise ToolFailure(f"{name} raised {type(exc).__name__}" + (f": {message}" if message else "")) from None
        if encoded:
            return str(value)
        try:
            return encode_result(value, limit)
        except ToolFailure as exc:
            raise ToolFailure(f"{name}: {exc}") from None
        finally:
            del value


class RootToolService:
    """Runs the root-tool calls of one rollout and records them.

    Args:
        toolbox: the environment's tools.
    """

    def __init__(self, toolbox: RootToolbox) -> None:
        self.toolbox = toolbox
        self._running: dict[asyncio.Task[Any], tuple[Rollout, str, list[Any], dict[str, Any], float]] = {}
        self._closed = False

    async def run(self, rollout: Rollout, name: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[bool, str]:
        """One call from ``rollout``'s REPL: ``(True, result JSON)`` or ``(False, error message)``.

        Counted in ``rollout.stats`` (calls per tool, seconds, errors) and recorded in its
        trajectory with a preview of the arguments and the result. After :meth:`close` (the
        rollout ended), a call is refused, neither run nor recorded.

        Raises:
            LookupError: no tool of that name (nothing is run nor counted).
        """
        if name not in self.toolbox.tools:
            raise LookupError(f"no root tool named {name!r} (tools: {', '.join(self.toolbox.names) or 'none'})")
        if self._closed:
            return False, f"{name}: the rollout has ended"
        t0 = time.perf_counter()
        task = asyncio.current_task()
        if task is not None:
            self._running[task] = (rollout, name, args, kwargs, t0)
        ok, text = True, ""
        try:
            text = await self.toolbox.call(name, args, kwargs, owner=rollout.id)
        except ToolFailure as exc:
            ok, text = False, str(exc)
        finally:
            ended = task is not None and self._running.pop(task, None) is None
        if not ended:  # else close() recorded it, when the rollout ended
            self._record(rollout, name, args, kwargs, ok, text, time.perf_counter() - t0)
        return ok, text

    def close(self) -> None:
        """The rollout ended: record its calls still running as ended (before its figures are
        taken), cancel them (a sync tool's thread runs on until its tool returns, see
        :class:`RootToolbox`) and refuse later ones; idempotent."""
        self._closed = True
        running, self._running = self._running, {}
        for task, (rollout, name, args, kwargs, t0) in running.items():
            self._record(
                rollout,
                name,
                args,
                kwargs,
                False,
                f"{name}: the rollout ended before it returned",
                time.perf_counter() - t0,
            )
            task.cancel()

    @staticmethod
    def _record(
        rollout: Rollout, name: str, args: list[Any], kwargs: dict[str, Any], ok: bool, text: str, seconds: float
    ) -> None:
        try:
            shown_args = json.dumps({"args": args, "kwargs": kwargs})[:TRAJECTORY_PREVIEW]
        except (TypeError, ValueError, RecursionError):  # nested past what this stack can encode
            shown_args = ""
        stats = rollout.stats
        stats.root_tool_calls[name] = stats.root_tool_calls.get(name, 0) + 1
        stats.root_tool_seconds += seconds
        stats.root_tool_errors += not ok
        event: dict[str, Any] = {"type": "root_tool", "name": name, "arguments": shown_args, "ok": ok}
        event["result" if ok else "error"] = text[:TRAJECTORY_PREVIEW]
        event["seconds"] = round(seconds, 4)
        rollout.trajectory.append(event)
