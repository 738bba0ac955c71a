"""A small run of the recursion benchmark (``bench/recursion.py``), end to end, as CI's smoke of it.

It starts its own Redis, scripted model server and ``rlmq worker`` processes and runs
``rlmq run`` on a needle dataset at depths 1 and 2. A depth this checkout cannot run yet
(``rlmq run --max-depth`` / ``rlmq worker --repl-slots`` missing) must be reported as skipped
with that reason, and only then; every depth that runs must answer every row. No timing is asserted.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.recursion import cli_has_flag

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_a_quick_recursion_run_answers_every_row(tmp_path: Path) -> None:
    stem = tmp_path / "recursion"
    run = subprocess.run(
        [sys.executable, "-m", "bench.recursion", "--quick", "--depths", "1,2", "--workers", "1", "--out", str(stem)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    doc = json.loads(stem.with_suffix(".json").read_text())
    rows, split = doc["setup"]["rows"], doc["setup"]["split"]
    depth1 = doc["rlmq"]["1"]
    for phase in ("latency", "throughput"):
        entry = depth1[phase]
        assert entry["exit"] == 0 and entry["errors"] == 0, entry
        assert entry["correct"] == rows and entry["leaf_calls"] == rows * split
        assert entry["child_rollouts"] == 0 and math.isfinite(entry["repl_s_p50"])
    ready = cli_has_flag("run", "--max-depth") and cli_has_flag("worker", "--repl-slots")
    depth2 = doc["rlmq"]["2"]
    if not ready:
        assert "--max-depth" in depth2["skipped"] or "--repl-slots" in depth2["skipped"]
    else:
        entry = depth2["throughput"]
        assert entry["correct"] == rows and entry["child_rollouts"] == rows * split, entry
        assert entry["leaf_calls"] == rows * split**2
        assert depth2["latency"]["added_latency_s"] is not None
    assert doc["rlms"] == {"skipped": "no --rlms-python given"}
    assert "Recursive needle tree" in run.stdout
