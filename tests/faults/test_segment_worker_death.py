"""A worker killed with ``kill -9`` mid-segment of an answer it was continuing.

The answer was granted in segments (``docs/budget.md``): its first segment is settled, its second
is open (the model streaming it) when the worker dies. That segment stays charged in full (the
tokens may have been spent) and is never settled; the job's new attempt retires it (nobody waits
for it, and the dead answer stops counting as running) and runs the answer again under its own
reservations, each settled with what the server served for it. The server never serves the
rollout more than its budget.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from typing import Any

import pytest

from rlmq.cli.local import LocalFleet
from rlmq.common import keys as K
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.keys import queue_name_for_model
from rlmq.common.schemas import SubCallOptions
from rlmq.producer.dispatch import BatchSpec, Dispatcher
from tests.faults.conftest import await_until, model_stats, start_named_worker

pytestmark = pytest.mark.e2e
BUDGET = 3000
ANSWER = 800
TIMEOUT = 60.0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def test_a_segment_cut_by_a_dead_worker_is_settled_once_and_the_rerun_charges_what_it_serves(
    fault_fleet: LocalFleet,
) -> None:
    victim, _ = start_named_worker(fault_fleet, "segment-victim")
    redis = async_client(str(fault_fleet.redis_url))
    rid = f"segdead-{uuid.uuid4().hex[:8]}"
    try:
        ledger = BudgetLedger(redis)
        await ledger.open(rid, BUDGET, cap=2048)
        ledger.note_answer(rid, 200)  # answers start with a segment of 250 tokens

        async def noted() -> bool:
            return await redis.hget(K.LedgerKeys(rid).budget, "longest") is not None

        await await_until(noted, 10, "the longest answer noted")
        spec = BatchSpec(
            rollout_id=rid, batch_id="b1", queue=queue_name_for_model(fault_fleet.model),
            sub_call_timeout=TIMEOUT, parallelism=1, call=SubCallOptions(model=fault_fleet.model, budgeted=True),
        )  # fmt: skip
        batch = asyncio.create_task(
            Dispatcher(redis).run_batch(spec, [f"Summarize. [[mock:tokens:{ANSWER}]] [[mock:tps:100]]"])
        )
        resv_key, answers_key = K.RolloutKeys(rid).reservations, K.LedgerKeys(rid).answers

        seen: dict[str, str] = {}

        async def continuing() -> str | None:
            seen.clear()
            seen.update({_text(k): _text(v) for k, v in (await redis.hgetall(resv_key)).items()})
            return next((k for k, v in seen.items() if k.endswith(":s2") and not v.startswith("settled")), None)

        try:
            dead_segment = await await_until(continuing, 50, "the answer's second segment open")
        except BaseException:
            print("reservations:", seen, "batch done:", batch.done())
            raise
        await asyncio.sleep(0.5)  # the server is streaming it
        os.kill(victim.pid, signal.SIGKILL)
        start_named_worker(fault_fleet, "segment-survivor")
        results = await asyncio.wait_for(batch, TIMEOUT + 10)

        async def none_running() -> bool:  # the rerun's end note is sent without waiting: it may land later
            return await redis.hlen(answers_key) == 0

        await await_until(none_running, 10, "neither the dead answer nor the rerun's counting as running")
        snap = await ledger.snapshot(rid)
        states = {_text(k): _text(v) for k, v in (await redis.hgetall(resv_key)).items()}
        live = [_text(m) for m in await redis.zrange(K.LedgerKeys(rid).live_reservations, 0, -1)]
    finally:
        await redis.aclose()
    served = model_stats(str(fault_fleet.base_url))["per_user"].get(rid, {}).get("completion_tokens", 0)
    (result,) = results
    assert result.status == "ok" and not result.truncated and result.attempt == 2, result
    assert result.completion_tokens == ANSWER and result.segments >= 2
    first = dead_segment.removesuffix(":s2")
    job = first.removesuffix(":1:1")  # reservation ids: <job>:<attempt>:<turn>[:s<k>]
    # The dead attempt: its first segment settled with what was served, its second still open and
    # charged in full (never settled, never refunded), and no longer live: the rerun retired it.
    assert states[first] == "settled:250", states
    held = int(states[dead_segment].split(":")[1])
    assert states[dead_segment].startswith(("open:", "call:")) and dead_segment not in live, (states, live)
    # The rerun's reservations are all settled, with what the server served for them: its answer.
    rerun = {k: v for k, v in states.items() if k.startswith(f"{job}:2:")}
    assert rerun and all(v.startswith("settled:") for v in rerun.values()), rerun
    assert sum(int(v.split(":")[1]) for v in rerun.values()) == ANSWER
    assert snap is not None and snap.used == 250 + ANSWER and snap.held == held
    assert snap.charged == snap.used + held <= BUDGET and snap.overrun == 0
    # The server: what it served for the dead segment is within that segment's grant; all within budget.
    assert snap.used <= served <= snap.used + held <= BUDGET, (served, snap)
