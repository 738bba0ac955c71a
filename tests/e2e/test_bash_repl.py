"""The bash REPL end to end (``RLMEnv(repl_language="bash")``): the scripted model writes bash,
real workers answer its ``llm_batch``, a root tool runs in the producer as a command, and the
answer comes back through ``ANSWER_CONTENT`` / ``ANSWER_READY``."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlmq.cli.local import LocalFleet, ProcessGroup, child_env, rlmq_command, start_mock_llm
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import Settings, load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import root_code_directive

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    logs = tmp_path_factory.mktemp("bash-logs")
    with LocalFleet(redis_url=redis_url, model=f"bash-{uuid.uuid4().hex[:6]}", workers=1, log_dir=str(logs)) as f:
        yield f


def settings_of(fleet: LocalFleet) -> Settings:
    return load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model)


def lookup(key: str, depth: int = 1) -> dict[str, Any]:
    """Look a vault up in the index."""
    return {"vault": key, "depth": depth, "pid": os.getpid()}


CELL = """
vault=$(lookup ORCHID 3)
sub=$(llm_batch "Text: The vault code is 48213.
Question: What is the vault code?" 2>/dev/null)
boxed=$(llm_batch 'Text: The final figure is \\boxed{7}.
Question: What is the final figure?' 2>/dev/null)
echo "$vault" > found.json
export ANSWER_CONTENT="{\\"vault\\": $vault, \\"sub\\": $sub, \\"boxed\\": $boxed, \\"pwd\\": \\"$(basename $PWD)\\"}"
export ANSWER_READY=1
"""


async def test_a_bash_rollout_with_a_root_tool_and_real_workers(fleet: LocalFleet) -> None:
    row = DatasetRow(id="bash", question="Q " + root_code_directive(CELL), context="the haystack")
    async with RLMEnv(settings=settings_of(fleet), repl_language="bash", root_tools=[lookup]) as env:
        res = await env.rollout(row, model=fleet.model)
    assert res.row.stop_reason == "answer_ready", (res.row.error, res.trajectory)
    got = json.loads(str(res.row.final_answer))
    assert got["vault"] == {"vault": "ORCHID", "depth": 3, "pid": os.getpid()}  # ran here, in the producer
    assert got["sub"] == ["48213"]  # a sub-LLM on the worker read the prompt
    assert got["boxed"] == ["7"]  # its "\\boxed{7}": the boxed content, as the reference's llm_batch
    m = res.row.metrics
    assert m["root_tool_call_count"] == 3 and m["lookup_root_calls"] == 1 and m["sub_llm_call_count"] == 2
    system = res.messages[0]["content"]
    assert "call_bash_repl" in system and "ANSWER_READY" in system and "`context.txt`" in system
    assert "commands in the REPL" in system and "lookup" in system


async def test_the_scripted_models_own_bash_strategy_finds_the_needle(fleet: LocalFleet) -> None:
    hay = " ".join(f"Line {i} is filler text about nothing." for i in range(400))
    context = hay + " The secret password is TANGERINE. " + hay
    row = DatasetRow(id="needle", question="What is the secret password?", context=context)
    async with RLMEnv(settings=settings_of(fleet), repl_language="bash") as env:
        res = await env.rollout(row, model=fleet.model)
    assert res.row.stop_reason == "answer_ready", (res.row.error, res.trajectory)
    assert res.row.final_answer == "TANGERINE"
    assert res.trajectory[1]["type"] == "cell" or any(e.get("type") == "cell" for e in res.trajectory)


CHILD_BASH = """
export ANSWER_CONTENT="child:$(cat context.txt)"; export ANSWER_READY=1
"""

ROOT_BASH = """
note=$(cat notes/needle.txt)
tasks=$(printf '{"tasks": [{"prompt": "%s", "context": "%s"}]}' "$CHILD_PROMPT" "$note")
out=$(rlm_batch --json "$tasks" 2>/dev/null)
export ANSWER_CONTENT="$(ls | tr '\\n' ' ')| $out"; export ANSWER_READY=1
"""


def test_rlmq_run_in_bash_with_a_context_dir_and_a_child_rollout(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "notes").mkdir(parents=True)
    (corpus / "notes" / "needle.txt").write_text("code 4711")
    child_prompt = "child " + root_code_directive(CHILD_BASH)
    code = f"CHILD_PROMPT={shlex.quote(child_prompt)}\n" + ROOT_BASH
    rows = [
        {
            "id": "bash",
            "question": "Q " + root_code_directive(code),
            "context": "",
            "info": {"context_dir": str(corpus)},
        }
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    group = ProcessGroup()
    try:
        base = start_mock_llm(group)
        argv = rlmq_command(
            "run", str(data), "--base-url", base, "--model", "scripted", "--max-depth", "2", "--repl-language", "bash",
            "--run-dir", str(run_dir), "--quiet", "--workers", "1", "--max-startup-wait-seconds", "60",
        )  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=150, env=child_env(), check=False)
    finally:
        group.stop()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (result,) = [json.loads(line) for line in (run_dir / "rows.jsonl").read_text().splitlines() if line.strip()]
    assert result["stop_reason"] == "answer_ready", result
    assert result["final_answer"] == 'notes | ["child:code 4711"]'


HISTORY_PY = """
import json
history = [json.loads(line) for line in open(".messages")]
answer["content"] = ",".join(m["role"] for m in history) + "|" + str("call_python_repl" in json.dumps(history[-1]))
answer["ready"] = True
"""

HISTORY_BASH = """
export ANSWER_CONTENT="$(wc -l < .messages) $(head -1 .messages | grep -c '"role": "system"')"
export ANSWER_READY=1
"""


@pytest.mark.parametrize("language", ["python", "bash"])
async def test_expose_message_history_writes_the_conversation_before_each_cell(
    fleet: LocalFleet, language: str
) -> None:
    code = (
        [root_code_directive("print('first')", 1), root_code_directive(HISTORY_PY, 2)]
        if language == "python"
        else [root_code_directive("echo first", 1), root_code_directive(HISTORY_BASH, 2)]
    )
    row = DatasetRow(id="hist", question="Q " + " ".join(code), context="c")
    async with RLMEnv(settings=settings_of(fleet), repl_language=language, expose_message_history=True) as env:
        res = await env.rollout(row, model=fleet.model)
    assert res.row.stop_reason == "answer_ready", (res.row.error, res.trajectory)
    # system, user, assistant (turn 1), tool (its output), assistant (turn 2, whose cell reads the file)
    if language == "python":
        assert res.row.final_answer == "system,user,assistant,tool,assistant|True"
    else:
        assert res.row.final_answer == "5 1"
    assert ".messages" in res.messages[0]["content"]
    async with RLMEnv(settings=settings_of(fleet), repl_language=language) as env:  # off: no file, not told
        off = await env.rollout(row, model=fleet.model)
    assert ".messages" not in off.messages[0]["content"]
    cells = [e["output"] for e in off.trajectory if e["type"] == "cell"]
    assert "No such file" in cells[1], cells


@pytest.mark.parametrize("language", ["python", "bash"])
async def test_retain_filesystem_after_rollout_copies_the_working_directory_out(
    fleet: LocalFleet, language: str
) -> None:
    code = (
        "import os\nos.mkdir('out')\nopen('out/result.txt', 'w').write('kept ' * 1000)\n"
        "os.symlink('/etc/passwd', 'link')\n"
        "answer['content'] = 'ok'\nanswer['ready'] = True"
        if language == "python"
        else "mkdir out; yes kept | head -1000 > out/result.txt; ln -s /etc/passwd link; mkfifo pipe\n"
        "export ANSWER_CONTENT=ok ANSWER_READY=1"
    )
    row = DatasetRow(id="keep", question="Q " + root_code_directive(code), context="the input")
    async with RLMEnv(settings=settings_of(fleet), repl_language=language, retain_filesystem_after_rollout=True) as env:
        res = await env.rollout(row, model=fleet.model)
    assert res.row.stop_reason == "answer_ready", (res.row.error, res.trajectory)
    (event,) = [e for e in res.trajectory if e["type"] == "files"]
    kept = Path(event["path"])
    try:
        assert (kept / "context.txt").read_text() == "the input"
        assert len((kept / "out" / "result.txt").read_text()) == 5000
        assert (kept / "link").is_symlink() and os.readlink(kept / "link") == "/etc/passwd"  # a link, not a copy
        assert not (kept / "pipe").exists()  # a pipe is left out, never opened
    finally:
        shutil.rmtree(kept)
    async with RLMEnv(settings=settings_of(fleet), repl_language=language) as env:
        plain = await env.rollout(row, model=fleet.model)
    assert not [e for e in plain.trajectory if e["type"] == "files"]
