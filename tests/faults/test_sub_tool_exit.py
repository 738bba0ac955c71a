"""A sub-LLM tool (``sub_tools``, or an author's shared ``tools``) that calls ``sys.exit`` on
arguments the sub-LLM chose fails that tool call, not the worker: a real worker process, a real
Redis, the scripted model asking for the tool with flags argparse refuses."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from rlmq.cli.local import LocalFleet
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import root_code_directive

TOOL_MODULE = '''
import argparse


def search(flags: str) -> str:
    """Search the index with command-line flags.

    Args:
        flags: the flags, as ``--k 3``.
    """
    parser = argparse.ArgumentParser(prog="search")
    parser.add_argument("--k", type=int)
    return str(parser.parse_args(flags.split()).k)
'''
TOOL = "rlmq_flag_tool:search"
PROMPT = '[[mock:tool:search:{"flags": "--k many"}]] [[mock:echo-tool-result]] Which k? The k is 3.'
CELL = f"import json\nanswer['content'] = json.dumps(llm_batch([{PROMPT!r}]))\nanswer['ready'] = True"


async def test_a_sub_tool_calling_sys_exit_fails_the_tool_call_and_the_worker_lives_on(
    redis_url: str, tmp_path: Path
) -> None:
    (tmp_path / "rlmq_flag_tool.py").write_text(TOOL_MODULE)
    with LocalFleet(
        redis_url=redis_url,
        model=f"sub-tool-exit-{uuid.uuid4().hex[:6]}",
        workers=1,
        worker_args=["--allow-tool", TOOL],
        worker_env={"PYTHONPATH": str(tmp_path)},
        log_dir=str(tmp_path / "logs"),
    ) as fleet:
        settings = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model)
        row = DatasetRow(id="exit", question="Exit. " + root_code_directive(CELL), context="x")
        async with RLMEnv(settings=settings.with_overrides(sub_call_timeout=30), sub_tools=[TOOL]) as env:
            res = await env.rollout(row, model=fleet.model)
            exited = [(p.args, p.returncode) for p in fleet.group.procs if p.poll() is not None]
            assert exited == [], "a worker (or the model server) exited"
    assert res.row.stop_reason == "answer_ready", res.row.error
    (result,) = json.loads(str(res.row.final_answer))
    assert "tool result: [tool error] search: SystemExit: 2" in result, result
