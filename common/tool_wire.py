"""The wire format of hosted tools: a sub-LLM's call of a tool that lives in its rollout's process.

A shared tool (verifiers ``RLMEnv``'s ``tools``, #966 / 0.1.14: callables offered to the root
REPL and to the sub-LLMs alike) is a callable of the environment author's process. A worker
that allow-lists its import path runs it itself (the fast path, :mod:`rlmq.workers.tools`);
one that does not sends the call to the rollout through Redis:

* the job carries the tool's schema in ``SubCallOptions.hosted_tools`` (:class:`HostedTool`);
* the worker ``XADD``\\ s a :class:`ToolCallRequest` (field :data:`FIELD`) to
  ``RolloutKeys.tool_requests``, then reads ``RolloutKeys.tool_answer(id)`` from its start;
* the rollout's process runs the callable once per request id and ``XADD``\\ s one
  :class:`ToolCallAnswer` there, with a TTL.

The request id names the logical call: job id, turn, tool-call index and a digest of the
tool's name and arguments, with no attempt number, so a job re-run after its worker died (or a
request sent again after a dropped connection) gets the stored answer instead of a second run.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CALLS_PER_ROLLOUT", "FIELD", "HostedTool", "ToolCallAnswer", "ToolCallRequest", "request_id"]

CALLS_PER_ROLLOUT = 16
"""Hosted-tool calls of one rollout in flight at once on a worker (each holds a Redis connection
while it waits) and run at once by the rollout's process: past it, a rollout's calls wait their
turn (its stream holds them), so one rollout's flood costs other rollouts nothing and never
takes a worker's whole connection pool."""

FIELD = "m"
"""The field of a request or answer stream entry that holds the JSON message."""

TOOL_ERROR = "[tool error]"
"""How an answer that is an error starts (as a worker's own tool errors do)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HostedTool(_Strict):
    """A tool the rollout's process runs for its sub-LLMs.

    Attributes:
        path: its dotted import path as given (``pkg.mod.func``; a worker that allow-lists it
            runs it itself).
        tool_schema: the OpenAI tool schema the sub-LLM is offered
            (``{"type": "function", "function": {"name": ..., "parameters": ...}}``).
    """

    path: str = Field(min_length=1, max_length=512)
    tool_schema: dict[str, Any]

    @property
    def name(self) -> str:
        """The name the model sees."""
        return str(self.tool_schema.get("function", {}).get("name", ""))


class ToolCallRequest(_Strict):
    """One hosted-tool call, worker to rollout.

    Attributes:
        id: the logical call (:func:`request_id`).
        tool: the tool's dotted path (:attr:`HostedTool.path`).
        arguments: the JSON object text the model sent.
        wait: seconds the worker waits for the answer (after that nobody reads it).
    """

    v: Literal[1] = 1
    id: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,200}$")
    tool: str = Field(min_length=1, max_length=512)
    arguments: str
    wait: float = Field(gt=0)


class ToolCallAnswer(_Strict):
    """The rollout's answer to one :class:`ToolCallRequest`.

    Attributes:
        ok: the tool returned (``text`` is its result as text); else ``text`` is a one-line
            ``[tool error] ...``.
    """

    v: Literal[1] = 1
    id: str
    ok: bool
    text: str


def request_id(job_id: str, turn: int, index: int, name: str, arguments: str) -> str:
    """The id of one logical hosted-tool call (see the module docstring).

    Args:
        job_id: the sub-call's RQ job id.
        turn: the sub-LLM's turn (1-based); index: the tool call's place in that turn's calls.
        name / arguments: what the model asked for (a re-run whose model asks for something
            else makes another call).
    """
    digest = hashlib.sha256(f"{name}\0{arguments}".encode()).hexdigest()[:16]
    return f"{job_id}:{turn}:{index}:{digest}"
