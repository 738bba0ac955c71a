"""Redis with a replica and a Sentinel: a Sentinel URL wherever a Redis URL goes, and a failover
(``kill -9`` of the master) in the middle of a fleet's main job, measured: how long Redis did not
answer, and what became of every sub-call and budget."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlmq.common import sentinel
from rlmq.common.connection import async_client, check_redis, sync_client
from rlmq.common.errors import ConfigError
from tests.fleet.sentinel import SentinelSet, failover_run

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


async def test_a_failover_mid_job_answers_every_sub_call_and_service_comes_back(tmp_path: Path) -> None:
    run = await failover_run(tmp_path)
    out = run["out"]
    summary: dict[str, Any] = {**out.summary(), **{k: v for k, v in run.items() if k != "out"}}
    print(summary)
    assert run["promoted"], "the Sentinel did not promote the replica"
    assert out.slots == 48 and out.duplicated == 0, summary  # every sub-call has one result
    assert out.lost == sum(out.errors.values()) and "None" not in out.errors, summary  # each error has its kind
    assert out.overshoot == 0, summary
    assert run["no_service_s"] < 15, summary  # service back within the measured time
