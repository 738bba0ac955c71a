"""A worker's pub/sub connection goes silent (half-open: no bytes either way, nothing closed).

A NAT or load balancer that forgets an idle flow leaves exactly that: the worker's release
connection stays "connected" while no release reaches it. On the old code the reader blocked on
it forever, so a parked call was never woken by a release: it waited for the earliest live
reservation's deadline, here the 40 s deadline (the test now uses 60 s) of the call that held the tokens and had given
160 of them back 3 s in: it was answered 36.5 s after the release instead of at once. The reader
now pings a link that has said nothing for a while and replaces one that does not answer (every
waiting call asks again).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from rlmq.cli.local import LocalFleet
from rlmq.common import keys as K
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.schemas import SubCallOptions
from rlmq.producer.dispatch import BatchSpec, Dispatcher
from tests.faults.conftest import await_until
from tests.faults.proxy import FaultProxy

pytestmark = pytest.mark.e2e

CALL_TIMEOUT = 60.0  # seconds: the held reservation's deadline, and the parked call's own
WOKEN_WITHIN = 30.0  # seconds after the release: the parked call must have its answer by then


@pytest.fixture
def proxy(redis_url: str, real_redis: redis.Redis) -> Iterator[FaultProxy]:
    with FaultProxy(redis_url) as p:
        yield p


async def test_a_silent_release_connection_does_not_strand_a_parked_call(
    proxy: FaultProxy, redis_url: str, tmp_path: Any
) -> None:
    fleet = LocalFleet(
        redis_url=proxy.url, model=f"sp-{uuid.uuid4().hex[:8]}", workers=1, worker_concurrency=8,
        log_dir=str(tmp_path / "logs"),
    )  # fmt: skip
    redis_direct = async_client(redis_url)
    with fleet:
        try:
            ledger = BudgetLedger(redis_direct, ttl=120)
            rid = f"silent-{uuid.uuid4().hex[:8]}"
            await ledger.open(rid, 200, cap=200)
            spec = BatchSpec(
                rollout_id=rid, batch_id="b1", queue=K.queue_name_for_model(fleet.model),
                sub_call_timeout=CALL_TIMEOUT, parallelism=2,
                call=SubCallOptions(model=fleet.model, budgeted=True), reply_ttl=120,
            )  # fmt: skip
            # The first call holds all 200 tokens for 3 s and uses 40; the second parks.
            prompts = ["Holder. [[mock:tokens:40]] [[mock:sleep:3]]", "Parked. [[mock:tokens:40]]"]
            batch = asyncio.create_task(Dispatcher(redis_direct).run_batch(spec, prompts))

            async def parked() -> bool:
                snap = await ledger.snapshot(rid)
                return snap is not None and snap.waits > 0

            await await_until(parked, 20, "the second call to park")
            proxy.silence_pubsub()  # from here the worker hears no release
            await await_until(lambda: _settled(ledger, rid), 20, "the holder to settle (its release goes unheard)")
            released_at = time.monotonic()
            results = await asyncio.wait_for(batch, CALL_TIMEOUT + 10)
            took = time.monotonic() - released_at
            snap = await ledger.snapshot(rid)
        finally:
            await redis_direct.aclose()
    assert [r.status for r in results] == ["ok", "ok"], results
    assert took < WOKEN_WITHIN, took  # old code: the holder's deadline (36.5 s after the release at 40 s)
    assert snap is not None and snap.used == 80 and snap.charged == 80, snap


async def _settled(ledger: BudgetLedger, rid: str) -> bool:
    snap = await ledger.snapshot(rid)
    return snap is not None and snap.used > 0
