"""A child attempt killed during a root-model call leaves its root turn's reservation open and
live until the child's deadline (minutes): every call of the tree that found the rest of the
budget held would wait for it until its own deadline. The reaper that takes the dead attempt's
job back retires it at once (it stays charged in full), so those calls are answered now.
"""

from __future__ import annotations

import time

import pytest
from redis.asyncio import Redis

from rlmq.common import keys as K
from rlmq.common.budget.ledger import ROOT, WAIT, BudgetLedger
from rlmq.common.jobs.record import CHILD_ROLLOUT_FUNC, encode_job_data
from rlmq.common.schemas import ChildRolloutRequest
from rlmq.common.settings import load_settings
from rlmq.workers.child_kind import child_node
from rlmq.workers.worker import SubLLMWorker

pytestmark = pytest.mark.integration


async def test_the_reaper_retires_a_dead_child_attempts_root_turn_so_the_tree_stops_waiting(
    aredis: Redis, redis_url: str
) -> None:
    now = time.time()
    req = ChildRolloutRequest.model_validate({
        "rollout_id": "top", "batch_id": "b1", "index": 0, "child_id": "c9", "ledger_id": "top", "nodes": ["top"],
        "depth": 2, "max_depth": 2, "prompt": "p", "model": "m", "enqueued_at": now, "deadline": now + 900,
    })  # fmt: skip
    jid = "top-b1-0"
    await aredis.hset(K.rq_job(jid), "data", encode_job_data(CHILD_ROLLOUT_FUNC, [req.model_dump(mode="json")]))
    ledger = BudgetLedger(aredis)
    await ledger.open("top", 1000, 800, kind_caps={ROOT: 600})
    dead = child_node("c9", 1)
    await ledger.open_node("top", "top", 60)
    await ledger.open_node("top", dead, 60)
    # the dead attempt's root turn 2 was in its model call (turn 1 settled before)
    first = await ledger.reserve("top", f"{dead}:root:1", None, now + 900, kind=ROOT, nodes=("top", dead))
    await ledger.settle("top", f"{dead}:root:1", 100)
    held = await ledger.reserve("top", f"{dead}:root:2", None, now + 900, kind=ROOT, nodes=("top", dead))
    assert first.granted and held.granted and held.tokens == 600
    # a sub-call of the top finds 300 tokens free, less than half its 800 cap: it must wait
    waiting = await ledger.reserve("top", "top-b2-0:1:1", None, now + 120, nodes=())
    assert waiting.code == WAIT
    settings = load_settings(redis_url=redis_url, base_url="http://127.0.0.1:1/v1", model="m", repl_slots=1)
    worker = SubLLMWorker(settings, name="reaper-test")
    worker.redis, worker.ledger = aredis, ledger
    assert worker.children is not None
    assert await worker.children.end_dead_attempts([(jid, 1)]) == 1
    # the dead turn no longer counts as live: the call gets the last remainder now, not at +120 s
    after = await ledger.reserve("top", "top-b2-0:1:1", None, now + 120, nodes=())
    assert after.granted and after.tokens == 300, after
    snap = await ledger.snapshot("top")
    assert snap is not None and snap.charged == 1000  # the dead turn stays charged in full
    await ledger.aclose()
