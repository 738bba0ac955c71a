"""Process-level behaviour: hundreds of sub-calls in flight in one worker, and a clean stop of the demo."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest

from rlmq.cli.local import LocalFleet, child_env, rlmq_command
from rlmq.common import keys as K
from rlmq.common.aio import STOP_DEADLINE_SECONDS
from rlmq.common.connection import async_client
from rlmq.common.schemas import SubCallOptions
from rlmq.producer.dispatch import BatchSpec, Dispatcher
from tests.e2e.test_signals import as_from_a_terminal, describe

pytestmark = pytest.mark.e2e


async def test_one_worker_holds_hundreds_of_sub_calls_in_flight(redis_url: str, tmp_path: object) -> None:
    """300 calls of 1 s each through one worker process finish in a few seconds, not 300."""
    model = f"conc-{uuid.uuid4().hex[:6]}"
    with LocalFleet(redis_url=redis_url, model=model, workers=1, worker_concurrency=300, mock_latency=1.0):
        redis = async_client(redis_url)
        queue = K.queue_name_for_model(model)
        spec = BatchSpec(rollout_id=f"conc-{uuid.uuid4().hex[:6]}", batch_id="b1", queue=queue,
                         sub_call_timeout=60, parallelism=300, call=SubCallOptions(model=model))  # fmt: skip
        t0 = time.monotonic()
        task = asyncio.create_task(Dispatcher(redis).run_batch(spec, [f"Prompt {i}." for i in range(300)]))
        peak = 0
        while not task.done():
            # RQ's own record of what the worker runs now: its executions set
            workers = await redis.smembers(K.RQ_WORKERS)
            for wkey in workers:
                name = wkey.decode().split(":", 2)[2]
                peak = max(peak, await redis.scard(K.rq_worker_executions(name)))
            await asyncio.wait({task}, timeout=0.05)
        results = task.result()
        took = time.monotonic() - t0
        await redis.aclose()
    assert all(r.status == "ok" for r in results)
    assert took < 10, f"300 one-second calls took {took:.1f} s"
    assert peak >= 256, f"at most {peak} sub-calls were in flight at once"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_demo_stops_everything_it_started_on_a_signal(sig: signal.Signals, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        rlmq_command(
            "demo",
            "--rollouts",
            "200",
            "--quiet",
            "--run-dir",
            str(tmp_path / "run"),
            "--output",
            str(tmp_path / "rows.jsonl"),
        ),  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=child_env(),
        text=True,
        start_new_session=True,
        preexec_fn=as_from_a_terminal(),
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # wait for the fleet to be up: the demo prints its Redis and model
        lines.append(line)
        if line.startswith("redis "):
            break
    else:
        pytest.fail("demo ended before starting its fleet: " + "".join(lines))
    partial = tmp_path / "rows.jsonl.partial"
    deadline = time.monotonic() + 120
    while not (partial.exists() and partial.read_text().strip()):  # a rollout has finished
        assert time.monotonic() < deadline and proc.poll() is None, "no rollout finished"
        time.sleep(0.05)  # polling the demo's output file, bounded by the deadline
    children = psutil.Process(proc.pid).children(recursive=True)
    described = {p.pid: describe(p) for p in children}
    assert len(children) >= 4, described  # redis, scripted model, 2 workers (and REPLs)
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=STOP_DEADLINE_SECONDS + 10)
    took = time.monotonic() - t0
    assert proc.returncode == 128 + sig, (proc.returncode, "".join(lines) + out)
    _, alive = psutil.wait_procs(children, timeout=1)
    assert not alive, f"left running: {[described.get(p.pid, p.pid) for p in alive]}; demo said: {out[-2000:]}"
    assert took < STOP_DEADLINE_SECONDS, f"took {took:.1f} s: {out[-2000:]}"
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["interrupted"]["signal"] == sig.name and meta["interrupted"]["rollouts"] == 200
    finished = meta["interrupted"]["finished"]
    assert finished >= 1 and len((tmp_path / "rows.jsonl").read_text().splitlines()) == finished


async def test_a_worker_exports_prometheus_metrics(redis_url: str) -> None:
    """Scrape a real worker process's /metrics after it served a batch."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = f"metrics-{uuid.uuid4().hex[:6]}"
    fleet = LocalFleet(redis_url=redis_url, model=model, workers=0)
    with fleet:
        fleet.start_worker("metrics-worker", ["--metrics-port", str(port)])
        fleet.wait_for_workers(1)
        redis = async_client(redis_url)
        spec = BatchSpec(rollout_id=f"m-{uuid.uuid4().hex[:6]}", batch_id="b1", call=SubCallOptions(model=model),
                         queue=K.queue_name_for_model(model), sub_call_timeout=30, parallelism=10)  # fmt: skip
        results = await Dispatcher(redis).run_batch(spec, [f"Prompt {i}." for i in range(7)])
        await redis.aclose()
        assert all(r.status == "ok" for r in results)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    assert 'rlmq_subcalls_total{error_kind="",outcome="ok"} 7.0' in text, text[:2000]
    assert "rlmq_inflight_subcalls 0.0" in text
    assert 'rlmq_tokens_total{kind="completion"}' in text
    assert "rlmq_queue_wait_seconds_count 7.0" in text


def test_a_worker_registers_again_when_redis_forgot_it_though_its_hash_came_back(
    redis_url: str, tmp_path: Path
) -> None:
    """Redis forgets a live worker (as a restart without persistence does), and a write lands on
    its worker hash before the next heartbeat (a job's end counts it there): the worker hash
    exists again without RQ's registration. The worker still registers again within seconds,
    with a full record that ``rq info`` lists."""
    import redis as sync_redis

    model = f"rereg-{uuid.uuid4().hex[:6]}"
    r = sync_redis.Redis.from_url(redis_url)
    with LocalFleet(redis_url=redis_url, model=model, workers=1, log_dir=str(tmp_path / "logs"),
                    worker_args=["--heartbeat-ttl", "2"]):  # fmt: skip
        deadline = time.monotonic() + 30
        while not (members := r.smembers(K.RQ_WORKERS)):
            assert time.monotonic() < deadline, "the worker never registered"
            time.sleep(0.05)  # polling the registration, bounded by the deadline
        (wkey,) = members
        queue_set = K.rq_workers_of_queue(K.queue_name_for_model(model))
        pipe = r.pipeline()
        pipe.srem(K.RQ_WORKERS, wkey).srem(queue_set, wkey).delete(wkey)
        pipe.hincrby(wkey, "successful_job_count", 1)  # the partial hash a job's end writes
        pipe.execute()
        deadline = time.monotonic() + 15
        while not (r.sismember(K.RQ_WORKERS, wkey) and r.sismember(queue_set, wkey)):
            assert time.monotonic() < deadline, f"the worker did not register again: {r.hgetall(wkey)}; " + "".join(
                p.read_text()[-2000:] for p in (tmp_path / "logs").glob("*.log")
            )
            time.sleep(0.05)  # polling the registration, bounded by the deadline
        assert r.hexists(wkey, "birth") and r.hget(wkey, "rlmq_concurrency") is not None
    r.close()
