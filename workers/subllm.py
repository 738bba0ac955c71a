"""One sub-LLM call on a worker: the budget, the model call and the sub-tool loop.

This follows the sub-LLM tool loop of the reference ``RLMEnv`` (verifiers, March 2026:
up to ``sub_llm_max_turns`` model turns, each of which may call sub-tools) but with
rlmq's hard budget: before **every** model call the worker reserves a grant (at most the
ledger's per-call cap) in the rollout's Redis ledger, waiting for a release when running
calls hold the rest (:meth:`~rlmq.common.budget.ledger.BudgetLedger.acquire`), and calls the model
with ``max_tokens`` = that grant, then settles the reservation with what the server
reported. When the loop reaches ``max_turns`` with tool calls, the reference's forced
final-answer turn follows (``final_answer_turn``, on by default): the tools' results, then one
more model call without tools, asked for the final answer; it reserves like any other turn
and is skipped (``final_turn="skipped"``) when the budget has nothing left for it, so it never
overshoots. When the budget runs out mid-loop, the loop ends with the best answer it has. Whether a call is budgeted is
the ledger's to say: a job claiming ``budgeted: false`` for a rollout that has a ledger is
budgeted all the same. A result reports its waits (``budget_waits``,
``budget_wait_seconds``) and whether its last turn was cut (``truncated``,
``finish_reason == "length"``).

Settling (see :mod:`rlmq.common.budget.ledger`):

* a response with ``usage``: settle with ``usage.completion_tokens``;
* a response without ``usage``: settle with the whole grant (the server may have
  generated all of it; rlmq cannot count, so it charges the most it may have cost);
* :class:`~common.errors.ModelError` with an HTTP error status (the server answered with
  an error, so it generated nothing we will ever see): settle with 0;
* ``ModelError`` without a status (connection broken, timeout) or with a 2xx status and a
  malformed body: settle with the whole grant (tokens may have been generated);
* cancellation or an unexpected exception: the reservation stays open, i.e. charged in
  full, exactly as when the worker dies mid-call; it is never refunded.

Reservation ids are ``f"{job_id}:{attempt}:{turn}"``: a retried job (a new ``attempt``)
takes new reservations while the dead attempt's open ones stay charged; reserving the same
id twice (a redelivered copy of the same attempt) returns the same grant and charges
nothing more.

:func:`run_sub_llm` never raises (except :class:`asyncio.CancelledError`): every failure
becomes a :class:`~common.schemas.SubLLMResult` with ``status="error"`` and an
``error_kind``: ``payload`` (a tool outside the allow-list), ``model`` (the retry layer
gave up), ``deadline`` (past ``request.deadline``), ``budget_lost`` (the rollout's ledger
is gone), ``duplicate`` (this attempt's reservation was already settled by another copy of
the job), ``redis`` (Redis failed while reserving), ``internal`` (anything else).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Literal

from redis.asyncio import Redis
from redis.exceptions import RedisError

from rlmq.common.budget.calls import Settle
from rlmq.common.budget.ledger import WAITED_OUT, BudgetLedger, Grant
from rlmq.common.budget.turn import BudgetStop, CallBudget, LedgerTurn
from rlmq.common.errors import ModelError, PayloadError
from rlmq.common.schemas import SubCallStatus, SubLLMRequest, SubLLMResult
from rlmq.common.settings import setting_default
from rlmq.common.token_servers import sampled_with
from rlmq.common.token_wire import TurnEncoder, TurnTokens, served_unless_frozen, tokens_asked, validate_served
from rlmq.common.tool_registry import canonical_tool_path, cut_text
from rlmq.common.tool_wire import HostedTool, ToolCallRequest, request_id
from rlmq.workers.continuation import Continuation
from rlmq.workers.hosted_tools import ANSWER_GRACE, RolloutSlots, call_hosted
from rlmq.workers.model import ChatClient, ChatResponse
from rlmq.workers.subllm_segments import SegmentedTurns
from rlmq.workers.tools import ToolRegistry

__all__ = ["SubLLMContext", "run_sub_llm"]

log = logging.getLogger(__name__)


@dataclass
class SubLLMContext:
    """What the worker hands to every sub-call; one instance shared across all jobs.

    Attributes:
        client: the model client (one aiohttp session for the whole process).
        ledger: the budget ledger; may be ``None`` only if no request is ``budgeted``.
        tools: the worker's allow-listed sub-tools.
        worker_name: written into each result's ``worker`` field.
        tool_timeout: seconds one sub-tool call may run.
        frozen: this worker's server is not the policy being trained (``rlmq worker --frozen``):
            its turns are marked untrainable (``frozen_fleet``) and no token is asked for.
        redis: the client a hosted tool's call travels on (``None``: hosted tools are refused as
            tools not allowed on this worker).
        turn_token_max_ids: most token ids (prompt + completion) one turn's record carries off this
            worker (``turn_token_max_ids``); past it the turn is untrainable (``too_many_ids``).
        hosted_slots: hosted-tool calls in flight per rollout (one rollout's flood waits for its own).
        continuation: how this worker's server continues an answer past a budget segment
            (``sub_llm_continuation``; ``none``: its budgeted turns are granted whole caps).
    """

    client: ChatClient
    ledger: BudgetLedger | None
    tools: ToolRegistry
    worker_name: str
    tool_timeout: float = 30.0
    frozen: bool = False
    redis: Redis | None = None
    turn_token_max_ids: int | None = setting_default("turn_token_max_ids")
    hosted_slots: RolloutSlots = field(default_factory=RolloutSlots)
    continuation: Continuation = "continue_final_message"


FINAL_ANSWER_PROMPT = (
    "You have used all your tool-calling turns. Give your final answer now, from what you have; no more tool calls."
)
"""The user message of the forced final-answer turn (as the reference's, tools no longer offered)."""


def boxed_answer(text: str) -> str:
    """What a sub-LLM's answer gives back to ``llm_batch``: the content of its last ``\\boxed{...}``
    (braces balanced), else the whole text, as verifiers' RLMEnv 0.1.14 (``extract_boxed_answer``,
    not strict) did with every sub-LLM's final message. An unclosed ``\\boxed{`` keeps the text."""
    start = text.rfind("\\boxed{")
    if start == -1:
        return text
    depth, i = 1, start + len("\\boxed{")
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len("\\boxed{") : i]
        i += 1
    return text


class _Stop(Exception):
    """Ends a sub-call with an error result (internal)."""

    def __init__(self, kind: str, content: str, error: str | None = None) -> None:
        super().__init__(content)
        self.kind = kind
        self.content = content
        self.error = error or content


class _NoBudget:
    """The figures of an unbudgeted call's reservations: none."""

    grants = granted_tokens = released_tokens = waits = 0
    wait_seconds = 0.0

    def answer_over(self) -> None:
        pass


_UNBUDGETED = _NoBudget()


class _Run(SegmentedTurns):
    """The state of one sub-call (counters go into the result)."""

    def __init__(
        self,
        request: SubLLMRequest,
        ctx: SubLLMContext,
        job_id: str,
        attempt: int,
        settle_out: list[Settle] | None = None,
        gate: Awaitable[object] | None = None,
    ) -> None:
        self.request = request
        self.settle_out = settle_out
        self.gate = gate
        self.ctx = ctx
        self.job_id = job_id
        self.attempt = attempt
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.turns = 0
        self.tool_calls = 0
        self.segments = 0
        self.overrun_tokens = 0
        self.underreported_tokens = 0
        self.truncated = False
        self.final_turn: Literal["answered", "skipped"] | None = None
        self.budget: CallBudget | None = None
        """The call's reservations in its ledger (``None``: unbudgeted)."""
        self.messages: list[dict[str, Any]] = []
        self.encoder = TurnEncoder()
        self.turn_tokens: list[TurnTokens] = []
        self.hosted: dict[str, HostedTool] = {}
        """The job's hosted tools this worker sends to the rollout, by the name the model sees."""

    async def run(self) -> tuple[SubCallStatus, str]:
        request = self.request
        tools, offered = self._offered_tools()  # PayloadError before any model call
        await self._open_budget()
        if request.system_prompt:
            self.messages.append({"role": "system", "content": request.system_prompt})
        self.messages.append({"role": "user", "content": request.prompt})
        last_text: str | None = None
        last_turn = request.max_turns + (1 if request.final_answer_turn else 0)
        for turn in range(1, last_turn + 1):
            forced = turn > request.max_turns  # the final-answer turn, without tools
            offered_now = [] if forced else tools
            if time.time() >= request.deadline:
                raise _Stop("deadline", "[error] sub-LLM call missed its deadline")
            # a turn without tools is granted a segment and continued (workers/subllm_segments.py)
            segmented = self.ctx.continuation != "none" and not offered_now
            lt = await self.budget.turn(turn, segmented=segmented) if self.budget is not None else None
            if lt is not None and lt.grant is not None and not lt.grant.granted:
                return self._refused(lt.grant, turn, forced, last_text)
            if forced:
                self.final_turn = "answered"
                self.messages.append({"role": "user", "content": FINAL_ANSWER_PROMPT})
            response = await self._turn(turn, lt, offered_now, last_turn)
            self.truncated = response.finish_reason == "length"
            last_text = response.content or last_text
            assistant: dict[str, Any] = {"role": "assistant", "content": response.content}
            if response.tool_calls:
                assistant["tool_calls"] = response.tool_calls
            self.messages.append(assistant)
            if not response.tool_calls:
                return "ok", response.content or ""
            if turn == last_turn:
                if last_text:
                    return "ok", last_text
                return "ok", f"[sub-LLM used all {request.max_turns} turn(s) calling tools and gave no final answer]"
            await self._run_tools(response.tool_calls, offered, turn)
        raise AssertionError("unreachable: the loop returns on its last turn")  # pragma: no cover

    async def _open_budget(self) -> None:
        """The call's reservations (:attr:`budget`), unless its rollout is known to have no ledger.

        Whether the call is budgeted, and its limit, is the ledger's to say, not the job's: a job
        claiming ``budgeted: false`` is checked against Redis unless its rollout is known to have no
        ledger (the producer opens a ledger before it enqueues any job of its rollout)."""
        request, ledger = self.request, self.ctx.ledger
        if request.must_be_budgeted and ledger is None:
            raise _Stop("internal", "[error] sub-LLM call is budgeted but this worker has no budget ledger")
        if ledger is None or not (request.must_be_budgeted or not ledger.known_unbudgeted(request.charged_ledger)):
            return
        if request.charged_ledger != request.rollout_id:
            self._check_membership()
        margin = min(0.5, max(0.0, (request.deadline - request.enqueued_at) * 0.05))
        self.budget = CallBudget(
            ledger, request.charged_ledger, f"{self.job_id}:{self.attempt}", request.max_completion_tokens,
            request.deadline, margin, nodes=request.nodes, must_be_budgeted=request.must_be_budgeted,
            gate=self.gate, settle_out=self.settle_out,
        )  # fmt: skip
        if self.attempt > 1:  # the final-answer turn's reservations too
            await self.budget.retire_earlier_attempts(self.job_id, self.attempt, request.max_turns + 1)

    def _refused(self, grant: Grant, turn: int, forced: bool, last_text: str | None) -> tuple[SubCallStatus, str]:
        """How the call ends when the ledger refused turn ``turn``'s grant."""
        request = self.request
        if grant.tree_refused:  # its tree ended (or the caller's branch did): nobody waits for it
            return "rejected", f"[rejected] sub-LLM call refused: {grant.refusal_message}"
        spent = f"{grant.charged}/{grant.limit} completion tokens used"
        if grant.code == WAITED_OUT:
            waited = self.budget.wait_seconds if self.budget is not None else 0.0
            spent = f"waited {waited:.1f} s for tokens held by running calls until this call's deadline; {spent}"
        if forced:
            self.final_turn = "skipped"
            return "ok", last_text or (
                f"[sub-LLM used all {request.max_turns} turn(s) calling tools; its final-answer turn "
                f"was skipped: the sub-LLM token budget is spent ({spent})]"
            )
        if turn == 1:
            return "rejected", f"[rejected] sub-LLM token budget spent: {spent}"
        if last_text:
            return "ok", last_text
        return "rejected", f"[rejected] sub-LLM token budget ran out before a final answer: {spent}"

    async def _turn(
        self, turn: int, lt: LedgerTurn | None, tools: list[dict[str, Any]], last_turn: int
    ) -> ChatResponse:
        """Turn ``turn``'s model call under its grant (continued segment by segment), its token record
        and its settlement; returns the whole turn."""
        grant = lt.grant if lt is not None else None
        max_tokens = grant.tokens if grant is not None else self.request.max_completion_tokens
        response = last = await self._call(turn, lt, max_tokens, tools)
        if max_tokens is not None and response.completion_tokens > max_tokens:
            self.overrun_tokens += response.completion_tokens - max_tokens  # charged, and recorded
        if lt is not None and grant is not None and lt.answer:
            response, last, max_tokens = await self.continue_answer(turn, lt, response, tools)
        else:
            self.segments += 1
        if self.request.include_sub_llm_in_trajectory:
            self._record_tokens(turn, response, max_tokens, tools)
        if lt is not None and lt.grant is not None:
            used = last.completion_tokens if last.usage_reported else lt.grant.tokens
            used = max(used, last.completion_ids or 0)  # never below the ids it served
            # The call's last settlement rides with the worker's FINISH round trip (settle_out).
            await lt.settle_last(used, final=not response.tool_calls or turn == last_turn)
        return response

    def _check_membership(self) -> None:
        """A job naming a ledger other than its rollout's must be a call of a rollout of that ledger's
        tree: its ``nodes`` end with its own rollout id, and every reservation checks (atomically,
        in the ledger script) that this node is alive in that ledger. Else it would move the
        rollout's spending off its own budget (onto another tree's): such a job is an invalid
        payload (no reservation, no call). A rollout with a ledger of its own is no node of another
        tree (its node key is not in that ledger), so its forged jobs are refused too."""
        request = self.request
        if not request.nodes or request.nodes[-1] != request.rollout_id:
            raise _Stop(
                "payload",
                f"[error] invalid sub-LLM job: it names ledger {request.charged_ledger!r} but is no call of a "
                f"rollout of that tree (its node chain must end with its rollout {request.rollout_id!r})",
            )

    async def _call(
        self,
        turn: int,
        lt: LedgerTurn | None,
        max_tokens: int | None,
        tools: list[dict[str, Any]],
        *,
        messages: list[dict[str, Any]] | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> ChatResponse:
        """One model call of turn ``turn`` under ``lt``'s grant (``messages`` / ``sampling``: a
        continuation's, else the conversation's and the request's); a failed call settles its grant (see
        the module docstring)."""
        request = self.request
        self.turns = turn
        tokens = tokens_asked(request.include_sub_llm_in_trajectory, self.ctx.frozen)
        try:
            response = await self.ctx.client.chat(
                model=request.model,
                messages=self.messages if messages is None else messages,
                max_tokens=max_tokens,
                tools=tools or None,
                temperature=request.temperature,
                sampling=request.sampling if sampling is None else sampling,
                user=request.rollout_id,
                deadline=request.deadline,
                session_id=request.session_id,
                tokens=tokens,
            )
        except ModelError as exc:
            if lt is not None and lt.grant is not None:
                answered_error = exc.status is not None and exc.status >= 400
                await lt.settle(0 if answered_error else lt.grant.tokens)
            raise
        if messages is None:  # a continuation's prompt is the same turn's
            self.prompt_tokens += response.prompt_tokens
        self.completion_tokens += response.completion_tokens
        self.underreported_tokens += response.underreported
        return response

    def _record_tokens(
        self, turn: int, response: ChatResponse, max_tokens: int | None, tools: list[dict[str, Any]]
    ) -> None:
        """Keep turn ``turn``'s served tokens with the sampling the request sent (untrainable, with
        its reason, when the server gave none or they disagree, or when this fleet is frozen)."""
        request = self.request
        sampling: dict[str, Any] = {**request.sampling, "max_tokens": max_tokens}
        if request.temperature is not None:
            sampling["temperature"] = request.temperature
        if tools:
            sampling["tools"] = sorted(t["function"]["name"] for t in tools)
        served, reason = served_unless_frozen(self.ctx.frozen, lambda: (response.served, response.untrainable))
        served, reason = validate_served(served, reason, max_tokens=max_tokens, max_ids=self.ctx.turn_token_max_ids)
        drawn = sampled_with(sampling, self.ctx.client.token_api)  # the request's, else the server's default
        self.turn_tokens.append(self.encoder.encode(turn, served, reason, sampling, drawn))

    def _offered_tools(self) -> tuple[list[dict[str, Any]], set[str]]:
        """The tool schemas offered to the model and their names: the worker's own allow-listed
        tools (the fast path), then the job's hosted tools this worker does not allow-list.

        Raises:
            PayloadError: a tool is neither allowed here nor hosted by the rollout, or two share a name.
        """
        request, ctx = self.request, self.ctx
        if not request.sub_tools:
            return [], set()
        hosted = {canonical_tool_path(h.path): h for h in request.hosted_tools} if ctx.redis is not None else {}
        local = [t for t in request.sub_tools if canonical_tool_path(t) not in hosted or ctx.tools.is_allowed(t)]
        ctx.tools.check_allowed(local)
        tools = ctx.tools.schemas(local)
        self.hosted = {}
        for path in request.sub_tools:
            spec = hosted.get(canonical_tool_path(path))
            if spec is not None and path not in local:
                self.hosted[spec.name] = spec
                tools.append(spec.tool_schema)
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise PayloadError(f"two sub-tools share a name: {', '.join(sorted(names))}")
        return tools, set(names)

    async def _run_tools(self, tool_calls: list[dict[str, Any]], offered: set[str], turn: int) -> None:
        self.tool_calls += len(tool_calls)
        calls: list[tuple[str, str, str]] = []
        for i, call in enumerate(tool_calls):
            fn = call.get("function") if isinstance(call, dict) else None
            fn = fn if isinstance(fn, dict) else {}
            name = str(fn.get("name") or "")
            arguments = fn.get("arguments")
            if not isinstance(arguments, str):
                arguments = "" if arguments is None else json.dumps(arguments)
            call_id = call.get("id") if isinstance(call, dict) else None
            calls.append((str(call_id or f"call_{turn}_{i}"), name, arguments))
        outputs = await asyncio.gather(
            *(self._tool(name, arguments, offered, turn, i) for i, (_, name, arguments) in enumerate(calls))
        )
        for (call_id, _, _), output in zip(calls, outputs, strict=True):
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": output})

    async def _tool(self, name: str, arguments: str, offered: set[str], turn: int, index: int) -> str:
        if name not in offered:
            available = ", ".join(sorted(offered)) or "none"
            return f"[tool error] unknown tool {name!r} (available: {available})"
        spec = self.hosted.get(name)
        if spec is not None and self.ctx.redis is not None:
            wait = (self.request.hosted_tool_timeout or 0.0) + ANSWER_GRACE
            call = ToolCallRequest(
                id=request_id(self.job_id, turn, index, name, arguments), tool=spec.path, arguments=arguments, wait=wait
            )
            deadline = min(time.time() + wait, self.request.deadline)  # nobody reads a late result
            host, slots = self.request.tool_host, self.ctx.hosted_slots
            text = await call_hosted(self.ctx.redis, host, call, name=name, deadline=deadline, slots=slots)
            return cut_text(text, self.ctx.tools.max_output_chars)  # the rollout's answer, bounded here too
        return await self.ctx.tools.call(name, arguments, timeout=self.ctx.tool_timeout, owner=self.request.rollout_id)


async def run_sub_llm(
    request: SubLLMRequest,
    ctx: SubLLMContext,
    *,
    job_id: str,
    attempt: int = 1,
    started_at: float | None = None,
    settle_out: list[Settle] | None = None,
    gate: Awaitable[object] | None = None,
) -> SubLLMResult:
    """Run one sub-LLM call: budget reservations, model turns, sub-tools; return its result.

    Follows the verifiers ``RLMEnv`` sub-LLM tool loop (``sub_llm_max_turns`` =
    ``request.max_turns``) with rlmq's hard budget (see the module docstring): a reservation
    before every model call, ``max_tokens`` = the grant, no unbudgeted final call.

    Args:
        request: the validated job payload.
        ctx: the worker's shared client, ledger and tools.
        job_id: the RQ job id; reservation ids are ``f"{job_id}:{attempt}:{turn}"``.
        attempt: 1 for the first run of the job, 2 for its first retry, ...
        started_at: Unix time (seconds) the worker took the job; ``queue_wait_seconds`` is
            measured from ``request.enqueued_at`` to it (default: now).
        settle_out: when given, the final model call's settlement is not sent but appended
            here as a :class:`~rlmq.common.budget.calls.Settle` (with the note that its answer
            ended, for an answer granted in segments), for the caller to send with its own round
            trip (the worker's ``FINISH``); the grant stays charged in full, and the answer
            running, until then. ``None``: every settlement is sent at once.
        gate: awaited once, after the first budget reservation and before the first model
            call: a worker that starts a job before its ``START`` answered passes that
            answer here, so a job it turns out not to own never calls the model (its
            reservation is the owner's too: the id names the job and attempt, not the worker).

    Returns:
        The result: ``status`` ``ok`` (``content`` is the answer), ``rejected`` (the budget
        was spent; ``content`` says ``used/limit``) or ``error`` (``error_kind`` says which,
        ``content`` is the message the root model sees). Token figures are summed over
        turns; ``seconds`` is this call's wall time.

    Raises:
        asyncio.CancelledError: only when cancelled; any other failure is a result.
    """
    t0 = time.perf_counter()
    taken = started_at if started_at is not None else time.time()
    run = _Run(request, ctx, job_id, attempt, settle_out, gate)
    error: str | None = None
    error_kind: str | None = None
    status: SubCallStatus
    try:
        status, content = await run.run()
        content = boxed_answer(content)
    except (_Stop, BudgetStop) as stop:
        status, content, error, error_kind = "error", stop.content, stop.error, stop.kind
    except PayloadError as exc:
        status, content, error, error_kind = "error", f"[error] {exc}", str(exc), "payload"
    except ModelError as exc:
        if time.time() >= request.deadline:
            status, content, error_kind = "error", "[error] sub-LLM call missed its deadline", "deadline"
        else:
            status, content, error_kind = "error", f"[error] sub-LLM call failed: {exc}", "model"
        error = str(exc)
    except RedisError as exc:
        status, content, error, error_kind = "error", f"[error] sub-LLM call failed: Redis: {exc}", str(exc), "redis"
    except Exception as exc:
        log.exception("sub-LLM job %s failed unexpectedly", job_id)
        text = f"{type(exc).__name__}: {exc}"
        status, content, error, error_kind = "error", f"[error] sub-LLM call failed: {text}", text, "internal"
    budget = run.budget or _UNBUDGETED
    budget.answer_over()  # an answer that failed mid-way stops counting as running
    return SubLLMResult(
        rollout_id=request.rollout_id,
        batch_id=request.batch_id,
        index=request.index,
        job_id=job_id,
        status=status,
        content=content,
        error=error,
        error_kind=error_kind,
        prompt_tokens=run.prompt_tokens,
        completion_tokens=run.completion_tokens,
        turns=run.turns,
        tool_calls=run.tool_calls,
        grants=budget.grants,
        segments=run.segments,
        granted_tokens=budget.granted_tokens,
        released_tokens=budget.released_tokens,
        overrun_tokens=run.overrun_tokens,
        underreported_tokens=run.underreported_tokens,
        budget_waits=budget.waits,
        budget_wait_seconds=round(budget.wait_seconds, 4),
        truncated=run.truncated,
        final_turn=run.final_turn,
        queue_wait_seconds=max(0.0, taken - request.enqueued_at),
        seconds=time.perf_counter() - t0,
        worker=ctx.worker_name,
        attempt=attempt,
        messages=list(run.messages) if request.include_sub_llm_in_trajectory else None,
        turn_tokens=run.turn_tokens if request.include_sub_llm_in_trajectory and status == "ok" else None,
    )
