"""The knobs of an eval tool, through the real ``rlmq run``: real worker
processes, a real Redis, the scripted model (a test double) recording what each request asked.

Sampling arguments reach the model server (root and sub-LLM calls), ``-n`` and ``-r`` shape the
run, the run folder grows while the run goes, and ``--resume`` runs only what had not finished.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from rlmq.cli.demo import needle_rows
from rlmq.cli.local import ProcessGroup, rlmq_command, start_mock_llm
from tests.e2e.test_cli_errors import rlmq
from tests.e2e.test_signals import Command, wait_for_lines

pytestmark = pytest.mark.e2e


@pytest.fixture
def model() -> Iterator[str]:
    """A scripted model server of this test alone (its request log is this test's)."""
    group = ProcessGroup()
    try:
        yield start_mock_llm(group)
    finally:
        group.stop()


@pytest.fixture
def slow_model() -> Iterator[str]:
    """The scripted model answering every call after 0.5 s: rollouts take a while."""
    group = ProcessGroup()
    try:
        yield start_mock_llm(group, latency=0.5)
    finally:
        group.stop()


def stats(base_url: str, method: str = "GET") -> dict[str, Any]:
    """The scripted model's counters and request log (``DELETE``: reset them)."""
    req = urllib.request.Request(base_url.removesuffix("/v1") + "/stats", method=method)
    with urllib.request.urlopen(req, timeout=10) as reply:
        return dict(json.loads(reply.read()))


def write_rows(path: Path, n: int) -> list[str]:
    rows = needle_rows(n, min_chars=5_000, seed=3)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [str(r["id"]) for r in rows]


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_sampling_arguments_reach_the_model_server_for_root_and_sub_calls(tmp_path: Path, model: str) -> None:
    write_rows(tmp_path / "ds.jsonl", 2)
    res = rlmq(
        "run", "ds.jsonl", "--base-url", model, "--model", "root-m", "--sub-model", "sub-m", "--quiet",
        "-S", '{"temperature": 0.3, "max_tokens": 900, "extra_body": {"top_k": 7}}', "--top-p", "0.8",
        "--sub-sampling-args", '{"top_p": 0.5, "extra_body": {"min_p": 0.1}}', "--sub-temperature", "0.2",
        "--output", "rows.jsonl", cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    params = stats(model)["params"]
    root = [p for p in params if p["model"] == "root-m"]
    sub = [p for p in params if p["model"] == "sub-m"]
    assert root and sub, params[:3]
    for p in root:
        assert (p["temperature"], p["top_p"], p["top_k"], p["max_tokens"]) == (0.3, 0.8, 7, 900), p
    for p in sub:  # the sub-sampling arguments override the rollout's, key by key; the rest is inherited
        assert (p["temperature"], p["top_p"], p["min_p"], p["top_k"], p["max_tokens"]) == (0.2, 0.5, 0.1, 7, 900), p


def test_sub_calls_sample_with_the_rollouts_sampling_arguments_and_are_never_sent_uncapped(
    tmp_path: Path, model: str
) -> None:
    """No sub-sampling flag and no budget: every sub-LLM request carries the rollout's temperature,
    and its max_tokens as the cap (before, they went out with neither)."""
    write_rows(tmp_path / "ds.jsonl", 2)
    res = rlmq("run", "ds.jsonl", "--base-url", model, "--model", "root-m", "--sub-model", "sub-m", "--quiet",
               "-S", '{"temperature": 0.3, "max_tokens": 1000}', "--output", "rows.jsonl", cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    sub = [p for p in stats(model)["params"] if p["model"] == "sub-m"]
    assert len(sub) >= 2, sub
    assert all((p.get("temperature"), p.get("max_tokens")) == (0.3, 1000) for p in sub), sub
    assert all("user" in p for p in sub)  # rlmq's own field (the rollout), never the root's


def test_a_field_a_sub_call_may_not_carry_is_refused_in_one_line(tmp_path: Path) -> None:
    write_rows(tmp_path / "ds.jsonl", 1)
    res = rlmq("run", "ds.jsonl", "--base-url", "http://127.0.0.1:9/v1", "--model", "m",
               "--sub-sampling-args", '{"n": 3}', cwd=tmp_path)  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert "may not set n" in res.stderr and "Traceback" not in res.stderr


def test_num_examples_and_rollouts_per_example(tmp_path: Path, model: str) -> None:
    ids = write_rows(tmp_path / "ds.jsonl", 4)
    res = rlmq("run", "ds.jsonl", "--base-url", model, "--model", "scripted", "--quiet", "-n", "2", "-r", "3",
               "--output", "rows.jsonl", "--run-dir", "run", cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    rows = read_rows(tmp_path / "rows.jsonl")
    assert [(r["id"], r["rollout"]) for r in rows] == [(i, k) for i in ids[:2] for k in range(3)]
    assert all(r["correct"] for r in rows)
    assert "rollouts: 6" in res.stdout
    trajectories = read_rows(tmp_path / "run" / "trajectories.jsonl")
    assert [(t["id"], t["rollout"]) for t in trajectories] == [(i, k) for i in ids[:2] for k in range(3)]


def test_the_run_folder_grows_while_the_run_goes_and_resume_runs_only_the_rest(tmp_path: Path, slow_model: str) -> None:
    ids = write_rows(tmp_path / "ds.jsonl", 8)
    cmd = Command("run", "ds.jsonl", "--base-url", slow_model, "--model", "scripted", "--quiet",
                  "--concurrency", "2", "--run-dir", "run", cwd=tmp_path)  # fmt: skip
    wait_for_lines(tmp_path / "run" / "rows.jsonl", 2)  # read mid-run, from another process
    assert cmd.proc.poll() is None
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["status"] == "running" and meta["command"][:2] == ["rlmq", "run"]
    cmd.proc.send_signal(signal.SIGKILL)  # nothing gets to tidy up: what is there was appended as it finished
    cmd.wait(10)
    before = read_rows(tmp_path / "run" / "rows.jsonl")
    assert 2 <= len(before) < len(ids), len(before)
    assert all(r["stop_reason"] == "answer_ready" for r in before)
    stats(slow_model, "DELETE")

    res = rlmq("run", "ds.jsonl", "--base-url", slow_model, "--model", "scripted", "--quiet",
               "--resume", "run", "--output", "rows.jsonl", cwd=tmp_path, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{len(before)} of {len(ids)} rollouts finished before" in res.stdout
    rows = read_rows(tmp_path / "rows.jsonl")
    assert [r["id"] for r in rows] == ids  # every row once, in dataset order
    kept = {r["id"]: r for r in before}
    assert all(rows[ids.index(i)] == kept[i] for i in kept)  # the finished ones, as they were
    root_calls = [p for p in stats(slow_model)["params"] if "call_python_repl" in p.get("tool_names", [])]
    assert len(root_calls) == len(ids) - len(before)  # one root turn per needle rollout: none ran twice
    run_rows = read_rows(tmp_path / "run" / "rows.jsonl")
    assert [r["id"] for r in run_rows] == ids
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["status"] == "finished" and meta["resumed"] == {"kept": len(before)}


def test_version() -> None:
    out = subprocess.run([*rlmq_command("--version")], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == f"rlmq {version('rlmq')}"
    assert sys.executable  # the same interpreter as the tests


def test_resume_of_a_folder_that_is_not_this_runs_is_one_line_exit_2(tmp_path: Path) -> None:
    ids = write_rows(tmp_path / "ds.jsonl", 1)
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "rows.jsonl").write_text(
        json.dumps({"id": "not-in-ds", "final_answer": "x", "answer": None, "correct": None,
                    "stop_reason": "answer_ready", "metrics": {}, "error": None}) + "\n"
    )  # fmt: skip
    (tmp_path / "per-row").mkdir()
    (tmp_path / "per-row" / "rows.jsonl").write_text(
        json.dumps({"id": ids[0], "final_answer": "x", "answer": None, "correct": None, "rollout": 2,
                    "stop_reason": "answer_ready", "metrics": {}, "error": None}) + "\n"
    )  # fmt: skip
    for folder, expect in (
        ("empty", "no rows.jsonl there"),
        ("other", "'not-in-ds', which is not in this dataset"),
        ("per-row", "that run had another --rollouts-per-example"),
    ):
        res = rlmq("run", "ds.jsonl", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--resume", folder,
                   "--redis-url", "redis://127.0.0.1:9/0", cwd=tmp_path)  # fmt: skip
        assert res.returncode == 2, res.stderr  # before Redis or a model server is tried
        assert expect in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_resume_with_other_settings_is_refused_and_with_a_longer_deadline_runs(tmp_path: Path, slow_model: str) -> None:
    """A resumed run's kept rows must be of the same rollouts: another root model, sampling or
    turn limit would mix two runs in one folder whose meta.json then names only the last one."""
    ids = write_rows(tmp_path / "ds.jsonl", 6)
    base = ["run", "ds.jsonl", "--base-url", slow_model, "--model", "scripted", "--quiet"]
    cmd = Command(*base, "--concurrency", "2", "--run-dir", "run", cwd=tmp_path)
    wait_for_lines(tmp_path / "run" / "rows.jsonl", 1)
    cmd.proc.send_signal(signal.SIGKILL)  # killed: only what was written at the start says how it ran
    cmd.wait(10)
    before = (tmp_path / "run" / "rows.jsonl").read_text()
    for flags, named in (
        (["--max-turns", "2"], "--max-turns 50 (now 2)"),
        (["-S", '{"temperature": 1.5}'], '--sampling-args {} (now {"temperature": 1.5})'),
        (["--sub-model", "other"], '--sub-model "scripted" (now "other")'),
    ):
        res = rlmq(*base, "--resume", "run", *flags, cwd=tmp_path)
        assert res.returncode == 2, res.stdout + res.stderr
        assert named in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert (tmp_path / "run" / "rows.jsonl").read_text() == before  # nothing was run or rewritten
    res = rlmq(
        *base, "--resume", "run", "--rollout-timeout", "900", "--output", "rows.jsonl", cwd=tmp_path, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert [r["id"] for r in read_rows(tmp_path / "rows.jsonl")] == ids


ROWS_IN_USE = 24
"""Rows of the first run of the in-use test: about 40 s of rollouts, so it is still running when the
refused commands start (each takes seconds to import on a loaded machine; 6 rows once ran out)."""


def test_a_run_folder_in_use_is_refused_and_free_again_after_kill_9(tmp_path: Path, slow_model: str) -> None:
    """A second ``rlmq run`` on the folder of a live run (``--resume`` it "because it looks stuck",
    or the same ``--run-dir``) would replace rows.jsonl under the first, whose later rows then
    went to a deleted file: it is refused, one line, exit 2, and the first run's rows stay."""
    write_rows(tmp_path / "ds.jsonl", ROWS_IN_USE)
    base = ["run", "ds.jsonl", "--base-url", slow_model, "--model", "scripted", "--quiet"]
    cmd = Command(*base, "--concurrency", "1", "--run-dir", "run", cwd=tmp_path)
    wait_for_lines(tmp_path / "run" / "rows.jsonl", 1)
    for flags in (["--resume", "run"], ["--run-dir", "run"]):
        res = rlmq(*base, *flags, cwd=tmp_path, timeout=120)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "in use by another rlmq run" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert cmd.proc.poll() is None
    wait_for_lines(tmp_path / "run" / "rows.jsonl", 2)  # the first run still appends where it did
    cmd.proc.send_signal(signal.SIGKILL)
    cmd.wait(10)
    kept = len(read_rows(tmp_path / "run" / "rows.jsonl"))
    assert kept >= 2
    res = rlmq(*base, "--resume", "run", cwd=tmp_path, timeout=300)  # the lock died with it
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{kept} of {ROWS_IN_USE} rollouts finished before" in res.stdout
