"""The child-rollout job kind: one task of a parent's ``rlm_batch``, run as a whole RLM
rollout (its own REPL and root loop) on a REPL-hosting worker.

Payload :class:`~rlmq.common.schemas.ChildRolloutRequest`, enqueued on
:func:`~rlmq.common.keys.child_queue` ``(queue, depth)``; run by
:func:`rlmq.producer.engine.run_rollout` on the worker's :class:`~rlmq.workers.child_host.ChildHost`;
its result a :class:`~rlmq.common.schemas.SubLLMResult` with ``child`` set, added to the parent's
reply stream like a sub-call's. Attempt ``n`` of a child runs as rollout (and tree node)
``f"{child_id}-{n}"``: a re-run after its worker died never reuses the dead attempt's id. A job
holds a REPL slot of its depth (:func:`rlmq.workers.capacity.repl_pool`) while it runs.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError
from pydantic_core import PydanticSerializationError
from redis.exceptions import RedisError

from rlmq.common import keys as K
from rlmq.common.errors import ConfigError, PayloadError, validation_summary
from rlmq.common.jobs.record import CHILD_ROLLOUT_FUNC, decode_job_data
from rlmq.common.jobs.spill import spill_result
from rlmq.common.jobs.store import StartedJob, slot_of
from rlmq.common.schemas import ChildOutcome, ChildRolloutRequest, DatasetRow, SubLLMResult, load_child_request
from rlmq.common.settings import RolloutOptions
from rlmq.common.tree import TreePosition
from rlmq.producer.child_trajectory import CHILD_TRAJECTORY_MAX_CHARS, cut_trajectory, without_surrogates
from rlmq.producer.engine import run_rollout
from rlmq.producer.rollout import RolloutResult
from rlmq.workers.capacity import REPL, repl_pool
from rlmq.workers.kinds import JobKind, Outcome
from rlmq.workers.subllm_kind import sub_llm_outcome

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from rlmq.common.budget.ledger import BudgetLedger
    from rlmq.workers.child_host import ChildHost
    from rlmq.workers.inflight import InFlight

log = logging.getLogger("rlmq.worker")

CHILD_ABANDONED_CONTENT = "[error] child rollout lost: its worker died and the retries are used up"
"""What the parent's root model sees of a child-rollout job the reaper failed."""


def child_node(child_id: str, attempt: int) -> str:
    """The rollout (and tree node) id attempt ``attempt`` (from 1) of child ``child_id`` runs as."""
    return f"{child_id}-{attempt}"


def child_failure(
    slot: tuple[str, str, int], job_id: str, kind: str, message: str, *, worker: str = "", attempt: int = 1
) -> SubLLMResult:
    """The error result of a child-rollout job that produced no rollout result.

    Args:
        slot: ``(parent rollout id, batch id, index)``.
        job_id: the RQ job id.
        kind: ``error_kind``: ``payload`` (invalid job), ``deadline`` (the parent stopped waiting
            before it started), ``abandoned`` (its workers died, retries used up), ``host`` (the
            worker failed to run it), ``parent_gone`` (the parent is not a live node of the tree it names).
        message: the short cause (the result's ``error``).
    """
    if kind == "abandoned":
        content = CHILD_ABANDONED_CONTENT
    elif kind == "payload":
        content = f"[error] invalid child-rollout job: {message}"
    else:
        content = f"[error] child rollout failed ({kind}): {message}"
    rollout, batch, index = slot
    return SubLLMResult.failure(
        rollout, batch, index, job_id=job_id, kind=kind, content=content, error=message, worker=worker, attempt=attempt
    )


class ChildKindPort(Protocol):
    """What the child-rollout kind uses of its worker, and nothing else
    (:class:`rlmq.workers.worker.SubLLMWorker` is one), read per job: where a child runs
    (``child_host``), which queue its job came from (``jobs``) and the worker's own (``queue``,
    where its sub-calls go when that was no child queue), the tree it joins or ends (``ledger``,
    ``redis``), and the ``name`` its results and log lines carry."""

    name: str
    queue: str
    redis: Redis
    ledger: BudgetLedger
    jobs: InFlight
    child_host: ChildHost | None


class ChildKind:
    """The child-rollout kind on one worker.

    Args:
        worker: the worker that runs it (see :class:`ChildKindPort`).
    """

    def __init__(self, worker: ChildKindPort) -> None:
        self.w = worker

    def kind(self, *, max_attempts: int) -> JobKind:
        """Its registration: payload :class:`~rlmq.common.schemas.ChildRolloutRequest`, a REPL
        slot of the job's depth, ``max_attempts`` executions (a job whose worker died is re-run
        under a new node id, then given an error result), bounded by its request's deadline."""
        return JobKind(
            name="child_rollout",
            func=CHILD_ROLLOUT_FUNC,
            load=load_child_request,
            run=self.run,
            failure=self.failure,
            pool=REPL,
            max_attempts=max_attempts,
            abandoned=self.abandoned,
            check_pool=self.check_pool,
            dead_attempts=self.end_dead_attempts,
        )

    @staticmethod
    def check_pool(req: ChildRolloutRequest, pool: str, queue: str) -> None:
        """A child rollout takes a REPL slot of its own depth only.

        Raises:
            PayloadError: ``pool`` is another depth's.
        """
        if repl_pool(req.depth) != pool:
            raise PayloadError(f"a child rollout of depth {req.depth} on queue {queue}")

    async def run(self, req: ChildRolloutRequest, job: StartedJob) -> Outcome:
        """Run the child rollout of a started job; never raises but for cancellation."""
        started = time.time()
        slot = (req.rollout_id, req.batch_id, req.index)
        remaining = req.deadline - started
        if remaining <= 0:
            return self._fail(slot, job, "deadline", "the parent stopped waiting before the child started")
        try:
            options = child_options(req.options, remaining)
        except ValidationError as exc:
            return self._fail(slot, job, "payload", f"invalid options: {validation_summary(exc, 'options')}")
        refused = await self._check_parent(req)
        if refused is not None:
            return self._fail(slot, job, *refused)
        node = child_node(req.child_id, job.attempt)
        try:
            res = await self._run_hosted(req, job, options, node)
        except Exception as exc:  # Redis failed announcing it, or a bug: the parent gets an error slot
            log.warning("worker %s: child rollout %s failed to run: %s", self.w.name, node, exc)
            return self._fail(slot, job, "host", f"{type(exc).__name__}: {exc}")
        result = self._result(req, job, res, node, options, started)
        return await self._deliver(result, req.deadline, options.include_sub_llm_in_trajectory)

    def _sub_queue(self, job: StartedJob) -> str:
        """The queue the child's sub-calls go to: the model's (tenant) queue of the child queue
        ``job`` came from, else this worker's own."""
        parsed = K.parse_child_queue(self.w.jobs.queue_of(job.member))
        return parsed[0] if parsed is not None else self.w.queue

    async def _run_hosted(
        self, req: ChildRolloutRequest, job: StartedJob, options: RolloutOptions, node: str
    ) -> RolloutResult:
        """Run the child as rollout (and tree node) ``node`` on this worker's rollout host,
        counted there while it runs.

        Raises:
            ConfigError: this worker hosts no child rollout.
            Exception: whatever :func:`~rlmq.producer.engine.run_rollout` raised.
        """
        tree = TreePosition(
            req.ledger_id, depth=req.depth, max_depth=req.max_depth, nodes=tuple(req.nodes), parent_id=req.rollout_id
        )
        row = DatasetRow(id=req.child_id, question=req.prompt, context=req.context if req.context is not None else "")
        if self.w.child_host is None:
            raise ConfigError("this worker hosts no child rollout (--repl-slots 0)")
        host = self.w.child_host
        host.began()
        ended: tuple[str, str | None] = ("cancelled", None)  # cancelled unless it returns or fails
        try:
            res = await run_rollout(
                host.host, row, options, model=req.model, queue=self._sub_queue(job), rollout_id=node, tree=tree,
                hosted_tools=req.hosted_tools,
            )  # fmt: skip
            ended = (res.row.stop_reason, res.row.error)
            return res
        except Exception:
            ended = ("failed to run", None)  # logged by the caller
            raise
        finally:
            host.finished(node, *ended)

    def _result(
        self,
        req: ChildRolloutRequest,
        job: StartedJob,
        res: RolloutResult,
        node: str,
        options: RolloutOptions,
        started: float,
    ) -> SubLLMResult:
        """The parent's result of a child that ran (``started``: Unix seconds): its answer, or its
        error, and its outcome, its trajectory cut to :func:`trajectory_bound`."""
        r = res.row
        ok = r.stop_reason != "error"
        return SubLLMResult(
            rollout_id=req.rollout_id,
            batch_id=req.batch_id,
            index=req.index,
            job_id=job.job_id,
            status="ok" if ok else "error",
            content=(r.final_answer or "") if ok else f"[error] child rollout failed: {r.error}",
            error=None if ok else r.error,
            error_kind=None if ok else "child",
            turns=int(r.metrics.get("turns", 0) or 0),
            queue_wait_seconds=max(0.0, started - req.enqueued_at),
            seconds=time.time() - started,
            worker=self.w.name,
            attempt=job.attempt,
            child=ChildOutcome(
                rollout_id=node,
                depth=req.depth,
                stop_reason=r.stop_reason,
                metrics=r.metrics,
                trajectory=cut_trajectory(res.trajectory, trajectory_bound(options)),  # before Redis and the parent
            ),
        )

    async def _deliver(self, result: SubLLMResult, deadline: float, include_sub_llm_in_trajectory: bool) -> Outcome:
        """What the job delivers of ``result``; with ``include_sub_llm_in_trajectory`` (a large
        trajectory with tokens) it goes beside the reply stream until ``deadline`` (Unix seconds)."""

        async def spilled(r: SubLLMResult) -> SubLLMResult:
            return await spill_result(self.w.redis, r, deadline) if include_sub_llm_in_trajectory else r

        try:
            return sub_llm_outcome(await spilled(result), [])
        except PydanticSerializationError:  # a lone surrogate in the answer or the trajectory
            clean = SubLLMResult.model_validate(without_surrogates(result.model_dump()))
            return sub_llm_outcome(await spilled(clean), [])

    async def _check_parent(self, req: ChildRolloutRequest) -> tuple[str, str] | None:
        """``(error kind, message)`` when the job may not join the tree it names, else ``None``.

        The job id (hence ``req.rollout_id``, :func:`~rlmq.workers.kinds.check_slot`) is one its
        enqueuer may write; ``ledger_id`` and ``nodes`` are only what the payload says. The parent
        must be the chain's last node and alive in that ledger: a tenant's producer cannot create a
        node in another tenant's ledger, so it cannot make this worker (trusted with every key) open
        a node in, or reserve root turns from, another tenant's tree."""
        if req.nodes[-1] != req.rollout_id:
            return "payload", f"the chain ends with {req.nodes[-1]!r}, not the job's rollout {req.rollout_id!r}"
        try:
            alive = await self.w.ledger.node_alive(req.ledger_id, req.rollout_id)
        except (RedisError, OSError) as exc:
            return "host", f"{type(exc).__name__}: {exc}"
        if not alive:
            return "parent_gone", f"the parent {req.rollout_id} is not a live node of ledger {req.ledger_id}"
        return None

    def _fail(self, slot: tuple[str, str, int], job: StartedJob, kind: str, message: str) -> Outcome:
        result = child_failure(slot, job.job_id, kind, message, worker=self.w.name, attempt=job.attempt)
        return sub_llm_outcome(result, [])

    def failure(self, job_id: str, meta: bytes | None, kind: str, message: str, attempt: int) -> Outcome:
        """The kind's failure result (an invalid payload, a timeout)."""
        result = child_failure(slot_of(job_id, meta), job_id, kind, message, worker=self.w.name, attempt=attempt)
        return sub_llm_outcome(result, [])

    async def end_dead_attempts(self, taken: list[tuple[str, int]]) -> int:
        """End the tree nodes of child-rollout executions a reaper took back (``(job id, attempt)``,
        from :meth:`~rlmq.common.jobs.store.JobStore.reap`): the dead attempt's descendants are refused
        (``parent_gone``) at their next model call now, not when the node's TTL runs out,
        ``rlmq status`` stops listing the dead attempt now, not when its lease lapses, and its
        root turns' reservations stop counting as live (:meth:`retire_root_turns`). A job whose
        payload cannot be read is skipped (its node and lease expire). Returns the nodes ended.

        Raises:
            redis.RedisError: Redis away (the nodes then expire within their TTL).
        """
        if not taken:
            return 0
        async with self.w.redis.pipeline(transaction=False) as pipe:
            for jid, _ in taken:
                pipe.hget(K.rq_job(jid), "data")
            raws = await pipe.execute()
        ended = 0
        for (jid, attempt), raw in zip(taken, raws, strict=True):
            try:
                _, args, _ = decode_job_data(raw or b"")
                req = load_child_request(args[0] if args else None)
            except (ValueError, PayloadError):
                continue
            node = child_node(req.child_id, attempt)
            await self.w.ledger.close_node(req.ledger_id, node)
            await self.w.redis.zrem(K.LIVE_ROLLOUTS, node)
            await self.retire_root_turns(req.ledger_id, node)
            log.warning("worker %s: ended tree node %s of dead child rollout job %s", self.w.name, node, jid)
            ended += 1
        return ended

    async def retire_root_turns(self, ledger_id: str, node: str) -> int:
        """Retire the root-turn reservations (``<node>:root:<turn>``) of a dead child attempt: they
        stay charged in full, but stop counting as live now, so calls of the tree that wait for
        tokens held by running calls stop waiting for them (they were live until the child's
        deadline: a whole sub-call deadline of waiting). Returns how many were live.

        Raises:
            redis.RedisError: Redis away (they then stop being live at their deadline).
        """
        keys = K.LedgerKeys(ledger_id)
        ids = [k async for k, _ in self.w.redis.hscan_iter(keys.reservations, match=f"{node}:root:*")]
        return await self.w.ledger.retire(ledger_id, [i.decode() if isinstance(i, bytes) else i for i in ids])

    def abandoned(self, job_id: str, meta: bytes | None) -> str:
        """The result (JSON) the reaper delivers for a child job whose retries are used up."""
        return child_failure(
            slot_of(job_id, meta), job_id, "abandoned", "worker stopped heartbeating"
        ).model_dump_json()


def child_options(raw: dict[str, Any], remaining: float) -> RolloutOptions:
    """A child's rollout options from its payload's ``raw`` options, as a worker runs them: its
    rollout timeout at most ``remaining`` (seconds to its parent's deadline); no package
    installed (pip runs outside the REPL's sandbox, with the worker's rights: a job's payload
    never makes a worker install anything; the children import what the worker's environment
    has), nor its files kept on the worker's host (``retain_filesystem_after_rollout``: top
    rollouts only).

    Raises:
        ValidationError: ``raw`` is not valid rollout options.
    """
    options = RolloutOptions.model_validate(raw)
    return options.model_copy(
        update={
            "rollout_timeout": min(options.rollout_timeout, remaining),
            "pip_install_packages": [],
            "retain_filesystem_after_rollout": False,
        }
    )


def trajectory_bound(options: RolloutOptions) -> int:
    """Characters of JSON of a child's trajectory that leave its worker: the plain bound, plus, with
    ``include_sub_llm_in_trajectory``, twice its token cap (its turns' tokens, and its sub-LLMs'
    conversations, which are about as long), so a trainable child's turns are not cut first."""
    extra = 2 * options.trajectory_token_max_bytes if options.include_sub_llm_in_trajectory else 0
    return CHILD_TRAJECTORY_MAX_CHARS + extra
