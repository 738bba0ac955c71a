"""The JSON payloads of rlmq, as pydantic models validated on both sides of the queue.

* :class:`SubLLMRequest` travels producer -> worker as the single argument of an RQ job.
* :class:`SubLLMResult` travels worker -> producer on the batch's reply stream.
* :class:`LaneEntry` announces a small batch to one idle worker (its jobs and requests).
* :class:`DatasetRow` and :class:`ResultRow` are the JSONL contracts of ``shared/DESIGN.md``.
* :class:`BatchRequest` is the body ``llm_batch`` posts to the interception server.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlmq.common.errors import PayloadError, validation_summary

StopReason = Literal["answer_ready", "max_turns", "no_tool_call", "error"]
SubCallStatus = Literal["ok", "rejected", "error"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class SubCallOptions(_Strict):
    """How the sub-LLM is called: what every sub-call of one batch shares.

    The producer's :class:`~rlmq.producer.dispatch.BatchSpec` holds one; each
    :class:`SubLLMRequest` of the batch carries these fields (it extends this model, so the
    job payload stays flat). Token figures are completion tokens.
    """

    model: str
    system_prompt: str | None = None
    sub_tools: list[str] = Field(default_factory=list)
    max_turns: int = Field(default=5, ge=1, le=100)
    """Turns of the sub-LLM's own tool loop (``sub_llm_max_turns``)."""
    max_completion_tokens: int | None = Field(default=None, ge=1)
    """Per-call cap on completion tokens (``None``: the server's default)."""
    budgeted: bool = False
    """True when the rollout has a ``sub_llm_max_completion_tokens`` ledger in Redis."""
    temperature: float | None = None
    include_messages: bool = False
    """Return the sub-LLM's conversation in the result (``include_sub_llm_in_trajectory``)."""


class SubLLMRequest(SubCallOptions):
    """One sub-LLM call, enqueued as one RQ job: its batch's :class:`SubCallOptions` and its own slot.

    Times are Unix seconds (``time.time()``).
    """

    v: Literal[1] = 1
    rollout_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    batch_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    index: int = Field(ge=0)
    prompt: str
    enqueued_at: float
    deadline: float
    """Unix time after which the producer no longer waits for this result."""
    session_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._:-]{1,128}$")
    """Sent to the model server as ``X-Session-ID`` (verifiers' per-rollout routing header), so
    a session-affinity router keeps a rollout's calls on one server. The producer sets the
    rollout id; under the verifiers harness that is the trace id, the value verifiers sends on
    the root calls."""


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
    """The answer to one :class:`SubLLMRequest`, added to the batch's reply stream."""

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
    budget_waits: int = Field(default=0, ge=0)
    """Times the call parked waiting for a release of its rollout's budget."""
    budget_wait_seconds: float = Field(default=0.0, ge=0)
    """Seconds the call spent parked waiting for budget."""
    truncated: bool = False
    """The call's last model turn ended with ``finish_reason == "length"`` (cut by its grant or cap)."""
    queue_wait_seconds: float = 0.0
    seconds: float = 0.0
    """Wall time from the worker taking the job to the result (seconds)."""
    worker: str = ""
    attempt: int = 1
    messages: list[dict[str, Any]] | None = None
    """The sub-LLM's own conversation, when the producer asked for it in the trajectory."""

    @classmethod
    def failure(
        cls,
        rollout_id: str,
        batch_id: str,
        index: int,
        *,
        kind: str,
        content: str,
        error: str,
        job_id: str = "",
        status: SubCallStatus = "error",
        worker: str = "",
        attempt: int = 1,
    ) -> SubLLMResult:
        """The result of a slot that got no answer from a model: the one way rlmq builds one.

        Args:
            rollout_id / batch_id / index: the slot.
            kind: ``error_kind`` (``deadline``, ``payload``, ``abandoned``, ``no_worker``,
                ``redis``, ...).
            content: what the root model sees (starts with ``[error]`` or ``[rejected]``).
            error: the short cause, for logs and metrics.
            status: ``error`` (default) or ``rejected``.
        """
        return cls(
            rollout_id=rollout_id, batch_id=batch_id, index=index, job_id=job_id, status=status,
            error_kind=kind, content=content, error=error, worker=worker, attempt=attempt,
        )  # fmt: skip


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


def _summary(exc: ValidationError) -> str:
    """The first errors of ``exc``, without the input values: an invalid job's prompt (any size)
    must not be copied into its error result, the RQ failure record and the log."""
    return str(exc.errors(include_url=False, include_input=False, include_context=False)[:3])[:1000]


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
        raise PayloadError(f"invalid sub-LLM request: {exc.error_count()} error(s): {_summary(exc)}") from exc


def load_lane_entry(raw: str | bytes) -> LaneEntry:
    """Validate a lane entry as a :class:`LaneEntry`.

    Raises:
        PayloadError: the entry is not a valid lane entry.
    """
    try:
        return LaneEntry.model_validate_json(raw)
    except ValidationError as exc:
        raise PayloadError(f"invalid lane entry: {exc.error_count()} error(s): {_summary(exc)}") from exc


def load_result(raw: str | bytes) -> SubLLMResult:
    """Validate a reply-stream entry as a :class:`SubLLMResult`.

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
        PayloadError: a line is not UTF-8, not valid JSON or misses ``id`` / ``question`` / ``context``.
    """
    rows: list[DatasetRow] = []
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PayloadError(f"{path}:{lineno}: not UTF-8 ({exc.reason} at byte {exc.start})") from exc
            if not line.strip():
                continue
            try:
                rows.append(DatasetRow.model_validate(json.loads(line)))
            except ValidationError as exc:  # one line: "question: Field required; context: ..."
                raise PayloadError(f"{path}:{lineno}: not a dataset row ({validation_summary(exc, 'row')})") from exc
            except ValueError as exc:
                raise PayloadError(f"{path}:{lineno}: not a dataset row: {exc}") from exc
    return rows
