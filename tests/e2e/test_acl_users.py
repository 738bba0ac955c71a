"""A fleet run with the ACL users of :mod:`rlmq.common.acl` on a real Redis: producer and
worker do their whole job; a dashboard reads and cannot write; none reaches other keys or
administrative commands."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
import redis
from rq import Queue
from rq import Worker as RQWorker

from rlmq.cli.local import LocalFleet
from rlmq.cli.status import collect
from rlmq.common import keys as K
from rlmq.common.acl import ROLES, acl_rules
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.jobs.record import job_hash
from rlmq.common.schemas import LaneEntry, LaneJob, SubCallOptions, SubLLMRequest, SubLLMResult
from rlmq.producer.dispatch import BatchSpec, Dispatcher

pytestmark = pytest.mark.e2e


@pytest.fixture
def acl_urls(real_redis: redis.Redis, redis_url: str) -> Iterator[dict[str, str]]:
    """One user per role (random passwords) on the session's Redis; their URLs."""
    yield from _users(real_redis, redis_url)


def _users(real_redis: redis.Redis, redis_url: str) -> Iterator[dict[str, str]]:
    u = urlparse(redis_url)
    urls: dict[str, str] = {}
    names = []
    for role in ROLES:
        name, password = f"rlmq-{role}-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
        real_redis.execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}", *acl_rules(role))
        names.append(name)
        urls[role] = f"redis://{name}:{password}@{u.hostname}:{u.port}{u.path or '/0'}"
    try:
        yield urls
    finally:
        for name in names:
            real_redis.execute_command("ACL", "DELUSER", name)


async def test_a_fleet_runs_with_its_acl_users(acl_urls: dict[str, str], tmp_path: Any) -> None:
    model = f"acl-{uuid.uuid4().hex[:6]}"
    queue = K.queue_name_for_model(model)
    with LocalFleet(redis_url=acl_urls["worker"], model=model, workers=1, log_dir=str(tmp_path / "logs")) as fleet:
        fleet.wait_for_workers(1)
        client = async_client(acl_urls["producer"])
        try:
            await BudgetLedger(client).open("acl1", 500)
            call = SubCallOptions(model=model, budgeted=True, max_completion_tokens=40)
            spec = BatchSpec(
                rollout_id="acl1", batch_id="b1", queue=queue, sub_call_timeout=30, parallelism=10, call=call
            )
            results = await Dispatcher(client).run_batch(spec, [f"Question {i}: who?" for i in range(12)])
            snap = await BudgetLedger(client).snapshot("acl1")
        finally:
            await client.aclose()
        assert [r.status for r in results] == ["ok"] * 12, [r.error for r in results]
        assert snap is not None and 0 < snap.used <= 500

        dash = redis.Redis.from_url(acl_urls["dashboard"])
        try:
            status = collect(dash)  # rlmq status, read-only
            assert any(q["name"] == queue and q["workers"] == 1 for q in status["queues"]), status["queues"]
            assert Queue(queue, connection=dash).count == 0  # rq info / rq-dashboard reads
            assert len(RQWorker.all(connection=dash)) >= 1
            with pytest.raises(redis.exceptions.NoPermissionError):
                dash.hset(K.rq_job("acl1-b1-0"), "status", "queued")  # cannot forge a job
            with pytest.raises(redis.exceptions.NoPermissionError):
                dash.xadd(K.RolloutKeys("acl1").reply("b9"), {K.REPLY_FIELD: "{}"})  # nor a result
        finally:
            dash.close()

    for role in ("producer", "worker"):
        c = redis.Redis.from_url(acl_urls[role])
        try:
            with pytest.raises(redis.exceptions.NoPermissionError):
                c.set("someone-else:key", "x")  # other applications' keys
            with pytest.raises(redis.exceptions.NoPermissionError):
                c.flushall()
            with pytest.raises(redis.exceptions.NoPermissionError):
                c.config_get("*")
            with pytest.raises(redis.exceptions.NoPermissionError):
                c.keys("*")
        finally:
            c.close()
    producer = redis.Redis.from_url(acl_urls["producer"])
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            producer.zadd(K.rq_started(queue), {"forged:exec": 1})  # RQ's registries are the workers'
    finally:
        producer.close()


async def test_a_worker_whose_writes_are_refused_for_good_exits_non_zero(
    acl_urls: dict[str, str], real_redis: redis.Redis, tmp_path: Any
) -> None:
    """NOPERM is not a passing outage: a worker whose ACL stops letting it write does not stay
    alive doing nothing; its tasks fail, are restarted, and the process exits non-zero."""
    from tests.faults.conftest import wait_until

    model = f"acl-{uuid.uuid4().hex[:6]}"
    with LocalFleet(redis_url=acl_urls["worker"], model=model, workers=1, log_dir=str(tmp_path / "logs")) as fleet:
        fleet.wait_for_workers(1)
        user = urlparse(acl_urls["worker"]).username
        real_redis.execute_command("ACL", "SETUSER", user, "-@write", "-@scripting")
        proc = fleet.group.procs[-1]
        wait_until(lambda: proc.poll() is not None, 60, "the worker to exit")
        assert proc.returncode not in (0, None)


async def test_a_tenant_producer_cannot_reach_another_tenants_rollout(
    real_redis: redis.Redis, redis_url: str, tmp_path: Any
) -> None:
    """Two teams share a fleet, each with a tenant producer user. Team a can neither raise team
    b's budget nor write b's jobs; a job a may write (its own id) whose payload names b's rollout
    and whose hash names b's reply stream charges nothing of b's and answers on a's own stream."""
    u = urlparse(redis_url)
    names, urls = [], {}
    for key, role, tenant in (("a", "producer", "teama"), ("b", "producer", "teamb"), ("worker", "worker", None)):
        name, password = f"rlmq-{key}-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
        real_redis.execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}", *acl_rules(role, tenant))
        names.append(name)
        urls[key] = f"redis://{name}:{password}@{u.hostname}:{u.port}{u.path or '/0'}"
    model = f"acl-tenant-{uuid.uuid4().hex[:6]}"
    base = K.queue_name_for_model(model)
    a, b = async_client(urls["a"]), async_client(urls["b"])
    try:
        with LocalFleet(
            redis_url=urls["worker"], model=model, workers=1, worker_args=["--no-lane-early-calls"],
            log_dir=str(tmp_path / "logs"),
        ) as fleet:  # fmt: skip
            fleet.wait_for_workers(1)
            rid_b = "teamb_r1"
            await BudgetLedger(b).open(rid_b, 500)
            with pytest.raises(redis.exceptions.NoPermissionError):
                await a.hset(K.RolloutKeys(rid_b).budget, "limit", 10**9)  # raise b's budget
            with pytest.raises(redis.exceptions.NoPermissionError):
                await a.hset(K.rq_job(K.job_id(rid_b, "b1", 0)), "status", "queued")  # rewrite b's job
            with pytest.raises(redis.exceptions.NoPermissionError):
                await a.xrange(K.RolloutKeys(rid_b).reply("b1"))  # read b's results

            # a forged job of a's own id: payload names b's rollout, the hash b's reply stream
            jid = K.job_id("teama_r1", "b1", 0)
            req = SubLLMRequest(
                rollout_id=rid_b, batch_id="b1", index=0, prompt="Spend b's budget. [[mock:spend-all]]",
                enqueued_at=time.time(), deadline=time.time() + 30, model=model, budgeted=True,
            )  # fmt: skip
            fields = job_hash(
                queue=K.tenant_queue(base, "teama"), args=[req.model_dump(mode="json")], description="forged",
                timeout=30, result_ttl=60, failure_ttl=60, ttl=30, reply_key=K.RolloutKeys(rid_b).reply("b1"),
                meta={"rollout_id": rid_b, "batch_id": "b1", "index": 0},
            )  # fmt: skip
            await a.hset(K.rq_job(jid), mapping=fields)  # type: ignore[arg-type]
            await a.rpush(K.rq_queue(K.tenant_queue(base, "teama")), jid)
            await a.sadd(K.RQ_QUEUES, K.rq_queue(K.tenant_queue(base, "teama")))
            await a.publish(K.wake_channel(base), K.wake_message(K.tenant_queue(base, "teama"), [jid]))
            got = await a.xread({K.RolloutKeys("teama_r1").reply("b1"): "0-0"}, block=20_000)
            assert got, "the forged job's result did not come back on a's own stream"
            res = SubLLMResult.model_validate_json(got[0][1][0][1][K.REPLY_FIELD.encode()])
            assert res.status == "error" and res.error_kind == "payload" and "another slot" in str(res.error)
            snap = await BudgetLedger(b).snapshot(rid_b)
            assert snap is not None and (snap.charged, snap.grants) == (0, 0)
            assert await b.xlen(K.RolloutKeys(rid_b).reply("b1")) == 0

            # the lane is shared: a's entry carries its own job and a made-up one of b's rollout;
            # with early lane calls off, nothing of b's is reserved before START confirms a job
            own = SubLLMRequest(
                rollout_id="teama_r2", batch_id="b1", index=0, prompt="Who? Ada.", enqueued_at=time.time(),
                deadline=time.time() + 30, model=model,
            )  # fmt: skip
            own_id = K.job_id("teama_r2", "b1", 0)
            own_fields = job_hash(
                queue=K.tenant_queue(base, "teama"), args=[own.model_dump(mode="json")], description="own",
                timeout=30, result_ttl=60, failure_ttl=60, ttl=30, reply_key=K.RolloutKeys("teama_r2").reply("b1"),
                meta={"rollout_id": "teama_r2", "batch_id": "b1", "index": 0},
            )  # fmt: skip
            await a.hset(K.rq_job(own_id), mapping=own_fields)  # type: ignore[arg-type]
            await a.rpush(K.rq_queue(K.tenant_queue(base, "teama")), own_id)
            fake = req.model_copy(update={"batch_id": "b9"})
            entry = LaneEntry(
                queue=K.tenant_queue(base, "teama"), enqueued_at=time.time(),
                jobs=[LaneJob(job_id=own_id, request=own), LaneJob(job_id=K.job_id(rid_b, "b9", 0), request=fake)],
            )  # fmt: skip
            await a.rpush(K.lane(base), entry.model_dump_json())
            got = await a.xread({K.RolloutKeys("teama_r2").reply("b1"): "0-0"}, block=20_000)
            assert got, "a's own lane job was not answered"
            snap = await BudgetLedger(b).snapshot(rid_b)
            assert snap is not None and (snap.charged, snap.grants) == (0, 0), snap
    finally:
        await a.aclose()
        await b.aclose()
        for name in names:
            real_redis.execute_command("ACL", "DELUSER", name)
