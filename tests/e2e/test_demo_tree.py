"""``rlmq demo --max-depth 3``: a real tree out of the box, with its figures right everywhere.

A real ``rlmq demo`` process (embedded Redis, two REPL-hosting workers, the scripted model, a
test double whose root recurses whenever ``rlm_batch`` starts children): the summary counts the
whole trees' sub-calls and says how deep they went; the ``rlm_batch`` printout gives each child's
own tokens and turns; the report's cards count the trees; the workers log their start, stop and
children, not each HTTP request.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from rlmq.cli.local import child_env, rlmq_command

RUN_DEADLINE = 300.0
"""Seconds the demo gets (about 40 s on two idle cores)."""


def test_demo_max_depth_3_shows_the_tree_everywhere(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        rlmq_command("demo", "--max-depth", "3", "--rollouts", "2", "--min-chars", "40000", "--quiet",
                     "--run-dir", str(run_dir), "--output", str(tmp_path / "rows.jsonl")),
        capture_output=True, text=True, timeout=RUN_DEADLINE, env=child_env(), cwd=tmp_path,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["correct"] for r in rows] == [True, True]
    for r in rows:  # a root, 2 children, 4 grandchildren; the top rollout made no sub-call itself
        m = r["metrics"]
        assert (m["tree_depth"], m["tree_rollout_count"], m["rlm_call_count"]) == (3, 7, 6), m
        assert m["sub_llm_call_count"] == 0 and m["tree_sub_llm_call_count"] > 0
    calls = sum(r["metrics"]["tree_sub_llm_call_count"] for r in rows)
    charged = sum(r["metrics"]["tree_charged_completion_tokens"] for r in rows)
    assert f"sub-LLM calls: {calls} in all, 0 ended in error, 0 rejected by the budget" in out, out
    assert "12 child rollout(s) reported" in out and f"{charged} completion tokens charged" in out
    assert "the deepest tree reached depth 3" in out

    # the rlm_batch printout: each child with the tokens its subtree charged and its own turns
    traj = json.loads((run_dir / "trajectories.jsonl").read_text().splitlines()[0])["trajectory"]
    cell = next(ev["output"] for ev in traj if ev["type"] == "cell")
    lines = [line for line in cell.splitlines() if re.match(r"\s+\[\d\] ok", line)]
    assert len(lines) == 2 and all(" 0 tokens" not in line and "0 turn(s)" not in line for line in lines), cell
    assert all("sub-call(s)" in line and "2 child rollout(s)" in line for line in lines), cell

    page = (run_dir / "report.html").read_text()
    cards = dict(re.findall(r'<div class="k">([^<]*)</div><div class="v [^"]*"[^>]*>([^<]*)</div>', page))
    assert cards["sub-LLM calls"] == f"{calls:,}" and cards["deepest tree"] == "depth 3"
    assert cards["rlm_batch tasks / child rollouts"] == "12 / 12"
    assert page.count('<details class="outline" open>') == 2

    logs = json.loads((run_dir / "meta.json").read_text())["worker_logs"]
    for log in sorted(Path(logs).glob("worker-*.log")):
        text = log.read_text()
        assert "HTTP Request" not in text and len(text.splitlines()) <= 8, text
        assert "hosts up to 4 child rollouts per depth" in text and "stopped after" in text, text


def test_a_tree_the_budget_starved_says_so_and_exits_7(tmp_path: Path) -> None:
    """A budget too small for the children's root turns: children end ``budget_spent``; the run
    finishes (its rollouts answered), says how many the budget ended, and exits 7."""
    proc = subprocess.run(
        rlmq_command("demo", "--max-depth", "2", "--rollouts", "2", "--min-chars", "40000", "--quiet",
                     "--sub-llm-max-completion-tokens", "400", "--run-dir", str(tmp_path / "run")),
        capture_output=True, text=True, timeout=RUN_DEADLINE, env=child_env(), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 7, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "rows.jsonl").read_text().splitlines()]
    spent = sum(r["metrics"]["tree_budget_spent_count"] for r in rows)
    starved = sum(1 for r in rows if r["metrics"]["tree_budget_spent_count"])
    assert spent > 0 and all(r["stop_reason"] != "error" for r in rows)
    line = f"budget: {spent} child rollout(s) ended by the tree budget (budget_spent) in {starved} of 2 rollout(s)"
    assert line in proc.stdout, proc.stdout
    assert f"the budget starved {starved} of 2 rollout tree(s)" in proc.stderr and "(exit code 7)" in proc.stderr
    page = (tmp_path / "run" / "report.html").read_text()
    assert f'<div class="k">children ended by the budget</div><div class="v bad">{spent}</div>' in page
