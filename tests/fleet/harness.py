"""The main job of a fleet, counted from outside: a batch of rollouts with budgeted sub-calls.

:func:`main_job` opens one budget ledger per rollout, sends one ``llm_batch`` per rollout
through the producer's :class:`~rlmq.producer.dispatch.Dispatcher` (all rollouts at once),
and counts, from the scripted model's own ``/stats`` and the rollouts' reply streams:

* ``lost``: slots that ended in an error result (deadline, abandoned, no worker, ...);
* ``duplicated``: distinct results the producer read for one slot, beyond the first;
* ``wasted``: model completions served whose result never reached the producer;
* ``overshoot``: completion tokens the model served to a rollout beyond its budget (summed);
* ``usable``: the worst rollout's served tokens / min(budget, demand).
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rlmq.common import keys as K
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.schemas import SubCallOptions, SubLLMResult
from rlmq.producer import dispatch as dispatch_mod
from rlmq.producer.dispatch import BatchSpec, Dispatcher

FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


def skewed_env(seconds: float) -> dict[str, str]:
    """Environment of a process whose wall clock runs ``seconds`` ahead (libfaketime, real skew)."""
    if not os.path.exists(FAKETIME_LIB):
        raise AssertionError(f"{FAKETIME_LIB} missing: apt-get install faketime")
    return {"LD_PRELOAD": FAKETIME_LIB, "FAKETIME": f"{seconds:+g}s", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


def model_stats(base_url: str) -> dict[str, Any]:
    """The scripted model's counters (``GET /stats``)."""
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/stats", timeout=10) as resp:
        stats: dict[str, Any] = json.load(resp)
    return stats


@dataclass
class Outcome:
    """What :func:`main_job` counted (see the module docstring)."""

    slots: int = 0
    ok: int = 0
    rejected: int = 0
    lost: int = 0
    duplicated: int = 0
    wasted: int = 0
    overshoot: int = 0
    usable: float = 1.0
    errors: Counter[str] = field(default_factory=Counter)
    served: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "slots": self.slots, "ok": self.ok, "rejected": self.rejected, "lost": self.lost,
            "duplicated": self.duplicated, "wasted": self.wasted, "overshoot": self.overshoot,
            "usable": round(self.usable, 3), "errors": dict(self.errors),
        }  # fmt: skip


async def main_job(
    producer_url: str,
    base_url: str,
    model: str,
    *,
    rollouts: int = 3,
    calls: int = 16,
    budget: int = 4000,
    tokens: int = 250,
    sleep: float = 1.0,
    timeout: float = 60.0,
    tenant: str = "t",
    label: str = "job",
    ledger_ttl: int | None = None,
    cap: int | None = None,
    opened: Callable[[], Awaitable[None]] | None = None,
) -> Outcome:
    """Run the main job once and count it (see the module docstring).

    Args:
        producer_url: Redis URL of the producer (its ACL user, if any).
        base_url: the scripted model the workers call.
        model: the sub-model (its queue is derived from it).
        rollouts / calls: rollouts at once, sub-calls in each one's batch.
        budget: completion tokens per rollout (grant cap: an eighth of it).
        tokens / sleep: each call answers in ``tokens`` tokens after ``sleep`` seconds.
        timeout: seconds per sub-call.
        tenant: rollout ids are ``<tenant>_<label>...`` (a tenant producer's own).
        ledger_ttl: seconds the rollouts' ledgers live after their last write (default: the
            ledger's default, the rollout key TTL).
        cap: the ledgers' grant cap in tokens (default: an eighth of the budget, at least 128).
        opened: awaited once every rollout's ledger is open, before any sub-call is sent.
    """
    client = async_client(producer_url)
    ledger = BudgetLedger(client)
    queue = K.tenant_queue(K.queue_name_for_model(model), tenant)
    tag = uuid.uuid4().hex[:6]
    rids = [f"{tenant}_{label}{i}x{tag}" for i in range(rollouts)]
    before = model_stats(base_url)["per_user"]

    async def one(rid: str) -> list[SubLLMResult]:
        spec = BatchSpec(
            rollout_id=rid, batch_id="b1", queue=queue, sub_call_timeout=timeout, parallelism=calls,
            call=SubCallOptions(model=model, budgeted=True),
        )  # fmt: skip
        prompts = [f"Part {i} of {rid}. [[mock:tokens:{tokens}]] [[mock:sleep:{sleep:g}]]" for i in range(calls)]
        return await Dispatcher(client).run_batch(spec, prompts)

    seen: dict[tuple[str, int], set[bytes]] = {}
    real_load = dispatch_mod.load_result

    def counting(raw: str | bytes) -> SubLLMResult:
        res = real_load(raw)
        seen.setdefault((res.rollout_id, res.index), set()).add(raw if isinstance(raw, bytes) else raw.encode())
        return res

    dispatch_mod.load_result = counting  # type: ignore[assignment]
    try:
        for rid in rids:
            await ledger.open(rid, budget, cap=cap or max(128, budget // 8), ttl=ledger_ttl)
        if opened is not None:
            await opened()
        batches = await asyncio.gather(*(one(r) for r in rids))
        out = Outcome()
        stats = model_stats(base_url)["per_user"]
        demand = calls * tokens
        for rid, results in zip(rids, batches, strict=True):
            base = before.get(rid, {})
            served = int(stats.get(rid, {}).get("completion_tokens", 0)) - int(base.get("completion_tokens", 0))
            completions = int(stats.get(rid, {}).get("completions", 0)) - int(base.get("completions", 0))
            out.served[rid] = served
            out.slots += len(results)
            for r in results:
                if r.status == "ok":
                    out.ok += 1
                elif r.status == "rejected":
                    out.rejected += 1
                else:
                    out.lost += 1
                    out.errors[str(r.error_kind)] += 1
            out.wasted += max(0, completions - sum(1 for r in results if r.status == "ok"))
            out.overshoot += max(0, served - budget)
            out.usable = min(out.usable, served / min(budget, demand))
        out.duplicated = sum(len(v) - 1 for v in seen.values())
        return out
    finally:
        dispatch_mod.load_result = real_load  # type: ignore[assignment]
        await client.aclose()


def log_text(log_dir: str) -> str:
    """Every child log of a fleet, concatenated."""
    parts = []
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name), errors="replace") as f:
            parts.append(f"----- {name} -----\n" + f.read())
    return "\n".join(parts)


@dataclass
class TreeOutcome:
    """What :func:`tree_job` counted: one entry per top rollout."""

    stop_reasons: list[str] = field(default_factory=list)
    correct: int = 0
    errors: list[str] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    rlm_calls: int = 0
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "stop_reasons": self.stop_reasons, "correct": self.correct, "errors": self.errors[:3],
            "depths": self.depths, "rlm_calls": self.rlm_calls, "seconds": round(self.seconds, 1),
        }  # fmt: skip


async def tree_job(
    producer_url: str,
    base_url: str,
    model: str,
    *,
    max_depth: int = 2,
    rollouts: int = 2,
    parts: int = 2,
    lines: int = 40,
    tenant: str = "t",
    label: str = "tree",
    timeout: float = 60.0,
    **settings: Any,
) -> TreeOutcome:
    """The main job with recursion: ``rollouts`` top rollouts at once, each a scripted needle search
    (:mod:`bench.needle`) that splits its context into ``parts`` at every level down to ``max_depth``
    (child rollouts on the fleet's REPL hosts, plain sub-calls at the deepest level).

    Args:
        producer_url: Redis URL of the producer (its ACL user, if any); rollout ids are
            ``<tenant>_<label>...`` and its queue ``<queue>@<tenant>``.
        base_url / model: the scripted model (root and sub-model alike).
        timeout: each top rollout's ``rollout_timeout`` (seconds).
        settings: more :class:`~rlmq.common.settings.Settings` fields.
    """
    import time

    from bench.needle import needle_rows
    from rlmq.common.schemas import DatasetRow
    from rlmq.common.settings import load_settings
    from rlmq.producer.env import RLMEnv

    s = load_settings(
        redis_url=producer_url, base_url=base_url, model=model, tenant=tenant, max_depth=max_depth,
        rollout_timeout=timeout, **settings,
    )  # fmt: skip
    rows = [DatasetRow(**r) for r in needle_rows(rollouts, lines, parts=parts, seed=len(label))]
    tag = uuid.uuid4().hex[:6]
    started = time.monotonic()
    async with RLMEnv(settings=s) as env:
        results = await asyncio.gather(
            *(env.rollout(row, model=model, rollout_id=f"{tenant}_{label}{i}x{tag}") for i, row in enumerate(rows))
        )
    out = TreeOutcome(seconds=time.monotonic() - started)
    for res in results:
        r = res.row
        out.stop_reasons.append(r.stop_reason)
        out.correct += int(bool(r.correct))
        if r.error:
            out.errors.append(r.error)
        out.depths.append(int(r.metrics.get("tree_depth", 0)))
        out.rlm_calls += int(r.metrics.get("rlm_call_count", 0))
    return out
