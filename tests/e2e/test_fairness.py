"""Fairness across trainer nodes: one tenant's burst must not starve another's small batch.

Each producer enqueues on its own tenant queue (``<queue>@<tenant>``); a worker serves all
tenant queues of its model round-robin. The control case puts the small batch behind the
burst on the same queue, where it waits for most of the drain, so the test can fail.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest

from rlmq.cli.local import LocalFleet
from rlmq.common import keys as K
from rlmq.common.connection import async_client
from rlmq.common.schemas import SubCallOptions
from rlmq.producer.dispatch import BatchSpec, Dispatcher

pytestmark = pytest.mark.e2e
BURST = 1500


@pytest.fixture(scope="module")
def slow_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    """One worker, 32 sub-calls in flight, a model that takes 50 ms per call: ~640 calls/s."""
    logs = tmp_path_factory.mktemp("fair-logs")
    model = f"fair-{uuid.uuid4().hex[:6]}"
    with LocalFleet(
        redis_url=redis_url, model=model, workers=1, worker_concurrency=32, mock_latency=0.05, log_dir=str(logs)
    ) as fleet:
        yield fleet


async def burst_then_small(fleet: LocalFleet, small_tenant: str) -> tuple[float, float]:
    """Seconds the small batch of 8 took, and seconds the burst took, with the burst first."""
    base = K.queue_name_for_model(fleet.model)
    redis = async_client(str(fleet.redis_url))
    d = Dispatcher(redis)
    tag = uuid.uuid4().hex[:6]
    burst = BatchSpec(
        rollout_id=f"burst-{tag}", batch_id="b1", call=SubCallOptions(model=fleet.model),
        queue=K.tenant_queue(base, "trainer-a"), sub_call_timeout=60, parallelism=BURST,
    )  # fmt: skip
    small = BatchSpec(
        rollout_id=f"small-{tag}", batch_id="b1", call=SubCallOptions(model=fleet.model),
        queue=K.tenant_queue(base, small_tenant), sub_call_timeout=60, parallelism=8,
    )  # fmt: skip
    t0 = time.monotonic()
    burst_task = asyncio.create_task(d.run_batch(burst, [f"Burst prompt {i}." for i in range(BURST)]))
    # start the small batch once the burst is queued and draining
    deadline = time.monotonic() + 10
    while await redis.llen(K.rq_queue(burst.queue)) < BURST // 2:
        assert time.monotonic() < deadline, "the burst was never queued"
        await asyncio.sleep(0.005)  # polling another process's progress, bounded by the deadline
    t_small = time.monotonic()
    small_results = await d.run_batch(small, [f"Small prompt {i}." for i in range(8)])
    small_seconds = time.monotonic() - t_small
    burst_results = await burst_task
    burst_seconds = time.monotonic() - t0
    await redis.aclose()
    assert all(r.status == "ok" for r in small_results + burst_results)
    return small_seconds, burst_seconds


async def test_small_batch_wait_stays_bounded_while_a_burst_drains(slow_fleet: LocalFleet) -> None:
    small, burst = await burst_then_small(slow_fleet, small_tenant="trainer-b")
    print(f"own queue: small batch {small:.3f} s while the burst took {burst:.3f} s")
    # 8 calls of 50 ms on a worker that gives each tenant an equal share of its 32 slots
    assert small < 0.5, f"the small batch waited {small:.2f} s while the burst took {burst:.2f} s"
    assert small < burst / 4


async def test_control_same_queue_waits_behind_the_burst(slow_fleet: LocalFleet) -> None:
    small, burst = await burst_then_small(slow_fleet, small_tenant="trainer-a")
    print(f"same queue: small batch {small:.3f} s while the burst took {burst:.3f} s")
    assert small > burst / 4, "without a queue of its own, the small batch should wait behind the burst"
