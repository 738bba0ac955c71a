"""The ``rlm_batch`` service: one call of ``rlm_batch(tasks)`` from a rollout's REPL.

Below the tree's depth limit (``depth < max_depth``, :class:`~rlmq.common.tree.TreePosition`)
each task becomes a child rollout: one :class:`~rlmq.common.schemas.ChildRolloutRequest` job on
:func:`~rlmq.common.keys.child_queue` ``(queue, depth + 1)``, run by a REPL-hosting worker,
whose answer is a :class:`~rlmq.common.schemas.SubLLMResult` with ``child`` set. The jobs go
through the :class:`~rlmq.producer.dispatch.Dispatcher` (:class:`ChildJobs` is their
:class:`~rlmq.producer.dispatch.JobBuilder`): reply stream, per-slot deadlines (a child's is the
parent's remaining rollout time), parallelism, ``no_worker`` and gone handling as for
``llm_batch``. At the depth limit the tasks run as plain sub-LLM calls (the task's context
rendered into its prompt), as the RLM paper's code does at its ``max_depth``.

Either way the rollout's trajectory gets one event::

    {"type": "rlm_batch", "batch_id": str, "seconds": float,
     "tasks": [prompt, ...], "results": [SubLLMResult dump (with "child"), ...]}

from which :mod:`rlmq.producer.tree_metrics` derives the row's figures (``rlm_call_count``,
per depth and tree-wide).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from rlmq.common import keys as K
from rlmq.common.jobs.record import CHILD_ROLLOUT_FUNC
from rlmq.common.jobs.spill import unspill
from rlmq.common.jobs.store import NewJob
from rlmq.common.metrics import Metrics
from rlmq.common.sampling import child_root_sampling
from rlmq.common.schemas import ChildRolloutRequest, RlmTask, SubLLMResult
from rlmq.common.tool_wire import HostedTool
from rlmq.common.tree import TreePosition
from rlmq.producer.dispatch import BatchSpec, job_id_for
from rlmq.producer.llm_batch import (
    TRAJECTORY_PROMPTS,
    LlmBatchService,
    redis_failures,
    refused_results,
    trajectory_result,
)
from rlmq.producer.rollout import Rollout
from rlmq.producer.tree_metrics import number

RENDERED_CONTEXT_CHARS = 200_000
"""At the depth limit a task's context is rendered into its prompt, cut to this many characters."""

TREE_CLOSED = "[rejected] no child rollouts: this rollout's tree has ended (its top rollout, or a parent, is gone)"
"""The content of every task of an ``rlm_batch`` whose tree is no longer open."""

MIN_CHILD_SECONDS = 1.0
"""A child rollout gets at least this deadline (seconds), even when its parent's time is nearly up."""


@dataclass
class ChildJobs:
    """The child-rollout jobs of one ``rlm_batch`` (a :class:`~rlmq.producer.dispatch.JobBuilder`).

    Attributes:
        depth / max_depth: the children's depth (>= 2) and the tree's depth limit.
        ledger_id: the tree's budget ledger (the top rollout's).
        nodes: the tree chain from the top rollout to the parent, inclusive.
        model: the children's root model (the parent's sub-model).
        options: the children's :class:`~rlmq.common.settings.RolloutOptions` (JSON, no secrets).
        contexts: each task's REPL ``context`` (JSON), one per prompt.
        child_ids: each task's fresh child id (uuid4 hex), one per prompt.
        hosted_tools: the shared tools the tree's top rollout runs in its process, handed down.
    """

    depth: int
    max_depth: int
    ledger_id: str
    nodes: list[str]
    model: str
    options: dict[str, Any]
    contexts: list[Any] = field(default_factory=list)
    child_ids: list[str] = field(default_factory=list)
    hosted_tools: list[HostedTool] = field(default_factory=list)
    func: str = CHILD_ROLLOUT_FUNC
    what: str = "child rollout"

    @property
    def start_hint(self) -> str:
        """The command that starts a worker serving these children."""
        return f"rlmq worker --model {self.model} --repl-slots N"

    def jobs(self, spec: BatchSpec, prompts: list[str], indices: list[int], now: float) -> list[NewJob]:
        """The child-rollout jobs of slots ``indices``, enqueued at ``now`` (Unix seconds); each
        slot's deadline is ``spec.sub_call_timeout`` seconds later."""
        out: list[NewJob] = []
        parent = spec.rollout_id
        for i in indices:
            req = ChildRolloutRequest(
                rollout_id=parent,
                batch_id=spec.batch_id,
                index=i,
                child_id=self.child_ids[i],
                ledger_id=self.ledger_id,
                nodes=self.nodes,
                depth=self.depth,
                max_depth=self.max_depth,
                prompt=prompts[i],
                context=self.contexts[i],
                model=self.model,
                options=self.options,
                hosted_tools=self.hosted_tools,
                enqueued_at=now,
                deadline=now + spec.sub_call_timeout,
            )
            out.append(
                NewJob(
                    job_id=job_id_for(spec, i),
                    args_json=f"[{req.model_dump_json(exclude_defaults=True)}]",
                    description=f"child rollout depth={self.depth} parent={parent} index={i} model={self.model}",
                    meta={
                        "rollout_id": parent,
                        "batch_id": spec.batch_id,
                        "index": i,
                        "depth": self.depth,
                        "parent": parent,
                        "child_id": self.child_ids[i],
                    },  # fmt: skip
                )
            )
        return out


def render_task(task: RlmTask, limit: int = RENDERED_CONTEXT_CHARS) -> str:
    """The prompt of a task run as a plain sub-LLM call: its prompt, then its context (a str as
    is, else JSON) cut to ``limit`` characters; the prompt alone when it has no context."""
    if task.context is None or task.context == "":
        return task.prompt
    text = task.context if isinstance(task.context, str) else json.dumps(task.context, ensure_ascii=False)
    if len(text) > limit:
        text = text[:limit] + f"\n[... context cut at {limit:,} of {len(text):,} characters]"
    return f"{task.prompt}\n\nContext:\n{text}"


class RlmBatchService:
    """Runs the ``rlm_batch`` calls of the rollouts of one host.

    Args:
        batches: the host's ``llm_batch`` service (its dispatcher enqueues the child jobs; at the
            depth limit it runs the tasks as sub-LLM calls).
        metrics: updated with the calls refused here, if given.
    """

    def __init__(self, batches: LlmBatchService, metrics: Metrics | None = None) -> None:
        self.batches = batches
        self.metrics = metrics

    def spec(
        self, rollout: Rollout, tree: TreePosition, batch_id: str, tasks: list[RlmTask], seconds: float
    ) -> BatchSpec:
        """The batch of child rollouts of ``rollout`` at ``tree`` with ``seconds`` to live."""
        options = rollout.options.model_dump(mode="json")
        # A child's root turns sample as this rollout's sub-calls do (max_tokens: the per-call cap).
        sampling = child_root_sampling(rollout.options)
        options.update(rollout_timeout=seconds, max_depth=tree.max_depth, sampling_args=sampling)
        base = self.batches.spec(rollout, batch_id)
        base.queue = K.child_queue(rollout.queue, tree.depth + 1)
        base.sub_call_timeout = seconds
        base.ledger_id = tree.ledger_id
        base.kind = ChildJobs(
            depth=tree.depth + 1,
            max_depth=tree.max_depth,
            ledger_id=tree.ledger_id,
            nodes=[*tree.nodes, rollout.id],
            model=rollout.sub_model,
            options=options,
            contexts=[t.context for t in tasks],
            child_ids=[uuid.uuid4().hex for _ in tasks],
            hosted_tools=list(rollout.hosted_tools),
        )
        return base

    async def run(
        self, rollout: Rollout, tasks: list[RlmTask], tree: TreePosition, remaining: float
    ) -> tuple[list[str], str]:
        """Run one ``rlm_batch(tasks)`` of ``rollout``; returns (contents in task order, summary).

        Args:
            rollout: the calling rollout.
            tasks: its tasks (validated and bounded by the interception server).
            tree: the rollout's place in its tree (children below ``max_depth``, else sub-calls).
            remaining: seconds left of the rollout's own deadline (each child's deadline).

        Raises:
            RedisError: reading the budget ledger failed (budgeted rollouts only); the
                interception server answers with HTTP 503 and the message.
        """
        t0 = time.perf_counter()
        if not tree.can_recurse:
            batch_id, results, _ = await self.batches.execute(rollout, [render_task(t) for t in tasks])
        else:
            batch_id = rollout.start_rlm_batch()
            results = await self._children(rollout, tasks, tree, batch_id, max(MIN_CHILD_SECONDS, remaining))
        seconds = time.perf_counter() - t0
        rollout.trajectory.append(
            {
                "type": "rlm_batch",
                "batch_id": batch_id,
                "seconds": round(seconds, 4),
                "tasks": [t.prompt for t in tasks[:TRAJECTORY_PROMPTS]],
                "results": [rollout.kept_children.keep(trajectory_result(rollout, r)) for r in results],
            }
        )
        return [r.content for r in results], await self.summary(rollout, tree, results, seconds)

    async def _children(
        self, rollout: Rollout, tasks: list[RlmTask], tree: TreePosition, batch_id: str, seconds: float
    ) -> list[SubLLMResult]:
        """Run the tasks as child rollouts; every task gets a result (rejected, error or answer)."""
        refused = await LlmBatchService.refusal(rollout)
        if refused is None and not await self.tree_open(rollout, tree):
            refused = TREE_CLOSED, False
        if refused is not None:
            return await refused_results(rollout, batch_id, len(tasks), refused, self.metrics)
        spec = self.spec(rollout, tree, batch_id, tasks, seconds)
        try:
            results = await self.batches.dispatcher.run_batch(spec, [t.prompt for t in tasks])
            await unspill(self.batches.dispatcher.redis, results)
            return results
        except (RedisError, OSError) as exc:  # Redis gone past the client's reconnect backoff
            return redis_failures(rollout.id, batch_id, len(tasks), "child rollout", exc)

    async def tree_open(self, rollout: Rollout, tree: TreePosition) -> bool:
        """Whether every node of the chain, top .. ``rollout``, is alive (one ``EXISTS``): once
        the top rollout ended, or a parent's attempt died, children would only be refused at
        their first root turn, after their REPLs started. A Redis error counts as open (the
        dispatcher then deals with Redis)."""
        keys = K.LedgerKeys(tree.ledger_id)
        names = [keys.node(n) for n in dict.fromkeys([*tree.nodes, rollout.id])]
        try:
            alive = int(await self.batches.dispatcher.redis.exists(*names))
        except (RedisError, OSError):
            return True
        return alive == len(names)

    @staticmethod
    async def summary(rollout: Rollout, tree: TreePosition, results: list[SubLLMResult], seconds: float) -> str:
        """The text ``rlm_batch`` prints: a header, the budget line when set, one line per task."""
        counts = {k: sum(1 for r in results if r.status == k) for k in ("ok", "rejected", "error")}
        how = (
            f"as child rollouts at depth {tree.depth + 1} of {tree.max_depth}"
            if tree.can_recurse
            else f"as plain sub-LLM calls (depth {tree.depth} is the deepest, max_depth={tree.max_depth})"
        )
        lines = [
            f"rlm_batch: {len(results)} task(s) {how} in {seconds:.2f} s: "
            + ", ".join(f"{v} {k}" for k, v in counts.items())
        ]
        if rollout.ledger is not None:
            snap = await rollout.ledger.snapshot()
            lines.append(f"[{snap.charged if snap else 0}/{rollout.ledger.limit} sub-LLM completion tokens used]")
        for r in results:
            tokens, turns = r.completion_tokens, r.turns
            if r.child is not None:  # the child's whole subtree: what it charged, its own root turns
                tokens = number(r.child.metrics.get("tree_charged_completion_tokens", tokens))
                turns = number(r.child.metrics.get("main_rlm_turns", turns))
            line = f"  [{r.index}] {r.status:<8} {tokens:>6} tokens  {turns} turn(s)  {r.seconds:6.2f} s"
            if r.child is not None:
                calls = number(r.child.metrics.get("tree_sub_llm_call_count"))
                below = number(r.child.metrics.get("tree_rollout_count")) - 1
                line += f"  {calls} sub-call(s)"
                if below > 0:
                    line += f"  {below} child rollout(s)"
                line += f"  stop={r.child.stop_reason}"
            if r.status == "error" and r.error_kind:
                line += f"  {r.error_kind}"
            lines.append(line)
        return "\n".join(lines)
