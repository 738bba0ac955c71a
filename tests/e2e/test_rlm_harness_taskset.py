"""A verifiers 0.4 Taskset written for the ``rlm`` harness runs under ``harness.id rlmq``.

``tests/e2e/rlm_taskset/``: a taskset module with its own scorer and the TOML that runs it with
verifiers' ``rlm`` harness and that harness's keys. The test changes only the harness id to
``rlmq`` and runs ``vf-eval @ <toml>`` on real workers, a real Redis and the scripted model
(a test double) behind the recording proxy of ``test_verifiers.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlmq.cli.demo import needle_rows
from rlmq.cli.local import child_env
from tests.e2e.test_verifiers import VF_EVAL, Setup, proxied_fleet

pytestmark = pytest.mark.e2e

TASKSET = Path(__file__).resolve().parent / "rlm_taskset"


@pytest.fixture(scope="module")
def setup(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """The scripted model behind the recording proxy; two workers that also host child rollouts."""
    logs = tmp_path_factory.mktemp("rlm-taskset-logs")
    with proxied_fleet(redis_url, logs, f"rlm-keys-{uuid.uuid4().hex[:6]}", repl_slots=4) as made:
        yield made


def _config_for_rlmq(tmp: Path) -> Path:
    """The taskset's TOML with its harness id changed, and nothing else."""
    text = (TASKSET / "needle_rlm.toml").read_text()
    changed = text.replace('[env.agent.harness]\nid = "rlm"\n', '[env.agent.harness]\nid = "rlmq"\n')
    assert sum(a != b for a, b in zip(text.splitlines(), changed.splitlines(), strict=True)) == 1
    path = tmp / "needle_rlmq.toml"
    path.write_text(changed)
    return path


def _strings(value: Any) -> Iterator[str]:
    """Every string inside a JSON value (the trace's recorded messages)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _run(setup: Setup, tmp: Path, config: Path, rows: Path) -> tuple[list[dict[str, Any]], str]:
    argv = [
        str(VF_EVAL), "@", str(config), "--env.taskset.path", str(rows), "-m", setup.fleet.model,
        "--client.base-url", setup.proxy.url, "--no-push", "--no-rich", "-o", str(tmp / "out"), "--run.name", "run",
    ]  # fmt: skip
    env = child_env({"REDIS_URL": setup.redis_url})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TASKSET), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"vf-eval exited {proc.returncode}\n{proc.stderr[-5000:]}"
    lines = (tmp / "out" / "run" / "traces.jsonl").read_text().splitlines()
    traces = [t for line in lines if line.strip() for t in json.loads(line)["traces"]]
    return traces, proc.stderr


def test_a_taskset_for_the_rlm_harness_runs_under_rlmq_with_only_the_id_changed(setup: Setup, tmp_path: Path) -> None:
    """The taskset's own reward scores each rollout 1.0; ``max_depth = 1`` gives one level of
    child rollouts, ``max_total_tokens`` is the tree's hard budget, the taskset's system prompt
    and ``append_to_system_prompt`` reach the root model after rlmq's scaffold, and the keys with
    no counterpart are named."""
    rows = needle_rows(2, min_chars=60_000, seed=11)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = len(setup.proxy.requests())
    traces, stderr = _run(setup, tmp_path, _config_for_rlmq(tmp_path), path)
    assert len(traces) == 2
    for trace in traces:
        metrics, info = trace["metrics"], trace["info"]["rlmq"]
        assert trace["rewards"]["passphrase_found"]["score"] == 1.0, (info["final_answer"], metrics)
        assert "reply_chars" in metrics
        assert metrics["tree_depth"] == 2 and metrics["rlm_call_count"] >= 2, metrics
        assert metrics["sub_llm_budget_limit"] == 40_000 and 0 < metrics["tree_charged_completion_tokens"] <= 40_000
        systems = [t for t in _strings(trace["nodes"]) if "[[harness-append]]" in t]
        assert systems, "the root model never saw append_to_system_prompt"
        for text in systems:
            assert (
                0
                <= text.index("llm_batch")
                < text.index("[[taskset-system-prompt]]")
                < text.index("[[harness-append]]")
            )
    seen = setup.proxy.requests()[before:]
    assert seen, "no request reached the model server"
    for key in ("max_subagent_calls", "builtin_skills"):
        assert stderr.count(f"the rlm key '{key}' has no effect here") >= 1, stderr[-3000:]


def test_the_taskset_config_is_valid_for_the_rlm_harness_itself(tmp_path: Path) -> None:
    """The TOML is a real ``rlm`` harness config: verifiers validates it against its own
    ``RLMHarnessConfig`` (``--dry-run`` resolves and checks the config, runs nothing)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(needle_rows(1, min_chars=1_000)[0]) + "\n")
    env = child_env({})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TASKSET), env.get("PYTHONPATH", "")) if p)
    argv = [str(VF_EVAL), "@", str(TASKSET / "needle_rlm.toml"), "--env.taskset.path", str(rows), "--dry-run"]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (resolved,) = tmp_path.glob("outputs/*/configs/resolved/eval.json")
    harness = json.loads(resolved.read_text())["env"]["agent"]["harness"]
    assert harness["id"] == "rlm" and harness["max_depth"] == 1 and harness["max_total_tokens"] == 40000
    assert harness["append_to_system_prompt"].endswith("[[harness-append]]")
