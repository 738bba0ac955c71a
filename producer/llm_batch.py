"""The ``llm_batch`` service: one call of ``llm_batch(prompts)`` from a rollout's REPL.

The interception server hands each batch here (one batch of a rollout at a time). The
service refuses at once when the rollout's budget is spent (or its ledger is lost), else
dispatches the prompts as RQ jobs (:mod:`rlmq.producer.dispatch`); either way it records
the results in the rollout and returns their contents with the summary printed into the
REPL's output (the ``llm_batch`` summary contract of ``shared/DESIGN.md``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from redis.exceptions import RedisError

from rlmq.common.jobs.spill import unspill
from rlmq.common.metrics import Metrics
from rlmq.common.sampling import sub_call_max_tokens, sub_call_sampling
from rlmq.common.schemas import SubCallOptions, SubLLMResult
from rlmq.common.settings import setting_default
from rlmq.common.tool_registry import canonical_tool_path
from rlmq.producer.dispatch import BatchSpec, Dispatcher
from rlmq.producer.rollout import Rollout
from rlmq.producer.scaffold import sub_system_prompt

TRAJECTORY_PROMPTS = 64
"""A batch event in the trajectory keeps at most this many of its prompts."""


async def refused_results(
    rollout: Rollout, batch_id: str, n: int, refused: tuple[str, bool], metrics: Metrics | None
) -> list[SubLLMResult]:
    """``n`` ``rejected`` results of a batch refused up front (``refused``: its message, and
    whether the budget is spent, in which case the ledger counts the ``n`` rejections); counted
    in ``metrics`` here, as workers count only what they run."""
    message, spent = refused
    results = [
        SubLLMResult(rollout_id=rollout.id, batch_id=batch_id, index=i, job_id="", status="rejected", content=message)
        for i in range(n)
    ]
    if spent and rollout.ledger is not None:
        with contextlib.suppress(RedisError, OSError):
            await rollout.ledger.count_rejections(n)  # the ledger counts every refusal
    if metrics:
        for r in results:
            metrics.observe_result(r)
    return results


def redis_failures(rollout_id: str, batch_id: str, n: int, what: str, exc: BaseException) -> list[SubLLMResult]:
    """``n`` ``error`` results (``error_kind="redis"``) of a batch (``what``: "sub-LLM batch",
    "child rollout") that Redis, gone past the client's reconnect backoff, failed."""
    return [
        SubLLMResult.failure(
            rollout_id,
            batch_id,
            i,
            kind="redis",
            content=f"[error] {what} failed: Redis unavailable ({exc})",
            error=str(exc),
        )  # fmt: skip
        for i in range(n)
    ]


class LlmBatchService:
    """Runs the ``llm_batch`` calls of the rollouts of one host.

    Args:
        dispatcher: enqueues jobs and collects results.
        metrics: updated with each batch and with the calls refused here, if given.
        result_ttl: seconds RQ keeps a finished sub-call job (``rq info``, rq-dashboard).
    """

    def __init__(
        self, dispatcher: Dispatcher, metrics: Metrics | None = None, *, result_ttl: int = setting_default("result_ttl")
    ) -> None:
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.result_ttl = result_ttl

    def spec(self, rollout: Rollout, batch_id: str) -> BatchSpec:
        """What every sub-call of the rollout's batch ``batch_id`` shares."""
        o = rollout.options
        return BatchSpec(
            rollout_id=rollout.id,
            batch_id=batch_id,
            queue=rollout.queue,
            ledger_id=rollout.ledger_id,
            nodes=rollout.nodes,
            sub_call_timeout=o.sub_call_timeout,
            parallelism=o.max_sub_llm_parallelism,
            inflight=rollout.inflight,
            call=SubCallOptions(
                model=rollout.sub_model,
                system_prompt=sub_system_prompt(o.sub_prompt_verbosity),
                # shared tools go by their import path (pkg.mod:func and pkg.mod.func are one tool)
                sub_tools=list(dict.fromkeys(canonical_tool_path(t) for t in [*o.sub_tools, *o.tools])),
                hosted_tools=list(rollout.hosted_tools),
                hosted_tool_timeout=o.hosted_tool_timeout,
                final_answer_turn=o.sub_llm_final_answer_turn,
                max_turns=o.sub_llm_max_turns,
                max_completion_tokens=sub_call_max_tokens(o),  # sent with or without a budget
                budgeted=rollout.budget is not None,
                sampling=sub_call_sampling(o),
                include_sub_llm_in_trajectory=o.include_sub_llm_in_trajectory,
            ),
            result_ttl=self.result_ttl,
            reply_ttl=o.rollout_key_ttl,
        )

    @staticmethod
    async def refusal(rollout: Rollout) -> tuple[str, bool] | None:
        """Why the batch is refused up front, else ``None`` (see :meth:`RolloutBudget.refusal
        <rlmq.producer.budget.RolloutBudget.refusal>`); never for a rollout without a budget."""
        if rollout.ledger is None:
            return None
        return await rollout.ledger.refusal()

    async def run(self, rollout: Rollout, prompts: list[str]) -> tuple[list[str], str]:
        """Run one ``llm_batch(prompts)`` of ``rollout``; returns (contents in prompt order, summary).

        A Redis that is gone past the client's reconnect backoff while the batch is
        dispatched gives every prompt an ``error`` result (``error_kind="redis"``).

        Raises:
            RedisError: reading the budget ledger failed (budgeted rollouts only); the
                interception server answers ``llm_batch`` with HTTP 503 and the message.
        """
        batch_id, results, seconds = await self.execute(rollout, prompts)
        summary = await self.summary(rollout, results, seconds)
        rollout.trajectory.append(
            {
                "type": "llm_batch",
                "batch_id": batch_id,
                "seconds": round(seconds, 4),
                "prompts": prompts[:TRAJECTORY_PROMPTS],
                "results": [trajectory_result(rollout, r) for r in results],
            }
        )
        return [r.content for r in results], summary

    async def execute(self, rollout: Rollout, prompts: list[str]) -> tuple[str, list[SubLLMResult], float]:
        """Run ``prompts`` as one batch of sub-LLM calls of ``rollout`` and count them in its
        stats, without a trajectory event; returns (batch id, results in order, seconds).

        Raises:
            RedisError: as :meth:`run`.
        """
        t0 = time.perf_counter()
        batch_id = rollout.start_batch(len(prompts))
        refused = await self.refusal(rollout)
        if refused is not None:
            results = await refused_results(rollout, batch_id, len(prompts), refused, self.metrics)
        else:
            try:
                results = await self.dispatcher.run_batch(self.spec(rollout, batch_id), prompts)
                await unspill(self.dispatcher.redis, results)
            except (RedisError, OSError) as exc:  # Redis gone past the client's reconnect backoff
                results = redis_failures(rollout.id, batch_id, len(prompts), "sub-LLM batch", exc)
        rollout.admit_tokens(results)
        rollout.stats.sub.extend(results)
        seconds = time.perf_counter() - t0
        if self.metrics:
            self.metrics.observe_batch(len(prompts), seconds)
        return batch_id, results, seconds

    async def summary(self, rollout: Rollout, results: list[SubLLMResult], seconds: float) -> str:
        """The text ``llm_batch`` prints: a header, the budget line when set (tokens used, tokens
        left, a line each), one line per prompt; an answer cut short says so, and why (``CUT``)."""
        counts = {k: sum(1 for r in results if r.status == k) for k in ("ok", "rejected", "error")}
        cut = sum(1 for r in results if r.truncated)
        lines = [
            f"llm_batch: {len(results)} prompt(s) in {seconds:.2f} s: "
            + ", ".join(f"{v} {k}" for k, v in counts.items())
            + (f", {cut} cut short" if cut else "")
        ]
        if rollout.ledger is not None:
            # Right under the header, so a long batch's truncated output still shows it.
            snap = await rollout.ledger.snapshot()
            used, limit = (snap.charged if snap else 0), rollout.ledger.limit
            lines.append(f"[{used}/{limit} sub-LLM completion tokens used]")
            lines.append(f"[{max(0, limit - used)} sub-LLM completion tokens left]")
        cap = sub_call_max_tokens(rollout.options)
        for r in results:
            lines.append(
                f"  [{r.index}] {r.status:<8} {r.completion_tokens:>6} tokens  {r.turns} turn(s)  {r.seconds:6.2f} s"
                + (f"  {r.segments} segments" if r.segments > max(1, r.turns) else "")
                + (f"  {r.error_kind}" if r.status == "error" and r.error_kind else "")
                + (f"  {_cut_note(r, cap)}" if r.truncated else "")
                + ("  final-answer turn skipped (budget spent)" if r.final_turn == "skipped" else "")
            )
        return "\n".join(lines)


def trajectory_result(rollout: Rollout, result: SubLLMResult) -> dict[str, Any]:
    """``result`` as ``rollout``'s trajectory keeps it in its batch's event: without ``None``
    fields and the worker's ``spilled`` flag, and with the sub-LLM's conversation only under
    ``include_sub_llm_in_trajectory``."""
    kept = {"spilled"} if rollout.options.include_sub_llm_in_trajectory else {"messages", "spilled"}
    return result.model_dump(exclude_none=True, exclude=kept)


def _cut_note(result: SubLLMResult, cap: int) -> str:
    """Why an answer was cut: the budget's last remainder (a grant below the per-call cap) or its
    own ``max_tokens`` (``cap``, tokens)."""
    if 0 < result.granted_tokens < cap:
        return f"CUT: the budget's last {result.granted_tokens} tokens"
    return f"CUT: reached max_tokens {cap}"
