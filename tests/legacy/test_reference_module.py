"""A module written for verifiers 0.1.14's ``RLMEnv`` runs through ``rlmq.verifiers_legacy.RLMEnv``.

``tests/legacy/envs/needle_reference_rlm.py`` is written the way the reference's ``-rlm``
environments are (``load_environment()`` -> ``RLMEnv(dataset=..., rubric=..., repl_language=...,
sandbox_*=...)``, the haystack in ``info["context"]``, a rubric reading ``state["final_answer"]``);
only its import line names rlmq. It runs in the verifiers 0.1.14 venv (``conftest.py``) through
``Environment.evaluate`` and through that release's ``vf-eval``, with and without a budget, on
real ``rlmq worker`` processes, a real Redis and the scripted model (a test double) behind a
recording proxy that sees every request: the root calls (sent by verifiers' own client) and
the sub-calls (sent by the workers).

The module runs in both REPL languages: bash (``repl_language="bash"``, the reference's
default) and Python.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rlmq.cli.demo import needle_rows
from tests.e2e.test_verifiers import RecordingProxy, proxied_fleet
from tests.legacy.conftest import BUILD_TIMEOUT, ROOT, legacy_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(BUILD_TIMEOUT + 600)]  # the first test may build the venv

MODULE = ROOT / "tests" / "legacy" / "envs" / "needle_reference_rlm.py"
DRIVE = ROOT / "tests" / "legacy" / "drive.py"
REFERENCE_IMPORT = "from verifiers.envs.experimental.rlm_env import RLMEnv"
LANGUAGES = ["python", "bash"]
"""REPL languages the module runs in."""
BUDGET = 60
"""Sub-LLM completion tokens per rollout in the budgeted runs (sub-calls that spend all they are granted)."""
RUN_TIMEOUT = 420


@dataclass
class Fleet:
    redis_url: str
    proxy: RecordingProxy
    model: str


@pytest.fixture(scope="module")
def fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The scripted model behind the recording proxy, two real workers serving the root's model name."""
    logs = tmp_path_factory.mktemp("legacy-fleet-logs")
    model = f"legacy-{uuid.uuid4().hex[:6]}"
    with proxied_fleet(redis_url, logs, model) as made:
        yield Fleet(redis_url=redis_url, proxy=made.proxy, model=model)


def _rows(path: Path, n: int, *, suffix: str = "", min_chars: int = 60_000) -> Path:
    rows = needle_rows(n, min_chars=min_chars, seed=7)
    for row in rows:
        row["question"] = f"{row['question']}{suffix}"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(argv: list[str], fleet: Fleet, cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        argv,
        cwd=cwd,
        env=legacy_env({"REDIS_URL": fleet.redis_url}),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert proc.returncode == 0, f"{argv[:3]} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def evaluate(legacy: Path, fleet: Fleet, tmp: Path, runs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """``load_environment(**args).evaluate(...)`` for each ``args`` of ``runs``, in one process of
    the 0.1.14 venv; the outputs of each run."""
    out = tmp / "evaluate.json"
    argv = [str(legacy), str(DRIVE), str(out), json.dumps(runs), "--base-url", fleet.proxy.url]
    _run([*argv, "--model", fleet.model], fleet, tmp)
    data = json.loads(out.read_text())
    assert data["verifiers"] == "0.1.14" and data["env"] == "rlmq.verifiers_legacy.env", data
    return [run["outputs"] for run in data["runs"]]


@dataclass
class Evaluated:
    """The module's runs through ``evaluate``: one per REPL language without a budget, one with."""

    plain: dict[str, list[dict[str, Any]]]
    budgeted: list[dict[str, Any]]
    root_requests: int


@pytest.fixture(scope="module")
def evaluated(legacy: Path, fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Evaluated:
    tmp = tmp_path_factory.mktemp("legacy-evaluate")
    plain = _rows(tmp / "plain.jsonl", 3)
    spent = _rows(tmp / "spent.jsonl", 2, suffix=" [[mock:spend-all]]", min_chars=100_000)
    runs = [{"rows_path": str(plain), "repl_language": language} for language in LANGUAGES]
    runs.append({"rows_path": str(spent), "sub_llm_max_completion_tokens": BUDGET})
    before = len(fleet.proxy.requests())
    outputs = evaluate(legacy, fleet, tmp, runs)
    roots = sum(1 for s in fleet.proxy.requests()[before:] if s.root)
    return Evaluated(plain=dict(zip(LANGUAGES, outputs, strict=False)), budgeted=outputs[-1], root_requests=roots)


def vf_eval(
    legacy: Path, fleet: Fleet, tmp: Path, env_args: dict[str, Any], n: int, extra: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """verifiers 0.1.14's ``vf-eval needle_reference_rlm`` (its env server included); the rows of
    its ``results.jsonl``."""
    argv = [
        str(legacy.with_name("vf-eval")), "needle_reference_rlm", "-a", json.dumps(env_args),
        "-m", fleet.model, "-b", fleet.proxy.url, "-k", "RLMQ_TEST_KEY", "-n", str(n), "-r", "1",
        "--disable-tui", "-s", "-o", str(tmp / "vf-out"), "-C", "final_answer,rlmq", *extra,
    ]  # fmt: skip
    _run(argv, fleet, tmp)
    found = list((tmp / "vf-out").rglob("results.jsonl"))
    assert len(found) == 1, found
    return [json.loads(line) for line in found[0].read_text().splitlines() if line.strip()]


def _served(fleet: Fleet, rollout_user: str) -> tuple[int, int]:
    """(sub-calls, completion tokens) the model server returned to the workers of one rollout."""
    subs = [s for s in fleet.proxy.requests() if not s.root and s.user == rollout_user]
    return len(subs), sum(s.completion_tokens for s in subs)


def test_the_module_differs_from_a_reference_module_by_its_import_only() -> None:
    """Every line that names rlmq is the one import line, whose comment is the reference's."""
    lines = MODULE.read_text().splitlines()
    rlmq_lines = [line for line in lines if "rlmq" in line and not line.lstrip().startswith(('"', "#"))]
    assert rlmq_lines == [f"from rlmq.verifiers_legacy import RLMEnv  # the reference: {REFERENCE_IMPORT}"]
    assert "verifiers.envs.experimental" not in "\n".join(lines).replace(REFERENCE_IMPORT, "")


@pytest.mark.parametrize("language", LANGUAGES)
def test_evaluate_scores_the_module_without_a_budget(evaluated: Evaluated, language: str) -> None:
    """verifiers' ``evaluate`` runs every row; the module's own rubric scores each 1.0 from
    ``state["final_answer"]``; the root calls went through verifiers' client (verifiers counted
    their tokens, and each is a trajectory step) and the sub-calls through the fleet."""
    outputs = evaluated.plain[language]
    assert len(outputs) == 3
    for out in outputs:
        m = out["metrics"]
        assert out["reward"] == 1.0 and m["exact_passphrase"] == 1.0, out
        assert out["final_answer"] == out["answer"] and out["stop_condition"] == "answer_ready"
        assert out["error"] is None
        assert m["root_llm_turns"] >= 1 and m["sub_llm_call_count"] >= 3 and m["repl_call_count"] >= 1
        assert out["trajectory_steps"] == m["root_llm_turns"], "each root turn is a verifiers trajectory step"
        assert out["token_usage"]["output_tokens"] == m["root_llm_completion_tokens"] > 0
        assert out["prompt_roles"][:1] == ["system"], "the model-visible prompt (rlmq's scaffold) is the state's"
        assert m["sub_llm_budget_limit"] == 0


def test_every_root_call_reached_the_server_through_verifiers(evaluated: Evaluated) -> None:
    """rlmq has no root-model URL here: the root requests the server saw are the root turns of
    every run, all made by verifiers' client."""
    runs = [*evaluated.plain.values(), evaluated.budgeted]
    assert evaluated.root_requests == sum(o["metrics"]["root_llm_turns"] for run in runs for o in run) > 0


def test_evaluate_holds_the_old_budget_name_hard(evaluated: Evaluated, fleet: Fleet) -> None:
    """#966's ``sub_llm_max_completion_tokens`` as the budget, sub-LLMs that spend every token
    they are granted, five or more sub-calls per rollout: the model server returns at most the
    budget per rollout, and the rubric scores what the rollout answered."""
    assert len(evaluated.budgeted) == 2
    for out in evaluated.budgeted:
        m = out["metrics"]
        calls, served = _served(fleet, out["rlmq"]["rollout_id"])
        assert m["sub_llm_budget_limit"] == BUDGET and 0 < served <= BUDGET, (served, m)
        assert (
            m["sub_llm_budget_charged"] == served
            and m["sub_llm_call_count"] + m["sub_llm_rejected_count"] >= 5
            and calls >= 1
        )
        assert m["sub_llm_rejected_count"] >= 1
        expected = 1.0 if (out["final_answer"] or "").strip().lower() == out["answer"].lower() else 0.0
        assert out["reward"] == expected


def test_vf_eval_runs_the_module_with_and_without_a_budget(legacy: Path, fleet: Fleet, tmp_path: Path) -> None:
    """verifiers 0.1.14's ``vf-eval`` loads the module by name, runs it in its env server, and
    saves each rollout's reward, final answer, stop condition and the reference's metric
    columns; once more (in-process, ``--disable-env-server``) with 0.1.14's
    ``sub_max_completion_tokens``, held by the fleet: the server returned at most the budget."""
    rows = _rows(tmp_path / "rows.jsonl", 2)
    results = vf_eval(legacy, fleet, tmp_path, {"rows_path": str(rows)}, 2)
    assert len(results) == 2
    for row in results:
        assert row["reward"] == 1.0 and row["stop_condition"] == "answer_ready", {k: row.get(k) for k in row}
        assert row["final_answer"] == row["answer"]
        assert row["root_llm_turns"] >= 1 and row["sub_llm_call_count"] >= 3
    spent = tmp_path / "budget"
    spent.mkdir()
    rows = _rows(spent / "rows.jsonl", 1, suffix=" [[mock:spend-all]]", min_chars=100_000)
    args = {"rows_path": str(rows), "sub_max_completion_tokens": BUDGET}
    (row,) = vf_eval(legacy, fleet, spent, args, 1, ("--disable-env-server",))
    _, served = _served(fleet, row["rlmq"]["rollout_id"])
    assert row["sub_llm_budget_limit"] == BUDGET and 0 < row["sub_llm_budget_charged"] == served <= BUDGET, row
    assert row["sub_llm_call_count"] + row["sub_llm_rejected_count"] >= 5 and row["sub_llm_rejected_count"] >= 1
