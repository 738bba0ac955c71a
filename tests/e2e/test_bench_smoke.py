"""A small run of the queue-path benchmark, end to end, as CI's smoke of it.

It starts its own Redis, model server and worker processes (``bench/queue_path.py``) and
checks that every figure the README quotes is produced and that no sub-call failed. It
asserts no timing: speed belongs to the benchmark itself, on a quiet machine.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.queue_path import results_name

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_a_quick_run_produces_every_figure(tmp_path: Path) -> None:
    stem = tmp_path / "smoke"
    run = subprocess.run(
        [sys.executable, "-m", "bench.queue_path", "--quick", "--only", "rlmq-budget,light", "--out", str(stem)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    doc = json.loads((stem.with_suffix(".json")).read_text())
    row = doc["rows"]["rlmq-budget"]
    assert row["errors"] == 0 and row["n"] > 0
    for figure in ("calls_per_s", "p50_ms", "p99_ms", "client_cpu_ms_per_call", "worker_cpu_ms_per_call"):
        assert math.isfinite(row[figure]) and row[figure] > 0, figure
    assert 0 < row["redis_commands_per_call"] < 100
    census = doc["census"]["rlmq-budget"]
    assert census["top_level_per_call"] > 0 and census["in_lua_per_call"] > 0
    light = doc["light"]
    assert set(light) == {"rlmq", "rlmq-budget", "direct"}
    for path in ("rlmq", "rlmq-budget"):
        assert math.isfinite(light[path]["added_p50_ms"]) and math.isfinite(light[path]["added_p50_per_direct_p50"])
    assert "Light load (one prompt at a time)" in run.stdout


def test_a_subset_never_overwrites_the_full_runs_results() -> None:
    assert results_name(False, None) == "queue_path"
    assert results_name(True, None) == "queue_path_quick"
    assert results_name(False, "light") == "queue_path_only_light"
    assert results_name(False, "rlmq-budget,light") == "queue_path_only_light_rlmq_budget"


def test_a_short_tree_soak_holds_its_zeros_through_a_kill_of_each_kind_and_a_redis_restart(tmp_path: Path) -> None:
    out = tmp_path / "tree_soak.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.tree_soak", "--seconds", "30", "--trees", "2", "--tps", "400"]
        + ["--fault-every", "8", "--sample-every", "5", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["faults"] == {"kill9_worker": 1, "kill9_host": 1, "redis_restart": 1}, doc["faults"]
    assert doc["trees_finished"] >= 2 and doc["slots_by_kind"].get("ok", 0) > 20
    assert (doc["slots_bad"], doc["stalls"], doc["overshoot_tokens"]) == (0, 0, 0)
    assert doc["tokens_served_to_trees"] > 0 and doc["memory_curve"]
