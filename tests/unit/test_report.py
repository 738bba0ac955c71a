"""The run folder and its static HTML report (structure, escaping, secrets); the browser test is in e2e."""

from __future__ import annotations

import json
import re
from datetime import UTC
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from rlmq.cli import main as cli
from rlmq.cli.report import default_run_dir, public_settings, write_run
from rlmq.common.connection import mask_url
from rlmq.common.schemas import ResultRow
from rlmq.producer.env import RolloutResult

EVIL = "<script>alert('x')</script>&"


def sub_result(i: int, status: str = "ok", **kw: Any) -> dict[str, Any]:
    d = dict(
        v=1, rollout_id="r", batch_id="b1", index=i, job_id=f"r-b1-{i}", status=status, content=f"answer {i}",
        prompt_tokens=100 + i, completion_tokens=5 + i, turns=1, seconds=0.25, queue_wait_seconds=0.01, worker="h.1.ab",
    )  # fmt: skip
    d.update(kw)
    return d


def rollout(rid: str, *, correct: bool | None, stop: str = "answer_ready", error: str | None = None) -> RolloutResult:
    long_prompt = "Find the needle.\n" + "hay " * 3000
    traj = [
        {"type": "root", "content": "Let me look.", "tool_calls": [{"id": "t1"}], "seconds": 0.2,
         "usage": {"prompt": 1200, "completion": 80}},
        {"type": "llm_batch", "batch_id": "b1", "seconds": 0.6, "prompts": [long_prompt, "short " + EVIL, "p3"],
         "results": [sub_result(0), sub_result(1, content="sub says " + EVIL),
                     sub_result(2, "error", content="[error] model", error_kind="model_timeout", error="timed out")]},
        {"type": "cell", "code": "out = llm_batch(prompts)\nprint(" + repr(EVIL) + ")", "output": "printed " + EVIL,
         "seconds": 0.7, "timed_out": False, "restarted": False},
        {"type": "root", "content": "", "tool_calls": [], "seconds": 0.1, "usage": {"prompt": 1400, "completion": 12}},
    ]  # fmt: skip
    row = ResultRow(
        id=rid,
        final_answer="velvet " + EVIL,
        answer="velvet",
        correct=correct,
        stop_reason=stop,  # type: ignore[arg-type]
        metrics={"sub_llm_call_count": 3, "sub_llm_completion_tokens": 18, "main_rlm_prompt_tokens": 2600,
                 "main_rlm_completion_tokens": 92, "repl_total_time_seconds": 0.7, "main_rlm_turns": 2,
                 "sub_llm_error_count": 1},
        error=error,
    )  # fmt: skip
    msgs = [{"role": "system", "content": "scaffold"}, {"role": "user", "content": "What is the code? " + EVIL}]
    return RolloutResult(row=row, trajectory=traj, messages=msgs)


class Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attrs += attrs


def test_write_run_writes_the_four_files(tmp_path: Path) -> None:
    results = [
        rollout("q-1", correct=True),
        rollout("q-2", correct=False, stop="max_turns"),
        rollout("q-3", correct=None, stop="error", error="RlmqError: boom " + EVIL),
    ]
    meta = {
        "command": ["rlmq", "run", "ds.jsonl", "--api-key", "***"],
        "settings": {"redis_url": "redis://:hunter2@redis:6379/0", "api_key": "sk-secret", "model": "m",
                     "max_turns": 50},
        "started": 1_800_000_000.0,
        "finished": 1_800_000_012.5,
    }  # fmt: skip
    folder = write_run(tmp_path / "runs" / "x", results, meta)
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "report.html", "rows.jsonl", "trajectories.jsonl"]
    rows = [json.loads(x) for x in (folder / "rows.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["q-1", "q-2", "q-3"]
    assert set(rows[0]) == {"id", "final_answer", "answer", "correct", "stop_reason", "metrics", "error"}
    trajs = [json.loads(x) for x in (folder / "trajectories.jsonl").read_text().splitlines()]
    assert set(trajs[0]) == {"id", "messages", "trajectory"}
    assert [e["type"] for e in trajs[0]["trajectory"]] == ["root", "llm_batch", "cell", "root"]
    assert trajs[0]["trajectory"][1]["results"][1]["content"] == "sub says " + EVIL  # full text kept
    saved = json.loads((folder / "meta.json").read_text())
    assert saved["seconds"] == 12.5 and saved["rollouts"] == 3
    assert "api_key" not in saved["settings"] and "hunter2" not in json.dumps(saved)
    assert saved["settings"]["redis_url"] == "redis://:***@redis:6379/0"

    page = (folder / "report.html").read_text()
    assert "sk-secret" not in page and "hunter2" not in page
    # everything from the run is escaped: no tag of ours other than the page's own
    assert "<script" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;&amp;" in page
    parser = Collect()
    parser.feed(page)
    assert "script" not in parser.tags and "svg" in parser.tags and "details" in parser.tags
    # static: nothing loaded from elsewhere
    assert not [v for k, v in parser.attrs if k in ("src", "href") and v and not v.startswith("#")]
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", page)
    # summary, charts, trajectories
    assert 'id="accuracy">1/2 = 50.0%' in page
    expected = [
        "answer_ready", "max_turns", "Sub-LLM completion tokens per rollout", "Root-model tokens per rollout",
        "REPL time per rollout", "root turn 1", "root turn 2", "REPL cell", "llm_batch b1", "model_timeout",
        "RlmqError: boom", 'id="rollout-2"', "(12,017 chars)", "more characters in trajectories.jsonl",
        "3 prompt(s), 1 error, 2 ok",
    ]  # fmt: skip
    for text in expected:
        assert text in page, text
    assert page.count("<pre") >= 3 * 6
    # the batch is shown inside the cell that ran it, before the cell's output
    first = page.index('id="rollout-0"')
    assert page.index("REPL cell", first) < page.index("llm_batch b1", first) < page.index("printed &lt;", first)


def test_helpers() -> None:
    assert mask_url("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert mask_url("http://h:8000/v1") == "http://h:8000/v1"
    assert public_settings({"api_key": "x", "hf_token": "y", "base_url": "http://u:p@h/v1", "n": 1}) == {
        "base_url": "http://u:***@h/v1",
        "n": 1,
    }
    from datetime import datetime

    d = default_run_dir("demo", now=datetime(2026, 11, 22, 6, 20, 1, tzinfo=UTC))
    assert d == Path("runs/20261122T062001Z-demo")


def test_empty_run_renders(tmp_path: Path) -> None:
    folder = write_run(tmp_path / "empty", [], {"command": "rlmq demo"})
    page = (folder / "report.html").read_text()
    assert "not graded" in page and "</html>" in page


def test_rlmq_run_keeps_a_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = tmp_path / "ds.jsonl"
    dataset.write_text(json.dumps({"id": "q-1", "question": "?", "context": "c", "answer": "velvet"}) + "\n")
    seen: dict[str, Any] = {}

    async def fake_evaluate(settings: Any, rows: Any, **kw: Any) -> list[RolloutResult]:
        seen.update(kw)
        kw["sink"].add(rollout("q-1", correct=True))
        return list(kw["sink"].results)

    monkeypatch.setattr(cli, "evaluate", fake_evaluate)
    monkeypatch.setattr(cli, "reach_redis", lambda url, say: None)
    run_dir = tmp_path / "my-run"
    argv = ["run", str(dataset), "--base-url", "http://m/v1", "--model", "m", "--redis-url", "redis://:pw@r:6379/0",
            "--api-key", "sk-top-secret", "--run-dir", str(run_dir), "--quiet", "--no-preflight"]  # fmt: skip
    assert cli.main(argv) == 6  # 1 of its 3 sub-calls ended in error: above the default rate of 0.1
    out = capsys.readouterr().out
    assert f"run folder: {run_dir}" in out and f"report: {run_dir / 'report.html'}" in out
    assert "accuracy: 1/1" in out
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["command"][:2] == ["rlmq", "run"] and "sk-top-secret" not in json.dumps(meta)
    assert "--api-key" in meta["command"] and "redis://:***@r:6379/0" in meta["command"]
    assert "sk-top-secret" not in (run_dir / "report.html").read_text()
    assert seen["sink"].output is None


def test_default_run_dir_is_under_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = tmp_path / "ds.jsonl"
    dataset.write_text(json.dumps({"id": "q-1", "question": "?", "context": "c"}) + "\n")

    async def fake_evaluate(settings: Any, rows: Any, **kw: Any) -> list[RolloutResult]:
        kw["sink"].add(rollout("q-1", correct=None))
        return list(kw["sink"].results)

    monkeypatch.setattr(cli, "evaluate", fake_evaluate)
    monkeypatch.setattr(cli, "reach_redis", lambda url, say: None)
    monkeypatch.chdir(tmp_path)
    argv = ["run", str(dataset), "--base-url", "http://m/v1", "--model", "m", "--redis-url", "redis://r:6379/0"]
    assert cli.main([*argv, "--quiet", "--no-preflight", "--max-sub-call-error-rate", "0.5"]) == 0
    (folder,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"\d{8}T\d{6}Z-run", folder.name)
    assert (folder / "report.html").exists()


def test_runs_started_in_the_same_second_get_folders_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default run folder is named by the second: a script starting two runs in one second
    put both in one folder, the second replacing the first's rows."""
    from datetime import datetime

    import rlmq.cli.report as report

    class Frozen(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Frozen:
            return cls(2026, 11, 22, 6, 20, 1, tzinfo=tz)

    monkeypatch.setattr(report, "datetime", Frozen)
    dataset = tmp_path / "ds.jsonl"
    dataset.write_text(json.dumps({"id": "q-1", "question": "?", "context": "c"}) + "\n")

    async def fake_evaluate(settings: Any, rows: Any, **kw: Any) -> list[RolloutResult]:
        kw["sink"].add(rollout("q-1", correct=None))
        return list(kw["sink"].results)

    monkeypatch.setattr(cli, "evaluate", fake_evaluate)
    monkeypatch.setattr(cli, "reach_redis", lambda url, say: None)
    monkeypatch.chdir(tmp_path)
    argv = ["run", str(dataset), "--base-url", "http://m/v1", "--model", "m", "--redis-url", "redis://r:6379/0"]
    for _ in range(3):
        assert cli.main([*argv, "--quiet", "--no-preflight", "--max-sub-call-error-rate", "0.5"]) == 0
    names = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert names == ["20261122T062001Z-run", "20261122T062001Z-run-2", "20261122T062001Z-run-3"]
    assert all((tmp_path / "runs" / n / "rows.jsonl").read_text().count("\n") == 1 for n in names)


def test_each_figure_once_folded_trajectories_and_no_empty_frames(tmp_path: Path) -> None:
    """Stop reasons are counted once (inside the bar, or in a legend for a narrow segment), a
    sub-call's error text once, each trajectory folded in a details; an interrupted run that
    finished nothing draws no card and no chart frame."""
    results = [rollout(f"q-{i}", correct=True) for i in range(9)] + [rollout("q-x", correct=False, stop="max_turns")]
    page = (write_run(tmp_path / "a", results, {"command": "t"}) / "report.html").read_text()
    page = re.sub(r"<title>.*?</title>", "", page)  # hover texts are not shown on the page
    assert page.count("answer_ready 9") + page.count("answer_ready: 9") == 1
    assert page.count("max_turns: 1") + page.count("max_turns 1") == 1  # a tenth of the bar: in the legend
    assert page.count("timed out") == 10  # the sub-call's error text, once per rollout (content differs)
    assert page.count('<details class="traj">') == 10 and '<details class="traj" open' not in page
    empty = write_run(
        tmp_path / "b", [], {"command": "t", "interrupted": {"signal": "SIGTERM", "finished": 0, "rollouts": 6}}
    )
    page = (empty / "report.html").read_text()
    assert "Interrupted by SIGTERM: 0 of 6" in page and "No rollout finished" in page
    assert "<svg" not in page and 'class="card"' not in page and "<figure" not in page


def test_a_tree_run_counts_whole_trees_and_outlines_them(tmp_path: Path) -> None:
    """The cards, the table and the charts count the children's sub-calls; the tree outline lists
    each child under its parent, and a child ended by the budget is counted in a card."""
    res = rollout("t-1", correct=True)
    child = {
        "rollout_id": "c1",
        "depth": 2,
        "stop_reason": "budget_spent",
        "trajectory": [],
        "metrics": {"main_rlm_turns": 1, "tree_sub_llm_call_count": 7, "tree_charged_completion_tokens": 300},
    }
    res.trajectory.append({"type": "rlm_batch", "batch_id": "r1", "seconds": 1.0, "tasks": ["find it"],
                           "results": [sub_result(0, content="CHILD-ANSWER", child=child)]})  # fmt: skip
    res.row.metrics.update({"rlm_call_count": 1, "tree_rollout_count": 2, "tree_depth": 2,
                            "tree_sub_llm_call_count": 10, "tree_sub_llm_completion_tokens": 40,
                            "tree_charged_completion_tokens": 340, "tree_budget_spent_count": 1})  # fmt: skip
    page = (write_run(tmp_path / "t", [res], {"command": "t"}) / "report.html").read_text()
    cards = dict(re.findall(r'<div class="k">([^<]*)</div><div class="v [^"]*"[^>]*>([^<]*)</div>', page))
    assert cards["sub-LLM calls"] == "10" and cards["children ended by the budget"] == "1"
    assert cards["rlm_batch tasks / child rollouts"] == "1 / 1" and cards["deepest tree"] == "depth 2"
    assert '<details class="outline" open><summary>tree: 1 child rollout(s)</summary>' in page
    assert "answer <b>CHILD-ANSWER</b> · 7 sub-call(s) · 300 tokens charged" in page
    assert "Completion tokens charged per rollout tree" in page
