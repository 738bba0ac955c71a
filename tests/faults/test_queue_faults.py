"""Nothing lost and nothing wedged on the queue path, each fault injected for real.

* a TCP proxy (:mod:`tests.faults.proxy`) between Redis and both sides (producer and worker
  processes) that drops the connection after Redis ran a command, before its reply returns;
* the same proxy answering ``-READONLY`` to every write for two seconds while jobs are in flight;
* a job whose reply key is not a stream (``WRONGTYPE`` inside the worker's finish script);
* a model server that lies about ``usage.completion_tokens`` (1e18, negative, a float, a string);
* a queue no worker serves.

Counted every time: results lost (a slot without its worker's result), results delivered
twice, budget overshoot (tokens the model server served past a rollout's limit): all 0.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
from aiohttp import web

import rlmq.producer.dispatch as dispatch_mod
from rlmq.cli.local import LocalFleet
from rlmq.cli.status import collect
from rlmq.common import keys as K
from rlmq.common.budget.ledger import LEDGER_LUA, BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.jobs.record import SUB_LLM_FUNC, encode_job_data, job_hash
from rlmq.common.schemas import SubCallOptions, SubLLMRequest, SubLLMResult
from rlmq.producer.dispatch import BatchSpec, Dispatcher, job_id_for
from tests.faults.conftest import HEARTBEAT_TTL, await_until, model_stats, wait_until
from tests.faults.proxy import FaultProxy
from tests.replies import reply_results

pytestmark = pytest.mark.e2e


class Delivered:
    """Counts every result the producer reads per slot (a re-read after a dropped reply
    included); what reaches the caller is checked separately (exactly one per slot)."""

    def __init__(self) -> None:
        self.reads: dict[tuple[str, str, int], int] = {}

    def __call__(self, raw: str | bytes) -> SubLLMResult:
        res = REAL_LOAD(raw)
        key = (res.rollout_id, res.batch_id, res.index)
        self.reads[key] = self.reads.get(key, 0) + 1
        return res


REAL_LOAD = dispatch_mod.load_result


@pytest.fixture
def proxy(redis_url: str, real_redis: redis.Redis) -> Iterator[FaultProxy]:
    with FaultProxy(redis_url, seed=13) as p:
        yield p


def proxied_fleet(proxy: FaultProxy, tmp_path: Any, workers: int = 2, latency: float = 0.0) -> LocalFleet:
    """A fleet whose workers reach Redis only through ``proxy``."""
    return LocalFleet(
        redis_url=proxy.url,
        model=f"qf-{uuid.uuid4().hex[:8]}",
        workers=workers,
        worker_concurrency=256,
        worker_args=["--heartbeat-ttl", str(HEARTBEAT_TTL)],
        mock_latency=latency,
        log_dir=str(tmp_path / "logs"),
    )


def spec_for(fleet: LocalFleet, rid: str, **kw: Any) -> BatchSpec:
    call: dict[str, Any] = {"model": fleet.model}
    call.update({k: kw.pop(k) for k in list(kw) if k in SubCallOptions.model_fields})
    base: dict[str, Any] = dict(rollout_id=rid, batch_id="b1", queue=K.queue_name_for_model(fleet.model),
                                sub_call_timeout=60, parallelism=50)  # fmt: skip
    base.update(kw)
    return BatchSpec(**base, call=SubCallOptions(**call))


async def run_rollouts(
    fleet: LocalFleet,
    producer_url: str,
    direct_url: str,
    n_rollouts: int,
    n_prompts: int,
    limit: int,
    parallelism: int = 50,
) -> tuple[list[list[SubLLMResult]], list[str]]:
    """``n_rollouts`` budgeted batches of ``n_prompts`` at once through ``producer_url``."""
    direct = async_client(direct_url)
    client = async_client(producer_url)
    rids = [f"qf{r}-{uuid.uuid4().hex[:6]}" for r in range(n_rollouts)]
    try:
        for rid in rids:
            await BudgetLedger(direct).open(rid, limit)
        d = Dispatcher(client)
        outs = await asyncio.gather(
            *(
                d.run_batch(
                    spec_for(fleet, rid, budgeted=True, max_completion_tokens=20, parallelism=parallelism),
                    [f"Question {rid}.{i}: what is item {i}?" for i in range(n_prompts)],
                )
                for rid in rids
            )
        )
    finally:
        await client.aclose()
        await direct.aclose()
    return list(outs), rids


async def overshoot(direct_url: str, fleet: LocalFleet, rids: list[str], limit: int) -> int:
    """Tokens the model server served past each rollout's limit, summed (and the ledger's view)."""
    stats = model_stats(str(fleet.base_url))
    client = async_client(direct_url)
    over = 0
    try:
        for rid in rids:
            served = stats["per_user"].get(rid, {}).get("completion_tokens", 0)
            snap = await BudgetLedger(client).snapshot(rid)
            assert snap is not None
            over += max(0, served - limit) + max(0, snap.used - limit)
    finally:
        await client.aclose()
    return over


def check_slots(outs: list[list[SubLLMResult]], n_prompts: int) -> tuple[int, int]:
    """``(lost, wrong)``: slots that ended in an error instead of their worker's result, and
    slots holding another slot's result."""
    lost = sum(1 for results in outs for r in results if r.status == "error")
    wrong = sum(1 for results in outs for i, r in enumerate(results) if r.index != i)
    assert all(len(results) == n_prompts for results in outs)
    return lost, wrong


async def test_dropped_connections_on_both_sides_lose_and_duplicate_nothing(
    proxy: FaultProxy, redis_url: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """6 rollouts x 50 prompts; the producer behind one proxy, 2 worker processes behind
    another, each dropping 3 % of commands after Redis ran them: every slot gets its result,
    each job runs once, no rollout's budget is overshot."""
    delivered = Delivered()
    monkeypatch.setattr(dispatch_mod, "load_result", delivered)
    limit = 6000
    with FaultProxy(redis_url, seed=31) as producer_proxy, proxied_fleet(proxy, tmp_path) as fleet:
        fleet.wait_for_workers(2, timeout=60)
        proxy.drop_rate = producer_proxy.drop_rate = 0.03
        outs, rids = await asyncio.wait_for(
            run_rollouts(fleet, producer_proxy.url, redis_url, 6, 50, limit, parallelism=10), 240
        )
        proxy.drop_rate = producer_proxy.drop_rate = 0.0
        lost, wrong = check_slots(outs, 50)
        stats = model_stats(str(fleet.base_url))
        executions = sum(stats["per_user"].get(rid, {}).get("completions", 0) for rid in rids)
        over = await overshoot(redis_url, fleet, rids, limit)
    print(f"workers' proxy: {proxy.stats}; producer's proxy: {producer_proxy.stats}; executions {executions}")
    assert (lost, wrong, over) == (0, 0, 0), [r.error for rs in outs for r in rs if r.status == "error"][:5]
    assert all(r.status == "ok" for rs in outs for r in rs)
    assert executions == 300  # no job ran twice (a re-sent START finds its own jobs)
    assert len(delivered.reads) == 300
    # the fault really happened, on both sides
    assert proxy.stats.dropped >= 3 and producer_proxy.stats.dropped >= 3, (proxy.stats, producer_proxy.stats)


async def test_reservations_refused_readonly_are_asked_again_not_failed(
    proxy: FaultProxy, redis_url: str, tmp_path: Any
) -> None:
    """Every ledger script the workers run is answered -READONLY for the first 2 s of a run (a
    failover just as calls reserve their grants): the calls ask again with backoff and are served,
    none ends as "budget could not be reserved", and the budget holds."""
    limit = 6000
    sha = hashlib.sha1(LEDGER_LUA.encode()).hexdigest().encode()
    with proxied_fleet(proxy, tmp_path) as fleet:
        fleet.wait_for_workers(2, timeout=60)
        proxy.refuse_writes(2.0, containing=(sha, LEDGER_LUA.encode()[:64]))
        outs, rids = await asyncio.wait_for(run_rollouts(fleet, redis_url, redis_url, 3, 20, limit), 120)
        assert proxy.stats.refused > 0
        lost, wrong = check_slots(outs, 20)
        over = await overshoot(redis_url, fleet, rids, limit)
    assert (lost, wrong, over) == (0, 0, 0), [r.error for rs in outs for r in rs if r.status == "error"][:5]


async def test_a_burst_of_readonly_replies_wedges_nothing(proxy: FaultProxy, redis_url: str, tmp_path: Any) -> None:
    """Every write answered -READONLY for 2 s while 4 rollouts' calls are in flight: every slot
    still gets its result (recorded once Redis takes writes again), and the next run is normal."""
    limit = 6000
    with proxied_fleet(proxy, tmp_path, latency=0.5) as fleet:
        fleet.wait_for_workers(2, timeout=60)
        run = asyncio.create_task(run_rollouts(fleet, proxy.url, redis_url, 4, 30, limit))
        sync = redis.Redis.from_url(redis_url)
        queue = K.queue_name_for_model(fleet.model)
        await await_until(lambda: asyncio.sleep(0, sync.zcard(K.rq_started(queue)) >= 20), 60, "calls in flight")
        proxy.refuse_writes(2.0)
        outs, rids = await asyncio.wait_for(run, 120)
        assert proxy.stats.refused > 0
        lost, wrong = check_slots(outs, 30)
        over = await overshoot(redis_url, fleet, rids, limit)
        assert (lost, wrong, over) == (0, 0, 0), [r.error for rs in outs for r in rs if r.status == "error"][:5]
        # Not wedged: the next run is served in full, and nothing stays started.
        outs2, _ = await asyncio.wait_for(run_rollouts(fleet, proxy.url, redis_url, 2, 10, limit), 60)
        assert all(r.status == "ok" for rs in outs2 for r in rs)
        wait_until(lambda: sync.zcard(K.rq_started(queue)) == 0, 30, "the started registry to empty")
        assert all(p.poll() is None for p in fleet.group.procs)  # every worker still alive
        sync.close()


async def test_a_reply_key_of_the_wrong_type_wedges_no_worker(
    real_redis: redis.Redis, redis_url: str, tmp_path: Any
) -> None:
    """A job whose reply key is a string (FINISH would hit WRONGTYPE) and one whose data is JSON
    nested 100,000 levels deep: the first is recorded as failed, the second gets a payload
    error result, the worker goes on recording the others, and the next batches are served."""
    fleet = LocalFleet(redis_url=redis_url, model=f"wt-{uuid.uuid4().hex[:6]}", workers=1,
                       worker_args=["--heartbeat-ttl", str(HEARTBEAT_TTL)], log_dir=str(tmp_path / "logs"))  # fmt: skip
    with fleet:
        fleet.wait_for_workers(1)
        queue = K.queue_name_for_model(fleet.model)
        bad_reply = "rlmq:{bad}:reply:b1"
        real_redis.set(bad_reply, "not a stream")
        now = time.time()
        jids = []
        for i in range(3):
            req = SubLLMRequest(rollout_id="bad", batch_id="b1", index=i, prompt=f"p{i}", model=fleet.model,
                                enqueued_at=now, deadline=now + 60)  # fmt: skip
            jid = K.job_id("bad", "b1", i)
            jids.append(jid)
            real_redis.hset(K.rq_job(jid), mapping=job_hash(  # type: ignore[arg-type]
                queue=queue, data=encode_job_data(SUB_LLM_FUNC, [req.model_dump()]), description="bad reply",
                timeout=60, result_ttl=60, failure_ttl=60, ttl=60, reply_key=bad_reply,
                meta={"rollout_id": "bad", "batch_id": "b1", "index": i}))  # fmt: skip
        # and a job whose data is JSON nested 100,000 levels deep (json.loads: RecursionError)
        deep = K.job_id("deep", "b1", 0)
        real_redis.hset(K.rq_job(deep), mapping=job_hash(  # type: ignore[arg-type]
            queue=queue, data=("[" * 100_000 + "]" * 100_000).encode(), description="deep", timeout=60,
            result_ttl=60, failure_ttl=60, ttl=60, reply_key=K.RolloutKeys("deep").reply("b1"),
            meta={"rollout_id": "deep", "batch_id": "b1", "index": 0}))  # fmt: skip
        jids.append(deep)
        client = async_client(redis_url)
        try:
            # the bad jobs and a good batch together, so that they share FINISH calls
            real_redis.rpush(K.rq_queue(queue), *jids)
            good = await Dispatcher(client).run_batch(
                spec_for(fleet, "good1", sub_call_timeout=30), [f"Q {i}" for i in range(20)]
            )
            assert all(r.status == "ok" for r in good)
            wait_until(lambda: real_redis.zcard(K.rq_failed(queue)) >= 4, 30, "the bad jobs to be failed")
            deep_result = reply_results(real_redis, K.RolloutKeys("deep").reply("b1"))
            assert [r.error_kind for r in deep_result] == ["payload"]
            assert real_redis.get(bad_reply) == b"not a stream"
            assert real_redis.zcard(K.rq_started(queue)) == 0
            later = await Dispatcher(client).run_batch(
                spec_for(fleet, "good2", batch_id="b2", sub_call_timeout=30), ["a", "b", "c"]
            )
            assert all(r.status == "ok" for r in later)
        finally:
            await client.aclose()
        assert all(p.poll() is None for p in fleet.group.procs)


async def test_keys_of_the_wrong_type_stop_neither_side(real_redis: redis.Redis, redis_url: str, tmp_path: Any) -> None:
    """A tenant queue key that is a string and a lane key that is a string (written by someone
    else with write access): the worker serves its other queues, the producer's small batches
    (the lane path) are still enqueued and answered."""
    fleet = LocalFleet(redis_url=redis_url, model=f"wk-{uuid.uuid4().hex[:6]}", workers=1,
                       worker_args=["--heartbeat-ttl", str(HEARTBEAT_TTL)], log_dir=str(tmp_path / "logs"))  # fmt: skip
    with fleet:
        fleet.wait_for_workers(1)
        queue = K.queue_name_for_model(fleet.model)
        evil = K.tenant_queue(queue, "evil")
        real_redis.set(K.rq_queue(evil), "not a list")
        real_redis.sadd(K.RQ_QUEUES, K.rq_queue(evil))
        real_redis.set(K.lane(queue), "not a list")
        client = async_client(redis_url)
        try:
            d = Dispatcher(client)
            for b in range(3):
                res = await asyncio.wait_for(
                    d.run_batch(spec_for(fleet, f"wk{b}", sub_call_timeout=30), [f"Q{b} {i}" for i in range(3)]), 60
                )
                assert [r.status for r in res] == ["ok"] * 3, [r.error for r in res]
            bad = await d.run_batch(spec_for(fleet, "wk9", queue=evil, sub_call_timeout=3), ["x"])
            assert bad[0].status == "error"  # its own queue is broken: ends at its deadline, no hang
        finally:
            await client.aclose()
        assert all(p.poll() is None for p in fleet.group.procs)


async def test_a_queue_no_worker_serves_is_reported_within_seconds(
    real_redis: redis.Redis, redis_url: str, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """No worker on the queue: the batch ends in seconds with error_kind=no_worker (not at its
    300 s deadline). A worker on the model queue serves its tenant queue, and `rlmq status`
    counts it there."""
    client = async_client(redis_url)
    model = f"nw-{uuid.uuid4().hex[:6]}"
    queue = K.tenant_queue(K.queue_name_for_model(model), "node7")
    spec = BatchSpec(
        rollout_id="nw1",
        batch_id="b1",
        queue=queue,
        sub_call_timeout=300,
        parallelism=8,
        call=SubCallOptions(model=model),
    )
    t0 = time.monotonic()
    try:
        results = await asyncio.wait_for(Dispatcher(client, no_worker_grace=2.0).run_batch(spec, ["a", "b", "c"]), 30)
    finally:
        await client.aclose()
    assert time.monotonic() - t0 < 10
    assert [r.error_kind for r in results] == ["no_worker"] * 3
    assert "no live worker serves queue" in results[0].content and queue in results[0].content
    assert "no live worker serves queue" in caplog.text
    # The given-up jobs were taken back: a worker that comes later does not run them for nothing.
    assert real_redis.llen(K.rq_queue(queue)) == 0
    assert not any(real_redis.exists(K.rq_job(job_id_for(spec, i))) for i in range(3))
    fleet = LocalFleet(redis_url=redis_url, model=model, workers=1, log_dir=str(tmp_path / "logs"))
    with fleet:
        fleet.wait_for_workers(1)
        client = async_client(redis_url)
        try:
            spec2 = BatchSpec(
                rollout_id="nw2",
                batch_id="b1",
                queue=queue,
                sub_call_timeout=30,
                parallelism=8,
                call=SubCallOptions(model=model),
            )
            served = await Dispatcher(client, no_worker_grace=2.0).run_batch(spec2, ["a", "b"])
        finally:
            await client.aclose()
        assert [r.status for r in served] == ["ok", "ok"]
        assert "nw1" not in model_stats(str(fleet.base_url))["per_user"]  # the withdrawn jobs never ran
        snap = collect(real_redis)
        row = next(q for q in snap["queues"] if q["name"] == queue)
        assert row["workers"] == 1, snap["queues"]


# ---------------------------------------------------------------------------- lying model


LIES: list[Any] = [10**18, -5, 3.5, "many", True, 10**30]


@pytest.fixture
async def lying_model() -> AsyncIterator[str]:
    """An OpenAI-compatible server that answers every call with a short text and a lie in
    ``usage.completion_tokens`` (cycling through :data:`LIES`)."""
    calls = {"n": 0}

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        lie = LIES[calls["n"] % len(LIES)]
        calls["n"] += 1
        return web.json_response({
            "id": "x", "object": "chat.completion", "model": body.get("model", "m"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "four words of answer"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": lie, "completion_tokens": lie, "total_tokens": lie},
        })  # fmt: skip

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()


async def test_a_lying_model_is_charged_at_the_grant(
    real_redis: redis.Redis, redis_url: str, lying_model: str, tmp_path: Any
) -> None:
    """usage.completion_tokens of 1e18, -5, 3.5, "many", true, 1e30: no crash, no negative or
    absurd figure anywhere, each call charged at most its grant, the budget never overshot."""
    model = f"liar-{uuid.uuid4().hex[:6]}"
    fleet = LocalFleet(redis_url=redis_url, model=model, base_url=lying_model, workers=1, log_dir=str(tmp_path / "l"))
    limit = 100
    with fleet:
        await asyncio.to_thread(fleet.wait_for_workers, 1)
        client = async_client(redis_url)
        try:
            await BudgetLedger(client).open("liar1", limit)
            call = SubCallOptions(model=model, budgeted=True, max_completion_tokens=30)
            spec = BatchSpec(
                rollout_id="liar1", batch_id="b1", queue=K.queue_name_for_model(model), sub_call_timeout=30,
                parallelism=4, call=call,
            )  # fmt: skip
            results = await Dispatcher(client).run_batch(spec, [f"q{i}" for i in range(12)])
            snap = await BudgetLedger(client).snapshot("liar1")
        finally:
            await client.aclose()
    assert snap is not None and 0 <= snap.used <= snap.charged <= limit
    assert all(r.status in ("ok", "rejected") for r in results), [r.error for r in results]
    assert all(0 <= r.completion_tokens <= 30 and 0 <= r.prompt_tokens < 10**9 for r in results)
    assert any(r.status == "rejected" for r in results)  # charged at the grant: the budget ran out
    json.dumps([r.model_dump() for r in results])  # every figure is a plain JSON number


async def test_one_rollouts_exception_never_ends_the_others() -> None:
    """`RLMEnv.evaluate` over 4 rows where one rollout raises: 4 rows back, one with stop_reason error."""
    from rlmq.common.schemas import DatasetRow, ResultRow
    from rlmq.producer.env import RLMEnv, RolloutResult

    class Fake:
        async def rollout(self, row: DatasetRow, *, model: str, rollout_index: int | None = None) -> RolloutResult:
            if row.id == "r2":
                raise ValueError("could not convert string to float: '1e+18x'")
            await asyncio.sleep(0)
            return RolloutResult(row=ResultRow(id=row.id, final_answer="x", answer=None, correct=None,
                                               stop_reason="answer_ready", metrics={}))  # fmt: skip

    rows = [DatasetRow(id=f"r{i}", question="q", context="c") for i in range(4)]
    out = await RLMEnv.evaluate(Fake(), rows, model="m", concurrency=2)  # type: ignore[arg-type]
    assert [r.row.id for r in out] == ["r0", "r1", "r2", "r3"]
    assert [r.row.stop_reason for r in out] == ["answer_ready", "answer_ready", "error", "answer_ready"]
    assert "ValueError" in (out[2].row.error or "")


async def test_deeply_nested_json_gets_a_400() -> None:
    """100,000 levels of nesting to /llm_batch: a 400 with a JSON error, and the server stays up."""
    import aiohttp

    from rlmq.producer.interception import InterceptionServer

    server = InterceptionServer()
    await server.start()

    async def handler(prompts: list[str]) -> tuple[list[str], str]:
        return [p.upper() for p in prompts], ""

    token = server.register(handler)
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as s:
            for body in ("[" * 100_000 + "]" * 100_000, '{"prompts": ' + "[" * 100_000 + "]" * 100_000 + "}",
                         '{"a":' * 50_000 + "1" + "}" * 50_000):  # fmt: skip
                async with s.post(server.url, data=body) as resp:
                    assert resp.status == 400, await resp.text()
                    assert "error" in await resp.json()
            async with s.post(server.url, json={"prompts": ["ok"]}) as resp:
                assert resp.status == 200 and (await resp.json())["results"] == ["OK"]
    finally:
        await server.stop()
