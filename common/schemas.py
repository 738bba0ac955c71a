"""The JSON payloads of rlmq, as pydantic models validated on both sides of the queue.

* :class:`SubLLMRequest` travels producer -> worker as the single argument of an RQ job.
* :class:`SubLLMResult` travels worker -> producer on the batch's reply list.
* :class:`LaneEntry` announces a small batch to one idle worker (its jobs and requests).
* :class:`DatasetRow` and :class:`ResultRow` are the JSONL contracts of ``shared/DESIGN.md``.
* :class:`BatchRequest` is the body ``llm_batch`` posts to the interception server.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlmq.common.errors import PayloadError

StopReason = Literal["answer_ready", "max_turns", "no_tool_call", "error"]
SubCallStatus = Literal["ok", "rejected", "error"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class SubLLMRequest(_Strict):
    """One sub-LLM call, enqueued as one RQ job.

    Times are Unix seconds (``time.time()``); token figures are completion tokens.
    """

    v: Literal[1] = 1
    rollout_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    batch_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    index: int = Field(ge=0)
    prompt: str
    model: str
    system_prompt: str | None = None
    sub_tools: list[str] = Field(default_factory=list)
    max_turns: int = Field(default=5, ge=1, le=100)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    """Per-call cap on completion tokens (``None``: the server's default)."""
    budgeted: bool = False
    """True when the rollout has a ``sub_llm_max_completion_tokens`` ledger in Redis."""
    enqueued_at: float
    deadline: float
    """Unix time after which the producer no longer waits for this result."""
    temperature: float | None = None
    include_messages: bool = False
    """Return the sub-LLM's conversation in the result (``include_sub_llm_in_trajectory``)."""


class LaneJob(_Strict):
    """One job of a :class:`LaneEntry`: its RQ job id and, when small enough, its request."""

    job_id: str
    request: SubLLMRequest | None = None
    """``None`` when the prompt is too long to copy; the worker then reads the job hash."""


class LaneEntry(_Strict):
    """A small batch announced on its queue's lane (``rlmq.common.keys.lane``) for an idle worker.

    ``enqueued_at`` is the producer's Unix time (seconds). The jobs are on ``queue`` as
    well: the worker that pops the entry still takes them with ``START``, and starts each
    call (a budgeted one: its first reservation) while ``START`` is on its way (see
    ``rlmq.workers.worker``).
    """

    v: Literal[1] = 1
    queue: str
    enqueued_at: float
    jobs: list[LaneJob] = Field(min_length=1)


class SubLLMResult(_Strict):
    """The answer to one :class:`SubLLMRequest`, pushed to the batch's reply list."""

    v: Literal[1] = 1
    rollout_id: str
    batch_id: str
    index: int = Field(ge=0)
    job_id: str
    status: SubCallStatus
    content: str
    """The sub-LLM's final answer; for ``rejected`` / ``error`` the message shown to the root."""
    error: str | None = None
    error_kind: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    turns: int = 0
    tool_calls: int = 0
    grants: int = 0
    granted_tokens: int = 0
    released_tokens: int = 0
    queue_wait_seconds: float = 0.0
    seconds: float = 0.0
    """Wall time from the worker taking the job to the result (seconds)."""
    worker: str = ""
    attempt: int = 1
    messages: list[dict[str, Any]] | None = None
    """The sub-LLM's own conversation, when the producer asked for it in the trajectory."""


class BatchRequest(_Strict):
    """Body of ``POST /llm_batch`` on the interception server: ``{"prompts": [str, ...]}``."""

    prompts: list[str]


class DatasetRow(BaseModel):
    """One dataset row (JSONL), the contract of ``shared/DESIGN.md``."""

    model_config = ConfigDict(extra="ignore")

    id: str
    question: str
    context: str | list[Any] | dict[str, Any]
    answer: str | None = None
    info: dict[str, Any] = Field(default_factory=dict)


class ResultRow(BaseModel):
    """One result row (JSONL) written by ``rlmq demo`` / ``rlmq run``."""

    id: str
    final_answer: str | None
    answer: str | None
    correct: bool | None
    stop_reason: StopReason
    metrics: dict[str, float | int]
    error: str | None = None


def load_request(raw: Any) -> SubLLMRequest:
    """Validate a job argument (dict or JSON text) as a :class:`SubLLMRequest`.

    Raises:
        PayloadError: the payload is not a valid request.
    """
    try:
        if isinstance(raw, (str, bytes)):
            return SubLLMRequest.model_validate_json(raw)
        return SubLLMRequest.model_validate(raw)
    except ValidationError as exc:
        raise PayloadError(f"invalid sub-LLM request: {exc.error_count()} error(s): {exc.errors()[:3]}") from exc


def load_lane_entry(raw: str | bytes) -> LaneEntry:
    """Validate a lane entry as a :class:`LaneEntry`.

    Raises:
        PayloadError: the entry is not a valid lane entry.
    """
    try:
        return LaneEntry.model_validate_json(raw)
    except ValidationError as exc:
        raise PayloadError(f"invalid lane entry: {exc.error_count()} error(s): {exc.errors()[:3]}") from exc


def load_result(raw: str | bytes) -> SubLLMResult:
    """Validate a reply-list entry as a :class:`SubLLMResult`.

    Raises:
        PayloadError: the entry is not a valid result.
    """
    try:
        return SubLLMResult.model_validate_json(raw)
    except ValidationError as exc:
        raise PayloadError(f"invalid sub-LLM result: {exc.errors()[:3]}") from exc


def read_dataset(path: str) -> list[DatasetRow]:
    """Read a JSONL dataset file into rows.

    Raises:
        PayloadError: a line is not valid JSON or misses ``id`` / ``question`` / ``context``.
    """
    rows: list[DatasetRow] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rows.append(DatasetRow.model_validate(json.loads(line)))
            except ValidationError as exc:  # one line: "question: Field required; context: ..."
                what = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'row'}: {e['msg']}" for e in exc.errors())
                raise PayloadError(f"{path}:{lineno}: not a dataset row ({what})") from exc
            except ValueError as exc:
                raise PayloadError(f"{path}:{lineno}: not a dataset row: {exc}") from exc
    return rows
