"""The tool registry: Python functions a sub-LLM may call during its tool loop, their JSON
schemas and their guarded calls; used by workers (allow-listed tools, :mod:`rlmq.workers.tools`)
and by a rollout's process (the tools it hosts, :mod:`rlmq.producer.hosted_tools`).

The model sees each tool under the function's own name (``count_words``), with a JSON
schema built by pydantic from the signature and the docstring (first paragraph: the
description; a Google-style ``Args:`` section: the parameter descriptions). Arguments the
model sends are validated with the same pydantic model. Sync tools run in a daemon thread
of their own (one past its timeout neither queues later calls nor holds the worker's exit;
at most :data:`MAX_OVERRUN_THREADS` of them run on past their timeout, then sync tools are
refused until one returns), async tools are awaited; both under a timeout. A failing tool never raises (nor does its
``SystemExit``): the model gets a ``"[tool error] ..."`` string and can try again.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import re
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from rlmq.common.aio import OverrunThreads
from rlmq.common.errors import ConfigError, PayloadError
from rlmq.common.settings import setting_default

__all__ = ["MAX_OUTPUT_CHARS", "MAX_OVERRUN_THREADS", "ToolRegistry", "canonical_tool_path", "cut_text"]

MAX_OUTPUT_CHARS: int = setting_default("sub_tool_max_result_chars")
"""Characters of a tool call's answer (result or error) a registry keeps by default."""

MAX_OVERRUN_THREADS = 16
"""Threads of one rollout's sync tool calls (per registry) that may run on after their calls gave
up (a timeout or a cancelled job: a thread cannot be stopped). While that many run, that rollout's
sync tool calls are refused at once with a ``[tool error]`` line, so a tool that hangs costs a
bounded number of threads, and one rollout's hang costs other rollouts nothing."""
_PRUNE_AT = 256
"""Rollouts a registry keeps a thread count for before it forgets those with nothing running."""

_ARGS_HEADER = re.compile(r"^\s*(Args|Arguments|Parameters):\s*$")
_SECTION = re.compile(r"^\s*[A-Z][A-Za-z ]*:\s*$")
_ARG_LINE = re.compile(r"^\s*\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class _Tool:
    path: str
    """Canonical dotted path, ``pkg.mod.func``."""
    name: str
    """The name the model sees (the function's ``__name__``)."""
    func: Callable[..., Any]
    is_async: bool
    params: type[BaseModel]
    fields: tuple[tuple[str, str, bool], ...]
    """(pydantic field name, parameter name, positional-only) per parameter."""
    schema: dict[str, Any]


def canonical_tool_path(path: str) -> str:
    """A tool's dotted import path as the registry keys it: ``pkg.mod:func`` and ``pkg.mod.func``
    are one tool."""
    return path.strip().replace(":", ".")


def _import(path: str) -> Callable[..., Any]:
    path = path.strip()
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"sub-tool {path!r}: use a dotted import path, 'pkg.mod:func' or 'pkg.mod.func'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"sub-tool {path!r}: cannot import module {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"sub-tool {path!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ConfigError(f"sub-tool {path!r} is not callable")
    return typing.cast(Callable[..., Any], obj)


def _parse_doc(doc: str) -> tuple[str, dict[str, str]]:
    """Split a docstring into (description, {parameter: description}) (Google style)."""
    lines = doc.splitlines()
    description: list[str] = []
    params: dict[str, str] = {}
    i = 0
    while i < len(lines) and not _ARGS_HEADER.match(lines[i]):
        description.append(lines[i])
        i += 1
    current: str | None = None
    for line in lines[i + 1 :]:
        if not line.strip():
            current = None
            continue
        if _SECTION.match(line) and not line.startswith((" ", "\t")):
            break
        m = _ARG_LINE.match(line)
        if m and (current is None or len(line) - len(line.lstrip()) <= 4):
            current = m.group(1)
            params[current] = m.group(2).strip()
        elif current is not None:
            params[current] = (params[current] + " " + line.strip()).strip()
    paragraphs = "\n".join(description).strip().split("\n\n")
    return " ".join(paragraphs[0].split()) if paragraphs[0] else "", params


def _build(path: str, func: Callable[..., Any]) -> _Tool:
    name = getattr(func, "__name__", None) or canonical_tool_path(path).rsplit(".", 1)[-1]
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise ConfigError(f"sub-tool {path!r}: name {name!r} is not a valid tool name ([A-Za-z0-9_-]{{1,64}})")
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"sub-tool {path!r}: no inspectable signature: {exc}") from exc
    try:
        hints = typing.get_type_hints(func)
    except Exception:  # unresolvable annotations: fall back to Any
        hints = {}
    description, docs = _parse_doc(inspect.getdoc(func) or "")
    definitions: dict[str, Any] = {}
    fields: list[tuple[str, str, bool]] = []
    for i, (pname, param) in enumerate(sig.parameters.items()):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        field_name = f"a{i}"
        default = ... if param.default is param.empty else param.default
        annotation = hints.get(pname, Any)
        definitions[field_name] = (annotation, Field(default, alias=pname, description=docs.get(pname)))
        fields.append((field_name, pname, param.kind is param.POSITIONAL_ONLY))
    try:
        model: type[BaseModel] = create_model(f"{name}_arguments", __config__=ConfigDict(extra="forbid"), **definitions)
        parameters = model.model_json_schema(by_alias=True)
    except Exception as exc:
        raise ConfigError(f"sub-tool {path!r}: cannot build a JSON schema of its parameters: {exc}") from exc
    parameters.pop("title", None)
    for prop in parameters.get("properties", {}).values():
        if isinstance(prop, dict):
            prop.pop("title", None)
    parameters.setdefault("properties", {})
    function: dict[str, Any] = {"name": name, "parameters": parameters}
    if description:
        function["description"] = description
    return _Tool(
        path=canonical_tool_path(path),
        name=name,
        func=func,
        is_async=inspect.iscoroutinefunction(func),
        params=model,
        fields=tuple(fields),
        schema={"type": "function", "function": function},
    )


class _ToolExit(Exception):
    """A tool raised ``SystemExit``/``KeyboardInterrupt`` (argparse given flags it refuses calls
    ``sys.exit``): carried as an ordinary exception, since out of a task it would end the
    worker's event loop, every job it runs with it."""

    def __init__(self, raised: BaseException) -> None:
        super().__init__(str(raised))
        self.raised = raised


async def _run(tool: _Tool, args: list[Any], kwargs: dict[str, Any], threads: OverrunThreads) -> Any:
    """The tool's result (a sync tool in a daemon thread of its own, one past its timeout counted
    in ``threads``: it holds neither a pool's thread nor the worker's exit); its
    ``SystemExit``/``KeyboardInterrupt`` as :class:`_ToolExit` (caught here, inside the task
    ``wait_for`` runs it in)."""
    try:
        if tool.is_async:
            return await tool.func(*args, **kwargs)
        name = f"rlmq-sub-tool-{getattr(tool.func, '__name__', 'tool')}"
        return await threads.start(lambda: tool.func(*args, **kwargs), name=name)
    except (SystemExit, KeyboardInterrupt) as exc:
        raise _ToolExit(exc) from None


def cut_text(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, with a marker saying how many were cut (``sub_tool_max_result_chars``):
    what a tool answers travels through Redis, into the next model request and the trajectory."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [tool output truncated: {len(text) - limit} more characters]"


def _to_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


class ToolRegistry:
    """Sub-tools a worker may run, by dotted import path, allow-listed.

    Build it with :meth:`from_paths`; the registry *is* the allow-list. Tools are looked up
    by dotted path (``pkg.mod:func`` and ``pkg.mod.func`` are the same tool) or, when
    unambiguous, by the function name the model sees.

    Args:
        tools: the tools (use :meth:`from_paths`).
        max_output_chars: a tool's answer is cut to this many characters, with a marker.
    """

    def __init__(self, tools: Sequence[_Tool] = (), *, max_output_chars: int = MAX_OUTPUT_CHARS) -> None:
        self._by_path: dict[str, _Tool] = {t.path: t for t in tools}
        by_name: dict[str, list[_Tool]] = {}
        for t in self._by_path.values():
            by_name.setdefault(t.name, []).append(t)
        self._by_name = {n: ts[0] for n, ts in by_name.items() if len(ts) == 1}
        self.max_output_chars = max_output_chars
        self._overruns: dict[str, OverrunThreads] = {}
        self._callers: dict[str, int] = {}

    @classmethod
    def from_paths(cls, paths: Sequence[str], *, max_output_chars: int = MAX_OUTPUT_CHARS) -> ToolRegistry:
        """Import and register the tools at ``paths`` (``pkg.mod:func`` or ``pkg.mod.func``).

        Raises:
            ConfigError: a path does not import, is not callable, or its parameters have no
                JSON schema.
        """
        return cls([_build(p, _import(p)) for p in paths if p.strip()], max_output_chars=max_output_chars)

    @property
    def paths(self) -> list[str]:
        """Canonical dotted paths of the allowed tools."""
        return list(self._by_path)

    def _find(self, name: str) -> _Tool | None:
        return self._by_path.get(canonical_tool_path(name)) or self._by_name.get(name)

    def is_allowed(self, name: str) -> bool:
        """Whether ``name`` (a dotted path or a model-facing name) is on the allow-list."""
        return self._find(name) is not None

    @classmethod
    def from_callables(
        cls, tools: Sequence[tuple[str, Callable[..., Any]]], *, max_output_chars: int = MAX_OUTPUT_CHARS
    ) -> ToolRegistry:
        """Register already-resolved callables under their dotted paths (the rollout's hosted tools).

        Raises:
            ConfigError: a callable's name or parameters cannot make a tool schema.
        """
        return cls([_build(p, f) for p, f in tools], max_output_chars=max_output_chars)

    def check_allowed(self, names: Sequence[str]) -> None:
        """Check that every tool in ``names`` is on the allow-list.

        Raises:
            PayloadError: naming the tools that are not allowed, or two requested tools that
                the model would see under the same name.
        """
        missing = [n for n in names if self._find(n) is None]
        if missing:
            allowed = ", ".join(self._by_path) or "none"
            raise PayloadError(f"sub-tool(s) not allowed on this worker: {', '.join(missing)} (allowed: {allowed})")
        seen: dict[str, str] = {}
        for n in names:
            tool = self._find(n)
            assert tool is not None
            other = seen.setdefault(tool.name, tool.path)
            if other != tool.path:
                raise PayloadError(f"sub-tools {other} and {tool.path} share the name {tool.name!r}")

    def schemas(self, names: Sequence[str]) -> list[dict[str, Any]]:
        """OpenAI tool schemas (``{"type": "function", "function": {...}}``) of ``names``.

        Duplicates are listed once.

        Raises:
            PayloadError: a tool is not allowed.
        """
        self.check_allowed(names)
        out: list[dict[str, Any]] = []
        seen: set[str] = set()
        for n in names:
            tool = self._find(n)
            assert tool is not None
            if tool.path not in seen:
                seen.add(tool.path)
                out.append(tool.schema)
        return out

    def tool_name(self, name: str) -> str:
        """The name the model sees for the allowed tool ``name`` (dotted path or name).

        Raises:
            PayloadError: the tool is not allowed.
        """
        tool = self._find(name)
        if tool is None:
            raise PayloadError(f"sub-tool not allowed on this worker: {name}")
        return tool.name

    def overrun_threads(self, owner: str = "") -> int:
        """Threads of ``owner``'s sync tool calls running on past their callers now."""
        threads = self._overruns.get(owner)
        return threads.count if threads is not None else 0

    def _threads(self, owner: str) -> OverrunThreads:
        threads = self._overruns.get(owner)
        if threads is None:
            if len(self._overruns) >= _PRUNE_AT:  # forget the rollouts with nothing left running
                for key, t in list(self._overruns.items()):
                    if t.count == 0 and not self._callers.get(key):
                        del self._overruns[key]
            threads = self._overruns[owner] = OverrunThreads(MAX_OVERRUN_THREADS)
        return threads

    async def call(self, name: str, arguments_json: str, *, timeout: float = 30.0, owner: str = "") -> str:
        """Run a tool with the JSON arguments a model sent; never raises (except cancellation).
        Its answer, result or error, is at most ``max_output_chars`` characters (plus a marker):
        a tool raising with a 52 MB message answers 20,000 characters of it by default.

        Args:
            name: the tool's dotted path or its model-facing name.
            arguments_json: a JSON object of arguments (empty string: no arguments).
            timeout: seconds the tool may run. A sync tool that overruns keeps its thread
                until it returns (Python threads cannot be killed), but the call returns.
            owner: whose call (the rollout id): the cap on threads run on past their callers
                (:data:`MAX_OVERRUN_THREADS`) is counted per owner.

        Returns:
            The tool's answer as text (``str`` as is, anything else as JSON), cut to
            ``max_output_chars``; or ``"[tool error] ..."`` saying what went wrong.
        """
        self._callers[owner] = self._callers.get(owner, 0) + 1
        try:
            text = await self._call(name, arguments_json, timeout, self._threads(owner))
            return cut_text(text, self.max_output_chars)
        finally:
            left = self._callers[owner] - 1
            if left:
                self._callers[owner] = left
            else:
                del self._callers[owner]

    async def _call(self, name: str, arguments_json: str, timeout: float, threads: OverrunThreads) -> str:
        tool = self._find(name)
        if tool is None:
            return f"[tool error] unknown tool {name!r}"
        try:
            raw = json.loads(arguments_json) if arguments_json and arguments_json.strip() else {}
        except ValueError as exc:
            return f"[tool error] {tool.name}: arguments are not valid JSON: {exc}"
        if not isinstance(raw, dict):
            return f"[tool error] {tool.name}: arguments must be a JSON object"
        try:
            parsed = tool.params.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(arguments)'}: {e['msg']}" for e in exc.errors()[:5]
            )
            return f"[tool error] {tool.name}: invalid arguments: {problems}"
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for field_name, pname, positional in tool.fields:
            value = getattr(parsed, field_name)
            if positional:
                args.append(value)
            else:
                kwargs[pname] = value
        if not tool.is_async and threads.full:
            return (
                f"[tool error] {tool.name}: refused: {threads.count} earlier sync tool calls still run "
                "past their timeout here; try again later"
            )
        try:
            result = await asyncio.wait_for(_run(tool, args, kwargs, threads), timeout)
        except TimeoutError:
            return f"[tool error] {tool.name} timed out after {timeout:g} s"
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # the job was cancelled: not the tool's doing
                raise
            return f"[tool error] {tool.name}: CancelledError"
        except _ToolExit as exc:
            return f"[tool error] {tool.name}: {type(exc.raised).__name__}: {exc.raised}"
        except Exception as exc:
            return f"[tool error] {tool.name}: {type(exc).__name__}: {exc}"
        return _to_text(result)
