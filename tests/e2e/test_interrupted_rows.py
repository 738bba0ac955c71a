"""An interrupted run keeps only the rollouts that finished: real signals.

``rlmq demo`` with many small rollouts, a dozen at once, so REPLs start all the time; a real
SIGINT or SIGTERM at a different point of each run. Before the fix, a rollout cancelled while
its REPL started came out as a finished row with ``stop_reason: error`` (``ReplStartupError:
... [Errno 9] Bad file descriptor``) in 3 runs of 6; it went to ``--output``, the run folder and
the report's accuracy. The deterministic sweeps are in ``tests/unit/test_cancelled_rollouts.py``
and ``tests/integration/test_cancelled_rollout.py``; this is the whole command.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.e2e.test_signals import Command, wait_for_lines

pytestmark = pytest.mark.e2e

ROLLOUTS = 40


@pytest.mark.parametrize(
    ("sig", "after"),
    [(signal.SIGINT, 1), (signal.SIGTERM, 3), (signal.SIGINT, 6), (signal.SIGTERM, 10)],
    ids=["SIGINT-after-1", "SIGTERM-after-3", "SIGINT-after-6", "SIGTERM-after-10"],
)
def test_a_stopped_run_writes_no_row_for_a_rollout_it_cut_short(
    sig: signal.Signals, after: int, tmp_path: Path
) -> None:
    cmd = Command(
        "demo", "--rollouts", str(ROLLOUTS), "--min-chars", "3000", "--concurrency", "12", "--quiet",
        "--output", "rows.jsonl", "--run-dir", "run", cwd=tmp_path,
    )  # fmt: skip
    wait_for_lines(tmp_path / "rows.jsonl.partial", after)  # rollouts finish, others start their REPLs
    cmd.proc.send_signal(sig)
    assert cmd.wait(60) == 128 + sig, cmd.text
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    errors = [(r["id"], r["error"]) for r in rows if r["stop_reason"] == "error"]
    assert not errors, errors  # the scripted model answers every rollout: an error row is a cut-short one
    assert all(r["stop_reason"] == "answer_ready" for r in rows)
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["interrupted"]["finished"] == len(rows) < ROLLOUTS
    kept = [json.loads(x) for x in (tmp_path / "run" / "rows.jsonl").read_text().splitlines()]
    assert [r["id"] for r in kept] == [r["id"] for r in rows]
    assert f"stop reasons: answer_ready={len(rows)}\n" in cmd.text  # the summary counts no error
