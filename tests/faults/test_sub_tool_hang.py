"""A sub-LLM tool that never returns must not keep its worker from stopping: a real worker
process, a real Redis, the scripted model asking for the tool, SIGTERM while the tool hangs."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

from rlmq.cli.local import LocalFleet
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import root_code_directive

TOOL_MODULE = '''
import pathlib
import time


def hang(text: str) -> str:
    """Never return.

    Args:
        text: where to say it started.
    """
    pathlib.Path(text).write_text("started")
    time.sleep(3600)
    return text
'''
TOOL = "rlmq_hang_tool:hang"


async def test_a_worker_whose_sub_tool_hangs_still_stops_on_sigterm(redis_url: str, tmp_path: Path) -> None:
    (tmp_path / "rlmq_hang_tool.py").write_text(TOOL_MODULE)
    marker = tmp_path / "started"
    prompt = f'[[mock:tool:hang:{{"text": "{marker}"}}]] Which? The code is 1.'
    cell = f"answer['content'] = str(llm_batch([{prompt!r}]))\nanswer['ready'] = True"
    fleet = LocalFleet(
        redis_url=redis_url,
        model=f"sub-tool-hang-{uuid.uuid4().hex[:6]}",
        workers=1,
        worker_args=["--allow-tool", TOOL],
        worker_env={"PYTHONPATH": str(tmp_path)},
        log_dir=str(tmp_path / "logs"),
        worker_grace=2,  # in-flight sub-calls are handed back after 2 s; SIGKILL 5 s later
    )
    fleet.start()
    try:
        procs = list(fleet.group.procs)
        settings = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model)
        async with RLMEnv(settings=settings, sub_tools=[TOOL]) as env:
            row = DatasetRow(id="hang", question="Hang. " + root_code_directive(cell), context="x")
            rollout = asyncio.ensure_future(env.rollout(row, model=fleet.model))
            deadline = time.monotonic() + 60
            while not marker.exists():  # the worker's tool has started and now hangs
                assert time.monotonic() < deadline and not rollout.done()
                await asyncio.sleep(0.05)
            fleet.stop()  # SIGTERM; SIGKILL only past the workers' grace and 5 s
            rollout.cancel()
            await asyncio.gather(rollout, return_exceptions=True)
    finally:
        fleet.stop()
    codes = [p.returncode for p in procs]
    assert -9 not in codes, codes  # none had to be killed: the hung tool's thread held the exit of none
