"""The sub-LLM job kind: its registration, its run on a worker, what a sub-call delivers and what
it ends with when it fails unrun.

Registered by :class:`rlmq.workers.worker.SubLLMWorker` (:mod:`rlmq.workers.kinds`); the call
itself is :func:`rlmq.workers.subllm.run_sub_llm`.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Protocol

from rlmq.common.budget.calls import Settle
from rlmq.common.jobs.record import SUB_LLM_FUNC, rq_exc_string, rq_return_value
from rlmq.common.jobs.spill import spill_key_of, spill_result
from rlmq.common.jobs.store import ABANDONED_CONTENT, StartedJob, slot_of
from rlmq.common.schemas import SubLLMRequest, SubLLMResult, load_request
from rlmq.workers.capacity import MODEL_CALLS
from rlmq.workers.kinds import JobKind, Outcome
from rlmq.workers.subllm import SubLLMContext, run_sub_llm

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from rlmq.common.metrics import Metrics


class SubLLMKindPort(Protocol):
    """What the sub-LLM kind uses of its worker, and nothing else
    (:class:`rlmq.workers.worker.SubLLMWorker` is one), read per call: what a sub-call runs with
    (``ctx``: its client, ledger, tools), where a large token payload goes (``redis``), what it
    counts (``metrics``), the ``name`` its results carry, and where an early call's outcome goes
    (:meth:`finish_job`)."""

    name: str
    redis: Redis
    metrics: Metrics
    ctx: SubLLMContext

    def finish_job(self, job: StartedJob, outcome: Outcome) -> None: ...


class SubLLMKind:
    """The sub-LLM kind on one worker (its client, ledger and metrics).

    Args:
        worker: the worker that runs it (see :class:`SubLLMKindPort`).
    """

    def __init__(self, worker: SubLLMKindPort) -> None:
        self.w = worker

    def kind(self, *, max_attempts: int) -> JobKind:
        """Its registration: payload :class:`~rlmq.common.schemas.SubLLMRequest`, a model-call slot,
        ``max_attempts`` executions (``job_max_attempts``), no timeout of its own (its request's
        deadline bounds it)."""
        return JobKind(
            name="sub_llm",
            func=SUB_LLM_FUNC,
            load=load_request,
            run=self.run,
            failure=self.failure,
            pool=MODEL_CALLS,
            max_attempts=max_attempts,
            abandoned=self.abandoned,
        )

    async def run(self, request: SubLLMRequest, job: StartedJob) -> Outcome:
        """The kind's run: one sub-call of a started job."""
        return await self._call(request, job.job_id, job.attempt, None)

    async def call(
        self, request: SubLLMRequest, job_id: str, attempt: int, job: StartedJob | asyncio.Future[StartedJob]
    ) -> None:
        """Run one sub-call and hand it to the worker's flush; ``job`` is a future when the call
        started before ``START`` answered (a lane entry's early call)."""
        gate = job if isinstance(job, asyncio.Future) else None  # awaited only if the call is budgeted
        outcome = await self._call(request, job_id, attempt, gate)
        if isinstance(job, asyncio.Future):
            job = await job
        self.w.finish_job(job, outcome)

    async def _call(
        self, request: SubLLMRequest, job_id: str, attempt: int, gate: asyncio.Future[StartedJob] | None
    ) -> Outcome:
        # The call's last budget settlement leaves run_sub_llm through this list instead of
        # being sent at once: it rides in the same pipeline as this job's FINISH (see
        # JobStore.finish), which saves a round trip per sub-call and means that when the
        # producer sees the result, the ledger has already released what the call did not use.
        final_settlement: list[Settle] = []
        result = await run_sub_llm(
            request,
            self.w.ctx,
            job_id=job_id,
            attempt=attempt,
            started_at=time.time(),
            settle_out=final_settlement,
            gate=gate,
        )
        self.w.metrics.observe_result(result)
        if result.turn_tokens:  # a large token payload goes beside the reply stream
            await spill_result(self.w.redis, result, request.deadline)
        return sub_llm_outcome(result, final_settlement)

    def failure(self, job_id: str, meta: bytes | None, kind: str, message: str, attempt: int) -> Outcome:
        """The kind's failure result (an invalid payload, a timeout), counted in the metrics."""
        result = sub_llm_failure(slot_of(job_id, meta), job_id, kind, message, worker=self.w.name, attempt=attempt)
        self.w.metrics.observe_result(result)
        return sub_llm_outcome(result, [])

    def abandoned(self, job_id: str, meta: bytes | None) -> str:
        """The result (JSON) the reaper delivers for a job whose retries are used up."""
        result = sub_llm_failure(slot_of(job_id, meta), job_id, "abandoned", "worker stopped heartbeating")
        return result.model_dump_json()


def sub_llm_outcome(result: SubLLMResult, settles: list[Settle]) -> Outcome:
    """What a sub-call delivers: its result on the reply stream, a summary (or its error) for RQ,
    and its last budget settlement (:class:`~rlmq.common.budget.calls.Settle`), sent with ``FINISH``."""
    ok = result.status != "error"
    summary = {
        "status": result.status,
        "completion_tokens": result.completion_tokens,
        "turns": result.turns,
        "seconds": round(result.seconds, 3),
    }
    payload = (
        rq_return_value(summary) if ok else rq_exc_string(f"{result.error_kind}: {result.error or result.content}")
    )
    return Outcome(
        ok=ok, result_json=result.model_dump_json(), rq_payload=payload, settles=settles, spill_key=spill_key_of(result)
    )


def sub_llm_failure(
    slot: tuple[str, str, int], job_id: str, kind: str, message: str, *, worker: str = "", attempt: int = 1
) -> SubLLMResult:
    """The error result of a sub-LLM job that got no answer from a model.

    Args:
        slot: ``(rollout id, batch id, index)`` (see :func:`rlmq.common.jobs.store.slot_of`).
        job_id: the RQ job id.
        kind: ``error_kind``: ``payload`` (invalid job), ``abandoned`` (its worker died, retries
            used up), ``timeout`` (past its kind's timeout), or another.
        message: the short cause (the result's ``error``).
    """
    if kind == "payload":
        content = f"[error] invalid sub-LLM job: {message}"
    elif kind == "abandoned":
        content = ABANDONED_CONTENT
    else:
        content = f"[error] sub-LLM call failed ({kind}): {message}"
    rollout, batch, index = slot
    return SubLLMResult.failure(
        rollout, batch, index, job_id=job_id, kind=kind, content=content, error=message, worker=worker, attempt=attempt
    )
