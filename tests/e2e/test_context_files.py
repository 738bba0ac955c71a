"""The context as files through every path a row takes: ``rlmq run`` (a dataset row's ``info``,
through ``RLMEnv``), a child rollout on a REPL-hosting worker (its task's ``context``), and the
verifiers harness's row. The scripted model runs the code the questions carry; the embedded fleet
(Redis, workers hosting child rollouts) is real.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rlmq.cli.local import ProcessGroup, child_env, rlmq_command, start_mock_llm
from rlmq.scripted.server import root_code_directive

pytestmark = pytest.mark.e2e

RUN_DEADLINE = 150.0

CHILD_CODE = """
import os
answer["content"] = open("context.txt").read() + " / " + ",".join(sorted(os.listdir(".")))
answer["ready"] = True
"""

JSON_ROOT_CODE = """
import json, os
data = json.load(open("context.json"))
child = rlm_batch([{{"prompt": {child_prompt!r}, "context": "child sees " + data["needle"]}}])
answer["content"] = "|".join([",".join(sorted(os.listdir("."))), str(data == context), child[0]])
answer["ready"] = True
"""

DIR_ROOT_CODE = """
import os
files = sorted(os.path.relpath(os.path.join(r, n)) for r, _, ns in os.walk(".") for n in ns)
answer["content"] = ",".join(files) + "|" + open("notes/needle.txt").read().strip() + "|" + repr(context)
answer["ready"] = True
"""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_rows_info_reaches_the_repl_as_files_and_a_child_gets_its_task_context(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "notes").mkdir(parents=True)
    (corpus / "notes" / "needle.txt").write_text("the code is 4711\n")
    (corpus / "hay.txt").write_text("hay " * 50_000)  # 200 KB
    child_prompt = "child question " + root_code_directive(CHILD_CODE)
    docs = {"needle": "8088", "docs": [f"document {i} " + "word " * 200 for i in range(50)]}
    rows = [
        {
            "id": "json",
            "question": "Q " + root_code_directive(JSON_ROOT_CODE.format(child_prompt=child_prompt)),
            "context": "",
            "info": {"context": docs},
        },
        {
            "id": "dir",
            "question": "Q " + root_code_directive(DIR_ROOT_CODE),
            "context": "the row's own",
            "info": {"context_dir": str(corpus)},
        },
        {
            "id": "symlink",
            "question": "Q " + root_code_directive(DIR_ROOT_CODE),
            "context": "x",
            "info": {"context_dir": str(tmp_path / "linked")},
        },
    ]
    (tmp_path / "linked").symlink_to(corpus)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    group = ProcessGroup()
    try:
        base = start_mock_llm(group)
        argv = rlmq_command(
            "run", str(data), "--base-url", base, "--model", "scripted", "--max-depth", "2",
            "--run-dir", str(run_dir), "--quiet", "--workers", "1", "--max-startup-wait-seconds", "60",
        )  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_DEADLINE, env=child_env(), check=False)
    finally:
        group.stop()
    results = {r["id"]: r for r in read_jsonl(run_dir / "rows.jsonl")}
    assert results["json"]["stop_reason"] == "answer_ready", results["json"]
    assert results["json"]["final_answer"] == "context.json|True|child sees 8088 / context.txt"
    assert results["dir"]["stop_reason"] == "answer_ready", results["dir"]
    assert results["dir"]["final_answer"] == 'hay.txt,notes/needle.txt|the code is 4711|"the row\'s own"'
    assert results["symlink"]["stop_reason"] == "error"
    assert "context_dir cannot be a symlink" in (results["symlink"]["error"] or "")
    assert done.returncode != 0  # a rollout ended in error: the run says so
