"""In-memory doubles of the root model (:class:`~rlmq.producer.root.RootClient`) and of a
rollout's REPL (:class:`~rlmq.producer.engine.ReplSession`), for the root loop's and the
engine's unit tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from openai.types.chat import ChatCompletion
from redis.asyncio import Redis

from rlmq.common.settings import RolloutOptions
from rlmq.producer.engine import RolloutHost
from rlmq.producer.interception import BatchHandler, RlmBatchHandler, ToolHandler
from rlmq.producer.repl import CellResult

Reply = ChatCompletion | BaseException | Callable[[dict[str, Any]], Any]
"""What the fake model answers one call with: a completion, an exception to raise, or a
callable of the call's keyword arguments (awaited when it returns an awaitable)."""


def completion(
    content: str | None = None,
    *,
    tool_calls: list[dict[str, Any]] | None = None,
    prompt_tokens: int = 10,
    completion_tokens: int = 5,
    usage: bool = True,
) -> ChatCompletion:
    """An OpenAI ``ChatCompletion`` with one choice (``tool_calls``: raw OpenAI tool-call dicts)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    body: dict[str, Any] = {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": "fake-root",
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if tool_calls else "stop"}],
    }
    if usage:
        body["usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
    return ChatCompletion.model_validate(body)


def repl_call(code: str, call_id: str = "call_1", *, arguments: str | None = None) -> dict[str, Any]:
    """A ``call_python_repl`` tool call running ``code`` (or carrying raw ``arguments``)."""
    args = json.dumps({"code": code}) if arguments is None else arguments
    return {"id": call_id, "type": "function", "function": {"name": "call_python_repl", "arguments": args}}


def code_turn(code: str, **usage: Any) -> ChatCompletion:
    """A root turn that runs ``code`` in the REPL."""
    return completion(tool_calls=[repl_call(code)], **usage)


class FakeRoot:
    """A root model that answers each call with the next of ``replies`` (the last one repeats).

    Attributes:
        calls: the keyword arguments of every call, ``messages`` copied as they were sent.
    """

    def __init__(self, *replies: Reply) -> None:
        assert replies
        self.replies = list(replies)
        self.calls: list[dict[str, Any]] = []

    async def chat(self, **kwargs: Any) -> Any:
        self.calls.append({**kwargs, "messages": [dict(m) for m in kwargs["messages"]]})
        reply = self.replies[min(len(self.calls), len(self.replies)) - 1]
        if isinstance(reply, BaseException):
            raise reply
        if callable(reply):
            out = reply(kwargs)
            return await out if asyncio.iscoroutine(out) else out
        return reply

    async def close(self) -> None:
        """Nothing to close."""


class FakeRepl:
    """A REPL that understands a few cells instead of Python:

    ``answer:<text>`` sets ``answer["content"]`` to ``<text>`` and ``answer["ready"]``;
    ``content:<text>`` only sets the content; ``hang`` times out (``timed_out`` and
    ``restarted``); ``sleep:<seconds>`` waits; anything else prints ``ran <code>``.
    """

    def __init__(self) -> None:
        self.cells: list[str] = []
        self.content = ""
        self.started = False
        self.closed = False

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        yield

    async def retain_files(self) -> str | None:
        return None

    async def execute(self, code: str, history: str | None = None) -> CellResult:
        self.cells.append(code)
        if code == "hang":
            return CellResult("[timeout] the cell ran past its limit", False, self.content, 1.0, True, True)
        if code.startswith("sleep:"):
            await asyncio.sleep(float(code.split(":", 1)[1]))
        if code.startswith(("answer:", "content:")):
            kind, self.content = code.split(":", 1)
            return CellResult("", kind == "answer", self.content, 0.01, False, False)
        return CellResult(f"ran {code}", False, self.content, 0.01, False, False)


class FakeInterception:
    """An interception endpoint that only keeps the registered handlers."""

    url = "http://127.0.0.1:1/llm_batch"

    def __init__(self) -> None:
        self.handlers: dict[str, BatchHandler] = {}
        self.tool_handlers: dict[str, ToolHandler] = {}
        self.rlm_handlers: dict[str, RlmBatchHandler] = {}

    def register(
        self, handler: BatchHandler, tools: ToolHandler | None = None, rlm: RlmBatchHandler | None = None
    ) -> str:
        token = f"t{len(self.handlers) + 1}"
        self.handlers[token] = handler
        if tools is not None:
            self.tool_handlers[token] = tools
        if rlm is not None:
            self.rlm_handlers[token] = rlm
        return token

    def unregister(self, token: str) -> None:
        self.handlers.pop(token, None)
        self.tool_handlers.pop(token, None)
        self.rlm_handlers.pop(token, None)

    def unix_path_of(self, token: str) -> str | None:
        return None


def fake_repl_factory(
    made: list[FakeRepl],
) -> Callable[[Any, str, RolloutOptions, Any, Sequence[dict[str, str]]], FakeRepl]:
    """A :data:`~rlmq.producer.engine.ReplFactory` of :class:`FakeRepl`, each appended to ``made``."""

    def make(
        row: Any, token: str, options: RolloutOptions, interception: Any, tools: Sequence[dict[str, str]]
    ) -> FakeRepl:
        repl = FakeRepl()
        made.append(repl)
        return repl

    return make


def host_for(redis: Redis, root: Any, repls: list[FakeRepl]) -> RolloutHost:
    """A rollout host on ``redis`` with the root model ``root`` (a :class:`FakeRoot`) whose REPLs
    are fakes, appended to ``repls`` as they are made."""
    host = RolloutHost.build(redis, root, FakeInterception())
    host.make_repl = fake_repl_factory(repls)
    return host
