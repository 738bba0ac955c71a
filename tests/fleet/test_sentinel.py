"""Redis with a replica and a Sentinel: a Sentinel URL wherever a Redis URL goes, and a failover
(``kill -9`` of the master) in the middle of a fleet's main job, measured: how long Redis did not
answer, and what became of every sub-call and budget."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rlmq.cli.local import LocalFleet
from rlmq.common import sentinel
from rlmq.common.connection import async_client, check_redis, sync_client
from rlmq.common.errors import ConfigError
from tests.fleet.harness import log_text, main_job
from tests.fleet.sentinel import SentinelSet

pytestmark = pytest.mark.e2e


def test_sentinel_urls_parse_and_reject_what_is_not_one() -> None:
    s = sentinel.parse("redis+sentinel://:pw@10.0.0.1:26379,10.0.0.2:26380/mymaster/2")
    assert s is not None and s.sentinels == [("10.0.0.1", 26379), ("10.0.0.2", 26380)]
    assert (s.service, s.db, s.password, s.ssl) == ("mymaster", 2, "pw", False)
    assert sentinel.parse("redis://127.0.0.1:6379/0") is None
    with pytest.raises(ConfigError, match="service"):
        sentinel.parse("redis+sentinel://10.0.0.1:26379")


async def test_a_sentinel_url_goes_wherever_a_redis_url_goes(tmp_path: Path) -> None:
    s = SentinelSet(tmp_path / "redis")
    try:
        check_redis(s.url)
        sync = sync_client(s.url)
        sync.set("rlmq-sentinel-probe", b"1")
        client = async_client(s.url)
        assert await client.get("rlmq-sentinel-probe") == b"1"
        await client.aclose()
        status = subprocess.run([sys.executable, "-m", "rlmq", "status", "--redis-url", s.url],
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert status.returncode == 0 and "QUEUES" in status.stdout, status.stderr
    finally:
        s.close()


async def probe(url: str, stop: asyncio.Event, ok_at: list[float]) -> None:
    """INCR a key every 20 ms through ``url``, noting when each answered."""
    client = async_client(url)
    try:
        while not stop.is_set():
            try:
                await client.incr("rlmq-failover-probe")
                ok_at.append(time.monotonic())
            except Exception:  # noqa: BLE001 - a failover: the next try reconnects
                pass
            await asyncio.sleep(0.02)
    finally:
        await client.aclose()


async def test_a_failover_mid_job_answers_every_sub_call_and_service_comes_back(tmp_path: Path) -> None:
    s = SentinelSet(tmp_path / "redis")
    logs = str(tmp_path / "logs")
    try:
        before = s.master_port()
        with LocalFleet(redis_url=s.url, model="failover", workers=2, worker_concurrency=64, log_dir=logs) as f:
            stop, ok_at = asyncio.Event(), []
            prober = asyncio.create_task(probe(s.url, stop, ok_at))
            job = asyncio.create_task(main_job(s.url, str(f.base_url), "failover", rollouts=3, calls=16,
                                               budget=1200, tokens=100, sleep=2, timeout=30))  # fmt: skip
            await asyncio.sleep(1.0)
            killed = time.monotonic()
            s.kill_master()
            out = await asyncio.wait_for(job, 90)
            finished = time.monotonic() - killed
            stop.set()
            await prober
        after = s.master_port()
        gap = max((b - a for a, b in zip(ok_at, ok_at[1:], strict=False) if b > killed - 1), default=0.0)
        summary: dict[str, Any] = {**out.summary(), "no_service_s": round(gap, 2)}
        summary["job_after_kill_s"] = round(finished, 1)
        print(summary)
        assert after != before, "the Sentinel did not promote the replica"
        assert out.slots == 48 and out.duplicated == 0, summary  # every sub-call has one result
        assert out.lost == len([e for e in out.errors.elements() if e]), summary  # each error has its kind
        assert gap < 15, summary  # service back within the measured time
    finally:
        s.close()
    print(log_text(logs)[-2000:])
