"""The main job of a fleet (a batch of rollouts with budgeted sub-calls, see ``harness.py``)
under the conditions of a real shared fleet: ACL users with budget waits, a worker whose clock
runs 15 s ahead, an evicting Redis, a long run whose registries and memory must stay flat.
Each counts lost, duplicated, overshoot and usable share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
import redis

from rlmq.cli.local import LocalFleet, ProcessGroup, start_mock_llm
from rlmq.cli.status import collect
from rlmq.common import keys as K
from rlmq.common.errors import ConfigError
from rlmq.common.redis_server import EmbeddedRedis
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv
from tests.fleet.harness import log_text, main_job, skewed_env

pytestmark = pytest.mark.e2e


async def test_acl_users_with_budget_waits_use_the_budget_as_without_acl(
    acl_urls: dict[str, str], tmp_path: Any
) -> None:
    """Budget 8,000, 24 calls of 500 tokens after 1.5 s each: calls wait for released tokens,
    which the settle script publishes on the rollout's released channel (the worker user's)."""
    model = f"fleet-acl-{uuid.uuid4().hex[:6]}"
    logs = str(tmp_path / "logs")
    with LocalFleet(redis_url=acl_urls["worker"], model=model, workers=2, worker_concurrency=64, log_dir=logs) as f:
        out = await main_job(
            acl_urls["producer"], str(f.base_url), model, rollouts=3, calls=24, budget=8000, tokens=500, sleep=1.5,
        )  # fmt: skip
        dash = redis.Redis.from_url(acl_urls["dashboard"])
        try:
            snap = collect(dash)  # rlmq status as the dashboard user
            assert any(q["name"] == K.queue_name_for_model(model) and q["workers"] == 2 for q in snap["queues"])
            cli = subprocess.run(  # the command itself, as the read-only dashboard user
                [sys.executable, "-m", "rlmq", "status", "--redis-url", acl_urls["dashboard"]],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert cli.returncode == 0 and "WORKERS (2 live" in cli.stdout, (cli.stdout, cli.stderr)
            rq_info = subprocess.run(  # RQ's maintenance first, then the counts: the worker user's
                [os.path.join(os.path.dirname(sys.executable), "rq"), "info", "--url", acl_urls["worker"]],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert rq_info.returncode == 0, rq_info.stderr[:3000]
        finally:
            dash.close()
    text = log_text(logs)
    assert (out.lost, out.duplicated, out.overshoot) == (0, 0, 0), out.summary()
    assert out.usable >= 0.95, out.summary()
    assert "stays charged" not in text and "NOPERM" not in text, text[-3000:]


async def test_a_worker_whose_clock_runs_15_s_ahead_takes_back_no_live_job(redis_url: str, tmp_path: Any) -> None:
    """Three workers (heartbeat TTL 4 s), one of them with its wall clock 15 s ahead (libfaketime):
    its reaper must not see the others' leases as lapsed."""
    model = f"fleet-skew-{uuid.uuid4().hex[:6]}"
    logs = str(tmp_path / "logs")
    with LocalFleet(
        redis_url=redis_url, model=model, workers=2, worker_concurrency=64,
        worker_args=["--heartbeat-ttl", "4"], log_dir=logs,
    ) as f:  # fmt: skip
        f.worker_env = skewed_env(15)
        f.start_worker("skewed")
        f.worker_env = {}
        f.wait_for_workers(3)
        out = await main_job(redis_url, str(f.base_url), model, rollouts=3, calls=40, budget=6000, tokens=200, sleep=2)
    text = log_text(logs)
    assert "clock is +15" in text  # the skewed worker was really skewed, and said so
    assert (out.lost, out.duplicated, out.wasted, out.overshoot) == (0, 0, 0, 0), out.summary()
    assert "took back" not in text, text[-3000:]
    assert out.usable >= 0.95, out.summary()


async def test_an_evicting_redis_is_refused_by_worker_and_producer(
    evicting_redis: tuple[str, redis.Redis], tmp_path: Any
) -> None:
    url, admin = evicting_redis
    proc = subprocess.run(
        [sys.executable, "-m", "rlmq", "worker", "--model", "m", "--base-url", "http://127.0.0.1:9/v1",
         "--redis-url", url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "maxmemory-policy allkeys-lru" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert admin.scard(K.RQ_WORKERS) == 0  # it never registered
    settings = load_settings(redis_url=url, base_url="http://127.0.0.1:9/v1", model="m")
    with pytest.raises(ConfigError, match="noeviction"):
        async with RLMEnv(settings=settings):
            pass
    ok = load_settings(redis_url=url, base_url="http://127.0.0.1:9/v1", model="m", allow_evicting_redis=True)
    async with RLMEnv(settings=ok):
        pass  # the documented override
    # rlmq run: refused in one line (exit 2); with --allow-evicting-redis it runs, saying so
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "question": "What is 2+2?", "context": "c"}) + "\n")
    group = ProcessGroup(None)
    try:
        root = start_mock_llm(group)
        for extra in ([], ["--allow-evicting-redis"]):
            run = subprocess.run(
                [sys.executable, "-m", "rlmq", "run", str(rows), "--base-url", root, "--model", "m",
                 "--redis-url", url, "--run-dir", str(tmp_path / f"run{len(extra)}"), "--no-preflight",
                 "--sub-call-timeout", "3", *extra],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert "maxmemory-policy allkeys-lru" in run.stderr and "Traceback" not in run.stderr, run.stderr
            if extra:
                assert "(accepted: --allow-evicting-redis)" in run.stderr and "100%" in run.stderr, run.stderr
            else:
                assert run.returncode == 2 and "0/1" in run.stderr and "1/1" not in run.stderr, run.stderr
    finally:
        group.stop()


def redis_now(client: redis.Redis) -> float:
    """Redis's clock (``TIME``), in seconds."""
    sec, usec = client.time()
    return float(sec + usec / 1e6)


async def test_a_long_run_keeps_registries_to_live_members_and_memory_flat(
    private_redis: EmbeddedRedis, tmp_path: Any
) -> None:
    """Rounds of the main job with a 1-second result TTL and 1-second ledgers: the finished
    registries of every tenant queue hold only jobs that still exist, and Redis's live keys and
    memory, counted once each round's TTLs have passed, do not grow from round to round (on a
    Redis of its own: it reads the whole server's memory)."""
    redis_url = private_redis.url
    model = f"fleet-long-{uuid.uuid4().hex[:6]}"
    logs = str(tmp_path / "logs")
    admin = redis.Redis.from_url(redis_url)
    memory: list[int] = []
    keys: list[int] = []
    with LocalFleet(
        redis_url=redis_url, model=model, workers=2, worker_concurrency=128,
        worker_args=["--heartbeat-ttl", "2"], worker_env={"RLMQ_RESULT_TTL": "1"}, log_dir=logs,
    ) as f:  # fmt: skip
        for round_ in range(8):
            for tenant in ("a", "b"):
                out = await main_job(
                    redis_url, str(f.base_url), model, rollouts=4, calls=30, budget=100_000, tokens=20, sleep=0,
                    tenant=tenant, label=f"r{round_}", ledger_ttl=1,
                )  # fmt: skip
                assert (out.lost, out.duplicated, out.overshoot) == (0, 0, 0), out.summary()
            round_end = redis_now(admin)
            while redis_now(admin) < round_end + 1.5:
                time.sleep(0.05)  # the round's results and ledgers (TTL 1 s) expire, by Redis's clock
            keys.append(sum(1 for _ in admin.scan_iter(count=1000)))  # SCAN skips (and frees) expired keys
            memory.append(int(admin.info("memory")["used_memory"]))
        deadline = time.monotonic() + 20
        while True:  # the prune runs on the workers' reaper tick (every 0.5-1.5 s at TTL 2)
            regs = [K.rq_finished(q) for t in "ab" for q in [K.tenant_queue(K.queue_name_for_model(model), t)]]
            members = [m for r in regs for m in admin.zrange(r, 0, -1)]
            gone = [m for m in members if not admin.exists(K.rq_job(m.decode()))]
            if not gone and len(members) < 240:
                break
            assert time.monotonic() < deadline, (len(members), len(gone))
            time.sleep(0.2)  # polling another process's timer, bounded by the deadline
    admin.close()
    # flat after the first rounds: what one round leaves expires within the next ones
    assert max(keys[3:]) <= keys[2] + 10, keys  # a round leaves 8 ledgers: a leak of them shows
    assert max(memory[3:]) <= memory[2] * 1.25 + 2_000_000, memory


async def test_status_counts_only_live_workers_after_kill_9(redis_url: str, tmp_path: Any) -> None:
    model = f"fleet-status-{uuid.uuid4().hex[:6]}"
    with LocalFleet(
        redis_url=redis_url, model=model, workers=3, worker_args=["--heartbeat-ttl", "3"],
        log_dir=str(tmp_path / "logs"),
    ) as f:  # fmt: skip
        admin = redis.Redis.from_url(redis_url)
        queue = K.queue_name_for_model(model)

        def counted() -> tuple[int, int]:
            snap = collect(admin)
            q = next(q for q in snap["queues"] if q["name"] == queue)
            return q["workers"], sum(1 for w in snap["workers"] if w["live"] and queue in w["queues"])

        assert counted() == (3, 3)
        for p in f.group.procs[-3:-1]:
            p.kill()
        deadline = time.monotonic() + 3 + 5  # the lease (heartbeat TTL) and a margin
        while counted() != (1, 1):
            assert time.monotonic() < deadline, counted()
            time.sleep(0.2)  # polling the lapse of a lease, bounded by the deadline
        admin.close()
