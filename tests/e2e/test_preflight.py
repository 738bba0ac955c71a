"""Failures that used to pass for success: real commands, real processes.

Before: with the sub-model's server down, or no worker on the queue, ``rlmq run`` exited 0 with
0 % accuracy and the worker's log said nothing; an unreachable root ``--base-url`` cost every
row its retries. Now: a check of each model server and of the queue's workers before any
rollout (one line, exit 5), exit 6 when the sub-calls failed, and a worker that says its model
server is failing.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlmq.cli.demo import needle_rows
from rlmq.cli.local import LocalFleet, ProcessGroup, start_mock_llm
from rlmq.common.redis_server import _free_port
from tests.e2e.test_cli_errors import EARLIER, one_line, rlmq

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def model() -> Iterator[str]:
    """The scripted model (a test double) as a model server that answers."""
    group = ProcessGroup()
    try:
        yield start_mock_llm(group)
    finally:
        group.stop()


@pytest.fixture
def ds(tmp_path: Path) -> Path:
    path = tmp_path / "ds.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in needle_rows(2, min_chars=5_000)))
    (tmp_path / "rows.jsonl").write_text(EARLIER)
    return path


def waited_then_failed(res: subprocess.CompletedProcess[str]) -> tuple[str, str]:
    """The preflight's two lines: what it waits for (said as the wait starts), then why it failed."""
    assert "Traceback" not in res.stderr + res.stdout, res.stderr
    waiting, line = [x for x in res.stderr.splitlines() if x.strip()]
    assert waiting.startswith("rlmq: waiting up to ") and line.startswith("rlmq: "), res.stderr
    return waiting, line


def dead_url() -> str:
    return f"http://127.0.0.1:{_free_port()}/v1"  # nothing listens there


def test_an_unreachable_root_model_server_is_one_line_and_exit_5_before_any_rollout(tmp_path: Path, ds: Path) -> None:
    url = dead_url()
    t0 = time.monotonic()
    res = rlmq("run", "ds.jsonl", "--base-url", url, "--model", "m", "--quiet", "--output", "rows.jsonl",
               "--run-dir", "run", cwd=tmp_path)  # fmt: skip
    took = time.monotonic() - t0
    assert res.returncode == 5, res.stdout + res.stderr
    line = one_line(res)
    assert f"the root model server at {url} does not answer" in line and "nothing was run" in line, line
    assert (tmp_path / "rows.jsonl").read_text() == EARLIER  # nothing ran, nothing replaced
    assert not (tmp_path / "run").exists()
    assert took < 30, took  # no embedded Redis, no workers, no per-row retries


def test_a_dead_sub_model_server_of_local_workers_is_exit_5(tmp_path: Path, ds: Path, model: str) -> None:
    url = dead_url()
    res = rlmq("run", "ds.jsonl", "--base-url", model, "--sub-base-url", url, "--model", "scripted", "--quiet",
               "--output", "rows.jsonl", cwd=tmp_path)  # fmt: skip
    assert res.returncode == 5, res.stdout + res.stderr
    assert f"the sub-model server at {url} does not answer" in one_line(res)
    assert (tmp_path / "rows.jsonl").read_text() == EARLIER


def test_no_worker_on_the_queue_of_an_external_redis_is_exit_5(
    tmp_path: Path, ds: Path, model: str, redis_url: str
) -> None:
    sub = f"nobody-{uuid.uuid4().hex[:6]}"
    res = rlmq("run", "ds.jsonl", "--base-url", model, "--model", "scripted", "--sub-model", sub,
               "--redis-url", redis_url, "--preflight-timeout", "1", "--quiet", cwd=tmp_path)  # fmt: skip
    assert res.returncode == 5, res.stdout + res.stderr
    waiting, line = waited_then_failed(res)
    assert "waiting up to 1 s for a live worker on the sub-LLM queue" in waiting and sub in waiting, waiting
    assert "no live worker serves the sub-LLM queue" in line and f"rlmq worker --model {sub}" in line, line


def test_sub_calls_failing_on_a_worker_whose_server_is_down_exit_6_and_the_worker_says_so(
    tmp_path: Path, ds: Path, model: str, redis_url: str
) -> None:
    sub = f"down-{uuid.uuid4().hex[:6]}"
    dead = dead_url()
    logs = tmp_path / "logs"
    with LocalFleet(redis_url=redis_url, model=sub, base_url=dead, workers=1, log_dir=str(logs)):
        res = rlmq("run", "ds.jsonl", "--base-url", model, "--model", "scripted", "--sub-model", sub,
                   "--redis-url", redis_url, "--quiet", "--output", "rows.jsonl", "--run-dir", "run",
                   cwd=tmp_path, timeout=240)  # fmt: skip
        worker_log = (logs / "worker-0.log").read_text()
    assert res.returncode == 6, res.stdout + res.stderr
    assert "sub-LLM calls ended in error, above --max-sub-call-error-rate 0.1" in res.stderr, res.stderr
    assert "; the first: " in res.stderr and dead in res.stderr, res.stderr  # the cause, named
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["stop_reason"] != "error" for r in rows)  # the rollouts themselves finished
    assert all(dead in r["sub_llm_error"] for r in rows), rows[0].get("sub_llm_error")  # each row says why
    assert all(r["metrics"]["sub_llm_error_count"] == r["metrics"]["sub_llm_call_count"] > 0 for r in rows)
    failing = [x for x in worker_log.splitlines() if "is failing" in x]
    assert failing and f"model server {dead} is failing" in failing[0], worker_log[-2000:]
    assert len(failing) <= 2  # rate-limited: one line at once, then at most one per 30 s


def test_the_same_run_with_a_healthy_fleet_exits_0(tmp_path: Path, ds: Path, model: str, redis_url: str) -> None:
    """The control: the checks pass and the exit code is 0 when the sub-calls are answered."""
    sub = f"up-{uuid.uuid4().hex[:6]}"
    with LocalFleet(redis_url=redis_url, model=sub, base_url=model, workers=1):
        res = rlmq("run", "ds.jsonl", "--base-url", model, "--model", "scripted", "--sub-model", sub,
                   "--redis-url", redis_url, "--quiet", "--output", "rows.jsonl", cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert all(r["correct"] for r in rows), rows


def test_recursive_rollouts_with_no_repl_host_on_an_external_redis_are_exit_5(
    tmp_path: Path, ds: Path, model: str, redis_url: str
) -> None:
    """--max-depth 2 with workers that serve the sub-LLM queue but host no REPL: the children
    would find no worker; the preflight says so before any rollout."""
    sub = f"plain-{uuid.uuid4().hex[:6]}"
    with LocalFleet(redis_url=redis_url, model=sub, base_url=model, workers=1) as fleet:
        fleet.wait_for_workers(1)
        res = rlmq("run", "ds.jsonl", "--base-url", model, "--model", "scripted", "--sub-model", sub,
                   "--redis-url", redis_url, "--max-depth", "2", "--preflight-timeout", "1", "--quiet",
                   "--output", "rows.jsonl", cwd=tmp_path)  # fmt: skip
    assert res.returncode == 5, res.stdout + res.stderr
    waiting, line = waited_then_failed(res)
    assert "waiting up to 1 s for a live worker on the child-rollout queue" in waiting, waiting
    assert "no live worker serves the child-rollout queue" in line and "--repl-slots N" in line, line
    assert (tmp_path / "rows.jsonl").read_text() == EARLIER


@pytest.mark.parametrize("depth", ["0", "-1", "9", "1000000"])
def test_a_max_depth_out_of_range_is_refused_before_anything_starts(tmp_path: Path, ds: Path, depth: str) -> None:
    res = rlmq("run", "ds.jsonl", "--base-url", dead_url(), "--model", "m", "--max-depth", depth, "--quiet",
               "--output", "rows.jsonl", cwd=tmp_path)  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    line = one_line(res)
    assert "max-depth" in line or "max_depth" in line, line
    assert (tmp_path / "rows.jsonl").read_text() == EARLIER
