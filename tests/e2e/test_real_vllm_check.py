"""``bench/real_vllm.py``'s proxy and comparison against the scripted model in vLLM's shape.

The check a GPU machine runs against a real vLLM, run here against the scripted model (a test
double) behind the same logging proxy: a depth-2 tree with ``--include-sub-llm-in-trajectory
--weight-versions``
(``bench.real_vllm.run_tree``: embedded Redis, local workers hosting the children), then every turn
of ``trajectories.jsonl`` compared with the replies the proxy logged, element by element. The
proxy's log is the scripted model's own record of what it served; a weight-version label changed,
and a logprob changed by one float32 step, in the trajectories are found.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.real_vllm import LoggingProxy, compare, run_tree, served_turns
from rlmq.scripted.server import ScriptedModelServer
from tests.e2e.test_recursion import needle_data

pytestmark = pytest.mark.e2e


async def test_the_proxy_and_comparison_find_every_served_turn_of_a_depth_2_tree(tmp_path: Path) -> None:
    data, _ = needle_data(tmp_path, rows=2, split=2, lines=600)
    run_dir, log = tmp_path / "run", tmp_path / "proxy.jsonl"
    async with ScriptedModelServer() as server:
        proxy = LoggingProxy(server.url.removesuffix("/v1"), log)
        url = await proxy.start()
        try:
            extra = ["--weight-versions"]
            code = await asyncio.to_thread(run_tree, data, url, run_dir, 2, extra, tmp_path / "run.log")
        finally:
            await proxy.stop()
        served = server.served
    assert code == 0, (tmp_path / "run.log").read_text()[-3000:]
    logged = served_turns(log)
    assert [(list(k[0]), list(k[1]), lp, v) for k, (lp, v) in logged] == [
        (s["prompt_token_ids"], s["completion_token_ids"], s["completion_logprobs"], s["weight_versions"])
        for s in served
    ]  # the proxy logs what the server sent, unchanged
    result = compare(run_dir / "trajectories.jsonl", log)
    assert result.ok, result.problems
    assert {"root@1", "root@2", "sub@2"} <= set(result.roles) and result.matched == len(served) >= 10

    lines = (run_dir / "trajectories.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    leaf = next(e for e in record["trajectory"] if e.get("type") == "rlm_batch")["results"][0]["child"]["trajectory"]
    step = next(e for e in leaf if e.get("type") == "llm_batch")["results"][0]["steps"][0]
    step["weight_versions"][0]["version"] = "step-9"
    (run_dir / "trajectories.jsonl").write_text("\n".join([json.dumps(record), *lines[1:]]) + "\n")
    relabelled = compare(run_dir / "trajectories.jsonl", log)
    assert not relabelled.ok and relabelled.version_mismatches == 1 and "sub@2" in relabelled.problems[0]
    step["weight_versions"][0]["version"] = "step-0"
    step["completion_logprobs"][0] = float.fromhex(float(step["completion_logprobs"][0]).hex()) * (1 + 2**-23)
    (run_dir / "trajectories.jsonl").write_text("\n".join([json.dumps(record), *lines[1:]]) + "\n")
    spoiled = compare(run_dir / "trajectories.jsonl", log)
    assert not spoiled.ok and spoiled.logprob_mismatches == 1 and "sub@2" in spoiled.problems[0]
