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

from redis.exceptions import RedisError

from rlmq.common.ledger import BudgetLedger
from rlmq.common.metrics import Metrics
from rlmq.common.schemas import SubCallOptions, SubLLMResult
from rlmq.producer.dispatch import BatchSpec, Dispatcher
from rlmq.producer.rollout import Rollout
from rlmq.producer.scaffold import sub_system_prompt

TRAJECTORY_PROMPTS = 64
"""A batch event in the trajectory keeps at most this many of its prompts."""


class LlmBatchService:
    """Runs the ``llm_batch`` calls of every rollout of one environment.

    Args:
        ledger: the budget ledger (Redis) of the environment.
        dispatcher: enqueues jobs and collects results.
        metrics: updated with each batch and with the calls refused here, if given.
    """

    def __init__(self, ledger: BudgetLedger, dispatcher: Dispatcher, metrics: Metrics | None = None) -> None:
        self.ledger = ledger
        self.dispatcher = dispatcher
        self.metrics = metrics

    def spec(self, rollout: Rollout, batch_id: str) -> BatchSpec:
        """What every sub-call of the rollout's batch ``batch_id`` shares."""
        s = rollout.settings
        return BatchSpec(
            rollout_id=rollout.id,
            batch_id=batch_id,
            queue=rollout.queue,
            sub_call_timeout=s.sub_call_timeout,
            parallelism=s.max_sub_llm_parallelism,
            call=SubCallOptions(
                model=rollout.sub_model,
                system_prompt=sub_system_prompt(s.sub_prompt_verbosity),
                sub_tools=list(s.sub_tools),
                max_turns=s.sub_llm_max_turns,
                max_completion_tokens=s.sub_llm_per_call_max_tokens,
                budgeted=rollout.budget is not None,
                include_messages=s.include_sub_llm_in_trajectory,
            ),
            result_ttl=s.result_ttl,
            reply_ttl=s.rollout_key_ttl,
        )

    async def refusal(self, rollout: Rollout) -> tuple[str, bool] | None:
        """Why the batch is refused up front, else ``None``: ``(message, spent)``, ``spent`` being
        true for a spent budget (the ledger counts those refusals) and false for a lost ledger.

        Refused up front only when spent: nothing free and nothing held by open reservations
        (calls that find the rest reserved wait for a release on the worker instead).
        """
        budget = rollout.budget
        if budget is None:
            return None
        snap = await self.ledger.snapshot(rollout.id)
        if snap is None:
            # The ledger is gone (Redis restarted without persistence, or its TTL ran out).
            # Opening a fresh one would forget what was already spent, so refuse instead.
            return (
                "[rejected] sub-LLM token budget ledger lost (Redis restarted?); sub-LLM calls are "
                "refused so the budget cannot be overshot",
                False,
            )
        if snap.remaining <= 0 and snap.held <= 0:
            return f"[rejected] sub-LLM token budget spent: {snap.charged}/{budget} completion tokens used", True
        return None

    async def run(self, rollout: Rollout, prompts: list[str]) -> tuple[list[str], str]:
        """Run one ``llm_batch(prompts)`` of ``rollout``; returns (contents in prompt order, summary).

        A Redis that is gone past the client's reconnect backoff while the batch is
        dispatched gives every prompt an ``error`` result (``error_kind="redis"``).

        Raises:
            RedisError: reading the budget ledger failed (budgeted rollouts only); the
                interception server answers ``llm_batch`` with HTTP 503 and the message.
        """
        t0 = time.perf_counter()
        batch_id = rollout.start_batch(len(prompts))
        refused = await self.refusal(rollout)
        if refused is not None:
            message, spent = refused
            results = [
                SubLLMResult(
                    rollout_id=rollout.id, batch_id=batch_id, index=i, job_id="", status="rejected", content=message
                )
                for i in range(len(prompts))
            ]
            if spent:
                with contextlib.suppress(RedisError, OSError):
                    await self.ledger.count_rejections(rollout.id, len(results))  # the ledger counts every refusal
            if self.metrics:  # workers count what they run; calls refused here are counted here
                for r in results:
                    self.metrics.observe_result(r)
        else:
            try:
                results = await self.dispatcher.run_batch(self.spec(rollout, batch_id), prompts)
            except (RedisError, OSError) as exc:  # Redis gone past the client's reconnect backoff
                results = [
                    SubLLMResult.failure(
                        rollout.id,
                        batch_id,
                        i,
                        kind="redis",
                        content=f"[error] sub-LLM batch failed: Redis unavailable ({exc})",
                        error=str(exc),
                    )  # fmt: skip
                    for i in range(len(prompts))
                ]
        rollout.stats.sub.extend(results)
        seconds = time.perf_counter() - t0
        if self.metrics:
            self.metrics.observe_batch(len(prompts), seconds)
        summary = await self.summary(rollout, results, seconds)
        keep_messages = rollout.settings.include_sub_llm_in_trajectory
        rollout.trajectory.append(
            {
                "type": "llm_batch",
                "batch_id": batch_id,
                "seconds": round(seconds, 4),
                "prompts": prompts[:TRAJECTORY_PROMPTS],
                "results": [
                    r.model_dump(exclude_none=True, exclude=None if keep_messages else {"messages"}) for r in results
                ],
            }
        )
        return [r.content for r in results], summary

    async def summary(self, rollout: Rollout, results: list[SubLLMResult], seconds: float) -> str:
        """The text ``llm_batch`` prints: a header, the budget line when set, one line per prompt."""
        counts = {k: sum(1 for r in results if r.status == k) for k in ("ok", "rejected", "error")}
        lines = [
            f"llm_batch: {len(results)} prompt(s) in {seconds:.2f} s: "
            + ", ".join(f"{v} {k}" for k, v in counts.items())
        ]
        if rollout.budget is not None:
            # Right under the header, so a long batch's truncated output still shows it.
            snap = await self.ledger.snapshot(rollout.id)
            lines.append(f"[{snap.charged if snap else 0}/{rollout.budget} sub-LLM completion tokens used]")
        for r in results:
            lines.append(
                f"  [{r.index}] {r.status:<8} {r.completion_tokens:>6} tokens  {r.turns} turn(s)  {r.seconds:6.2f} s"
                + (f"  {r.error_kind}" if r.status == "error" and r.error_kind else "")
                + ("  truncated (cut at its token grant)" if r.truncated else "")
            )
        return "\n".join(lines)
