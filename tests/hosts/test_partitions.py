"""The fleet on several hosts (network namespaces joined by a bridge, a delay proxy in front of Redis
and the model): a worker host, a REPL host and a trainer host cut off mid-job. Every sub-call is
answered once, no budget is overshot, nothing stalls. Partitions last seconds: the workers' heartbeat
TTL is 3 s and the rollouts' key TTL 10 s, so a host's loss is noticed as fast as in production's 10 s / 30 s."""

from __future__ import annotations

import subprocess
import time
from typing import Any

import pytest

from tests.fleet.harness import log_text
from tests.hosts.fleet import HostFleet, driver_answer

pytestmark = pytest.mark.e2e


def wait_go(proc: subprocess.Popen[str]) -> None:
    """Wait for the driver's ``go`` line (its job is about to start)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "go", f"the driver did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}"


def job_args(f: HostFleet, *extra: str) -> list[str]:
    return ["--redis-url", f.redis_url, "--base-url", f.base_url, "--model", f.model, *extra]


def test_a_worker_host_cut_off_mid_job_and_back_loses_nothing(tmp_path: Any) -> None:
    logs = str(tmp_path / "logs")
    with HostFleet(workers={"w1": [], "w2": [], "w3": []}, rtt_ms=5, log_dir=logs) as f:
        proc = f.start_driver("trainer1", "main-job", *job_args(f), "--rollouts", "3", "--calls", "24",
                              "--budget", "12000", "--tokens", "200", "--sleep", "3")  # fmt: skip
        wait_go(proc)
        time.sleep(1.5)  # the first calls are running on every worker host (3 s each)
        f.net.down("w1")
        time.sleep(6)  # twice the heartbeat TTL: its jobs are taken back and run elsewhere
        f.net.up("w1")
        out = driver_answer(proc, 90)
    print(out)
    text = log_text(logs)
    assert (out["lost"], out["duplicated"], out["overshoot"]) == (0, 0, 0), (out, text[-3000:])
    assert out["wasted"] >= 1, out  # w1 had calls at the model when it was cut off: they were run again
    assert out["seconds"] < 40, out
