"""The JSON payloads of rlmq, as pydantic models validated on both sides of the queue.

* :class:`SubLLMRequest` travels producer -> worker as the single argument of an RQ job.
* :class:`SubLLMResult` travels worker -> producer on the batch's reply stream.
* :class:`ChildRolloutRequest` travels a parent rollout's host -> a REPL-hosting worker as the
  single argument of a child-rollout job (``rlm_batch``); its answer is a :class:`SubLLMResult`
  whose ``child`` (:class:`ChildOutcome`) carries the child's stop reason, metrics and trajectory.
* :class:`LaneEntry` announces a small batch to one idle worker (its jobs and requests).
* :class:`DatasetRow` and :class:`ResultRow` are the JSONL contracts of ``shared/DESIGN.md``.
* :class:`BatchRequest` is the body ``llm_batch`` posts to the interception server;
  :class:`RlmBatchRequest` the body ``rlm_batch`` posts.
* :class:`RootToolRequest` is the body a root-tool stub in the REPL posts to it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
)

from rlmq.common.errors import PayloadError, validation_summary
from rlmq.common.token_wire import TurnTokens
from rlmq.common.tool_wire import HostedTool

StopReason = Literal[
    "answer_ready", "max_turns", "no_tool_call", "prompt_too_long", "code_timeout", "error", "budget_spent"
]
"""Why a rollout ended: ``answer_ready`` (a cell set ``answer["ready"]``), ``max_turns`` (the turn
limit, or the root's completion-token limit), ``no_tool_call`` (a root reply without code),
``prompt_too_long`` (the root model's server refused the prompt for its length),
``code_timeout`` (a cell timed out with ``abort_on_code_timeout``), ``error`` (a failure),
``budget_spent`` (a child rollout's root turn got less than ``child_root_min_grant_tokens`` from
its tree's budget, or was refused because its tree or its parent ended: it ends with its best
answer, ``answer["content"]`` so far)."""
SubCallStatus = Literal["ok", "rejected", "error"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


ROOT_RESERVED_SAMPLING: frozenset[str] = frozenset(
    {"model", "messages", "tools", "tool_choice", "n", "stream", "best_of", "n_predict", "max_new_tokens"}
)
"""Request fields that rlmq sets itself on a root-model call, or that would make a server
generate past ``max_tokens`` (llama.cpp's ``n_predict`` wins over it; ``best_of`` and ``n``
generate several sequences): sampling arguments may not name them."""
SUB_RESERVED_SAMPLING: frozenset[str] = ROOT_RESERVED_SAMPLING | {"max_tokens", "max_completion_tokens", "user"}
"""The same for a sub-LLM call: ``max_tokens`` is the budget's grant (or
``sub_llm_per_call_max_tokens``), ``n`` would multiply the completion tokens of one grant."""
MAX_SAMPLING_BYTES = 16_384
"""The largest JSON of one call's sampling arguments."""
SUB_LLM_MAX_TURNS_DEFAULT = 5
"""Turns of a sub-LLM's own tool loop unless set: the default of the ``sub_llm_max_turns``
setting, and of a job payload that does not say."""
SUB_LLM_MAX_TURNS_LIMIT = 100
"""The most turns of a sub-LLM's own tool loop: the upper bound of the ``sub_llm_max_turns``
setting and of :attr:`SubCallOptions.max_turns` alike, declared here once (a worker refuses a
job past it; a setting past it is refused at start-up, never by every ``llm_batch``)."""


def normalize_sampling(args: Any, *, sub: bool) -> dict[str, Any]:
    """Sampling arguments as one flat request body fragment, checked.

    Args:
        args: a JSON object (dict, or JSON text): ``temperature``, ``top_p``, ``max_tokens``
            (root only), ``extra_body`` (merged in: a server's own keys, such as ``top_k``), ...
        sub: for a sub-LLM call (:data:`SUB_RESERVED_SAMPLING`), else a root-model call.

    Returns:
        The arguments with ``extra_body`` merged in and ``max_completion_tokens`` named ``max_tokens``.

    Raises:
        ValueError: not a JSON object, too large, a number that is NaN or infinite, or a key
            that rlmq sets itself.
    """
    if isinstance(args, (str, bytes)):
        try:
            args = json.loads(args)
        except RecursionError:
            raise ValueError("sampling arguments are JSON nested too deeply") from None
        except ValueError as exc:
            raise ValueError(f"sampling arguments must be a JSON object: {exc}") from None
    if args is None:
        return {}
    if not isinstance(args, dict):
        raise ValueError('sampling arguments must be a JSON object, such as {"temperature": 0.7}')
    flat: dict[str, Any] = {}
    extra = args.get("extra_body") or {}
    if not isinstance(extra, dict):
        raise ValueError("extra_body must be a JSON object")
    for layer in (extra, args):
        for key, value in layer.items():
            if key == "extra_body":
                continue
            flat["max_tokens" if key == "max_completion_tokens" and not sub else key] = value
    cap = flat.get("max_tokens")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1) and not sub:
        raise ValueError(f"max_tokens must be a whole number of completion tokens >= 1, not {cap!r}")
    reserved = sorted(set(flat) & (SUB_RESERVED_SAMPLING if sub else ROOT_RESERVED_SAMPLING))
    if reserved:
        hint = " (the sub-LLM's max_tokens is --sub-llm-per-call-max-tokens)" if "max_tokens" in reserved else ""
        raise ValueError(f"sampling arguments may not set {', '.join(reserved)}: rlmq sets them{hint}")
    try:
        text = json.dumps(flat, allow_nan=False)
    except RecursionError:
        raise ValueError("sampling arguments are JSON nested too deeply") from None
    except ValueError:  # a request body with NaN or Infinity is not JSON: every call would fail
        raise ValueError("sampling arguments must be finite numbers (JSON has no NaN or Infinity)") from None
    if len(text) > MAX_SAMPLING_BYTES:
        raise ValueError(f"sampling arguments are over {MAX_SAMPLING_BYTES} bytes of JSON")
    return flat


class SubCallOptions(_Strict):
    """How the sub-LLM is called: what every sub-call of one batch shares.

    The producer's :class:`~rlmq.producer.dispatch.BatchSpec` holds one; each
    :class:`SubLLMRequest` of the batch carries these fields (it extends this model, so the
    job payload stays flat). Token figures are completion tokens.
    """

    model: str
    system_prompt: str | None = None
    sub_tools: list[str] = Field(default_factory=list)
    hosted_tools: list[HostedTool] = Field(default_factory=list, max_length=64)
    """Tools of ``sub_tools`` that the top rollout's process runs for a worker that does not
    allow-list them (:mod:`rlmq.common.tool_wire`): the process of the rollout itself, or for a
    call of a child rollout, that of its tree's top (:attr:`SubLLMRequest.tool_host`)."""
    hosted_tool_timeout: float | None = Field(default=None, gt=0)
    """Seconds a hosted tool may run in the rollout's process (``hosted_tool_timeout``; set with
    ``hosted_tools``)."""
    max_turns: int = Field(default=SUB_LLM_MAX_TURNS_DEFAULT, ge=1, le=SUB_LLM_MAX_TURNS_LIMIT)
    """Turns of the sub-LLM's own tool loop (``sub_llm_max_turns``)."""
    max_completion_tokens: int | None = Field(default=None, ge=1)
    """Per-call cap on completion tokens (``None``: the server's default)."""
    budgeted: bool = False
    """True when the rollout has a ``sub_llm_max_completion_tokens`` ledger in Redis."""
    temperature: float | None = None
    sampling: dict[str, Any] = Field(default_factory=dict)
    """Sampling arguments of every model call (``temperature``, ``top_p``, a server's own keys),
    checked by :func:`normalize_sampling` (never ``max_tokens``, ``n``, ``model``, ...)."""
    include_sub_llm_in_trajectory: bool = Field(
        default=False, validation_alias=AliasChoices("include_sub_llm_in_trajectory", "include_tokens")
    )
    """The rollout's ``include_sub_llm_in_trajectory``: ask the server for each turn's token ids
    and logprobs and return them in the result's ``turn_tokens`` (:mod:`rlmq.common.token_wire`),
    and return the sub-LLM's conversation (``messages``). Read from ``include_tokens`` too: a job
    of an older producer carried the option as two equal booleans, ``include_tokens`` and
    ``include_messages`` (:attr:`older_include_messages`)."""
    older_include_messages: bool = Field(default=False, exclude=True, repr=False, validation_alias="include_messages")
    """An older producer's ``include_messages`` (always equal to its ``include_tokens``, which is
    read as :attr:`include_sub_llm_in_trajectory`): accepted on the wire, never written nor used."""
    final_answer_turn: bool = True
    """At ``max_turns`` with tool calls: one more turn without tools asking for the final answer
    (``sub_llm_final_answer_turn``), budgeted like any turn."""

    @field_validator("sampling", mode="before")
    @classmethod
    def _checked_sampling(cls, value: Any) -> dict[str, Any]:
        return normalize_sampling(value, sub=True)  # a job cannot claim max_tokens past its grant


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
    ledger_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    """The budget ledger the call charges (:class:`rlmq.common.keys.LedgerKeys`); ``None``: the
    ledger named by ``rollout_id`` (a depth-1 rollout's own, and a job of an older producer).
    A job naming a ledger other than its rollout's is budgeted whatever it claims: that ledger
    must exist (:attr:`charged_ledger`)."""
    nodes: list[str] = Field(default_factory=list, max_length=64)
    """The tree chain of the rollout that made the call: node ids from the top rollout
    to the calling rollout itself, each ``[A-Za-z0-9_-]{1,64}``; every one must be alive in the
    ledger for a grant. Empty for a call of a top rollout (its payload stays as before)."""
    session_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._:-]{1,128}$")
    """Sent to the model server as ``X-Session-ID`` (verifiers' per-rollout routing header), so
    a session-affinity router keeps a rollout's calls on one server. The producer sets the
    rollout id; under the verifiers harness that is the trace id, the value verifiers sends on
    the root calls."""

    @property
    def charged_ledger(self) -> str:
        """The id of the ledger this call charges: ``ledger_id``, else ``rollout_id``."""
        return self.ledger_id or self.rollout_id

    @property
    def tool_host(self) -> str:
        """The rollout whose process runs the call's ``hosted_tools``: the top rollout of its tree,
        whose id is the ledger it charges (:attr:`charged_ledger`). A call naming a ledger other
        than its own rollout's is checked to be a call of a node of that tree before any model
        call (:attr:`must_be_budgeted`), so a job cannot send its tool calls to another tree's
        process."""
        return self.charged_ledger

    @property
    def must_be_budgeted(self) -> bool:
        """True when the call must find its ledger: it says so (``budgeted``), or it names a
        ledger other than its own rollout's (a missing one is then lost, never "unbudgeted")."""
        return self.budgeted or self.charged_ledger != self.rollout_id


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


class ChildRolloutRequest(_Strict):
    """One child rollout of an ``rlm_batch`` call, enqueued as one RQ job on
    :func:`~rlmq.common.keys.child_queue` ``(queue, depth)``.

    The slot fields (``rollout_id`` = the parent's id, ``batch_id``, ``index``) name where the
    answer goes, as for a :class:`SubLLMRequest`: the parent's reply stream
    ``RolloutKeys(rollout_id).reply(batch_id)``. Times are Unix seconds.
    """

    v: Literal[1] = 1
    rollout_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    """The parent rollout (its reply stream gets the answer)."""
    batch_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    index: int = Field(ge=0)
    child_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,48}$")
    """The child's id; attempt ``n`` of it runs as rollout (and tree node) ``f"{child_id}-{n}"``."""
    ledger_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    """The tree's budget ledger (the top rollout's)."""
    nodes: list[str] = Field(min_length=1, max_length=64)
    """Tree chain from the top rollout to the parent, inclusive (see :class:`SubLLMRequest`)."""
    depth: int = Field(ge=2)
    max_depth: int = Field(ge=2)
    prompt: str
    """The child's question: its root model's first user message."""
    context: Any = None
    """The child's REPL ``context`` (JSON: str, list or dict; ``None``: the empty string)."""
    model: str
    """The child's root model: the model of the queue it is enqueued for."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The child's :class:`~rlmq.common.settings.RolloutOptions` (JSON; no secrets)."""
    hosted_tools: list[HostedTool] = Field(default_factory=list, max_length=64)
    """The shared tools the tree's top rollout runs in its process (its id is ``ledger_id``): the
    child's sub-calls offer them as the top's own do (:mod:`rlmq.producer.hosted_tools`)."""
    enqueued_at: float
    deadline: float
    """Unix time after which the parent no longer waits for this child."""


class ChildOutcome(_Strict):
    """What a child rollout reports besides its answer (``SubLLMResult.child``)."""

    rollout_id: str
    """The id the answering attempt ran under (its tree node)."""
    depth: int = Field(ge=2)
    stop_reason: str
    metrics: dict[str, float | int] = Field(default_factory=dict)
    trajectory: list[dict[str, Any]] = Field(default_factory=list)
    """The child's own trajectory (its turns, cells, ``llm_batch`` and nested ``rlm_batch``)."""


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
    segments: int = Field(default=0, ge=0)
    """Model calls the answer took: one per turn, more where a turn's answer was continued under new
    budget segments (``docs/budget.md``)."""
    granted_tokens: int = 0
    released_tokens: int = 0
    overrun_tokens: int = Field(default=0, ge=0)
    """Completion tokens the server returned beyond the ``max_tokens`` it was sent (a server
    that ignores ``max_tokens``); they are in ``completion_tokens`` and charged to the budget."""
    underreported_tokens: int = Field(default=0, ge=0)
    """Completion ids the server served beyond the ``usage.completion_tokens`` it reported (a server
    that under-reports); they are in ``completion_tokens`` and charged to the budget."""
    budget_waits: int = Field(default=0, ge=0)
    """Times the call parked waiting for a release of its rollout's budget."""
    budget_wait_seconds: float = Field(default=0.0, ge=0)
    """Seconds the call spent parked waiting for budget."""
    truncated: bool = False
    final_turn: Literal["answered", "skipped"] | None = None
    """The forced final-answer turn at ``max_turns`` (``final_answer_turn``): ``answered`` when it
    ran, ``skipped`` when the budget had nothing left for it; ``None`` when none was due."""
    """The call's last model turn ended with ``finish_reason == "length"`` (cut by its grant or cap)."""
    queue_wait_seconds: float = 0.0
    seconds: float = 0.0
    """Wall time from the worker taking the job to the result (seconds)."""
    worker: str = ""
    attempt: int = 1
    messages: list[dict[str, Any]] | None = None
    """The sub-LLM's own conversation, when the producer asked for it in the trajectory."""
    child: ChildOutcome | None = None
    """Set on the answer of a child rollout (``rlm_batch``)."""
    turn_tokens: list[TurnTokens] | None = None
    """One record per model turn of the call, in order, with its served token ids and logprobs
    (or why it has none), when the request asked (``include_sub_llm_in_trajectory``) and the call answered
    (``ok``); rejected and failed calls carry none."""
    spilled: bool = False
    """True when the worker moved this result's ``turn_tokens`` and ``child.trajectory`` to their
    own Redis key (:meth:`rlmq.common.keys.RolloutKeys.spill` of the slot's job and attempt, with a
    TTL) to keep the reply stream small; the producer reads and deletes it (:mod:`rlmq.common.jobs.spill`)."""

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


class RlmTask(_Strict):
    """One task of ``rlm_batch``: the child rollout's question and its REPL ``context``."""

    prompt: str
    context: str | list[Any] | dict[str, Any] | None = None
    """JSON; ``None``: the child's ``context`` is the empty string."""


class RlmBatchRequest(_Strict):
    """Body of ``POST /rlm_batch`` on the interception server:
    ``{"tasks": [{"prompt": str, "context": JSON}, ...]}`` (the REPL turns a bare str task into
    ``{"prompt": str}``)."""

    tasks: list[RlmTask]


class RootToolRequest(_Strict):
    """Body of ``POST /root_tool`` on the interception server: one call of a root (REPL) tool,
    ``{"name": str, "args": [...], "kwargs": {...}}`` (JSON values, as the cell passed them)."""

    name: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


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
    rollout: int | None = Field(default=None, ge=0)
    """With ``rollouts_per_example`` > 1: which of the row's rollouts this is, ``0 .. n - 1``.
    ``None`` (one rollout per row) is left out of the JSON, so such rows keep the contract's keys."""
    sub_llm_error: str | None = None
    """The first error of a sub-LLM call of the rollout's tree that ended ``error`` (a model server
    that is down, say), whatever the rollout's own end; ``None`` (none failed) is left out of the JSON."""

    @model_serializer(mode="wrap")
    def _without_unset_rollout(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for key in ("rollout", "sub_llm_error"):
            if data.get(key) is None:
                data.pop(key, None)
        return data

    @property
    def key(self) -> tuple[str, int]:
        """``(id, rollout index)``: what names one rollout of a run."""
        return self.id, self.rollout or 0


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


def load_child_request(raw: Any) -> ChildRolloutRequest:
    """Validate a job argument (dict or JSON text) as a :class:`ChildRolloutRequest`.

    Raises:
        PayloadError: the payload is not a valid child-rollout request.
    """
    try:
        if isinstance(raw, (str, bytes)):
            return ChildRolloutRequest.model_validate_json(raw)
        return ChildRolloutRequest.model_validate(raw)
    except ValidationError as exc:
        raise PayloadError(f"invalid child-rollout request: {exc.error_count()} error(s): {_summary(exc)}") from exc


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
