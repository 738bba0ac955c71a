"""What trainable turns cost: ``include_sub_llm_in_trajectory`` off and on, side by side in one run.

Real ``rlmq worker`` processes, an embedded Redis, the scripted model (a test double that serves
vLLM's token fields), rollouts through ``RLMEnv`` in this process. Each rollout makes one
``llm_batch`` of ``--calls`` sub-calls with ``--prompt-tokens``-token prompts; each sub-call takes
two model turns (a sub-tool call, then its answer), so its second turn's prompt repeats the first.
For each mode, after the same warm-up, it measures:

* bytes into and out of Redis per sub-call (``INFO stats`` ``total_net_input_bytes`` /
  ``total_net_output_bytes``: job payloads, reply streams, spilled payloads, everything);
* Redis ``used_memory`` before the mode, at its peak (sampled) and after it;
* sub-calls per second (wall time of the rollouts);
* the token payload kept per sub-call in the trajectory (base64 bytes).

Run: ``python -m bench.trainable [--rollouts 4] [--calls 16] [--prompt-tokens 8000]``; prints a
table and saves ``bench/results/trainable.json``. Nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from typing import Any

import redis

from bench.harness import RESULTS_DIR, machine, save_json, say
from rlmq.cli.local import LocalFleet
from rlmq.common.redis_server import EmbeddedRedis
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import root_code_directive

TOOL = "rlmq.workers.tools.count_words"


def code(calls: int, words: int) -> str:
    """The root's one cell: ``calls`` sub-prompts of ``words`` words, each calling a sub-tool once."""
    return f"""
body = " ".join("w%d" % (i % 5000) for i in range({words}))
tool = '[[mock:tool:count_words:{{"text": "a b c"}}]] '
out = llm_batch([tool + "part %d " % k + body for k in range({calls})])
answer["content"] = str(len(out))
answer["ready"] = True
"""


async def mode(fleet: LocalFleet, r: redis.Redis, on: bool, rollouts: int, calls: int, words: int) -> dict[str, Any]:
    settings = load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model)
    row = DatasetRow(id="t", question="Count. " + root_code_directive(code(calls, words)), context="x")
    before = r.info("stats")
    mem0 = int(r.info("memory")["used_memory"])
    peak = mem0
    async with RLMEnv(
        settings=settings, include_sub_llm_in_trajectory=on, sub_tools=[TOOL], max_sub_llm_parallelism=calls,
        sub_call_timeout=120,
    ) as env:  # fmt: skip
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(env.rollout(row, model=fleet.model, rollout_id=f"tb-{uuid.uuid4().hex[:10]}"))
                 for _ in range(rollouts)]  # fmt: skip
        while not all(t.done() for t in tasks):
            peak = max(peak, int(r.info("memory")["used_memory"]))
            await asyncio.sleep(0.05)
        seconds = time.perf_counter() - t0
        results = [t.result() for t in tasks]
    after = r.info("stats")
    n = rollouts * calls
    kept = 0
    for res in results:
        assert res.row.stop_reason == "answer_ready", res.row.error
        for ev in res.trajectory:
            for x in ev.get("results", []) if ev.get("type") == "llm_batch" else []:
                kept += sum(
                    len(t["prompt"]) + len(t["completion"]) + len(t["logprobs"]) for t in x.get("turn_tokens") or []
                )
    return {
        "include_sub_llm_in_trajectory": on,
        "sub_calls": n,
        "bytes_in_per_sub_call": round((after["total_net_input_bytes"] - before["total_net_input_bytes"]) / n),
        "bytes_out_per_sub_call": round((after["total_net_output_bytes"] - before["total_net_output_bytes"]) / n),
        "token_payload_kept_per_sub_call": round(kept / n),
        "redis_used_memory_before": mem0,
        "redis_used_memory_peak": peak,
        "redis_used_memory_after": int(r.info("memory")["used_memory"]),
        "seconds": round(seconds, 3),
        "sub_calls_per_second": round(n / seconds, 1),
        "trainable_turns": sum(int(res.row.metrics.get("trainable_turn_count", 0)) for res in results),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    server = EmbeddedRedis().start()
    try:
        with LocalFleet(
            redis_url=server.url, model=f"bench-train-{uuid.uuid4().hex[:6]}", workers=args.workers,
            worker_concurrency=256, worker_args=["--allow-tool", TOOL],
        ) as fleet:  # fmt: skip
            fleet.wait_for_workers(args.workers)
            r = redis.Redis.from_url(server.url)
            await mode(fleet, r, False, 1, 2, 100)  # warm-up (imports, connections)
            rows = []
            for _ in range(args.repeats):
                for on in (False, True):
                    rows.append(await mode(fleet, r, on, args.rollouts, args.calls, args.prompt_tokens))
                    say(json.dumps(rows[-1]))
            leftovers = len(list(r.scan_iter("rlmq:*:spill:*")))
            r.close()
    finally:
        server.stop()
    return {"bench": "trainable", "machine": machine(), "args": vars(args), "rows": rows, "spill_keys_left": leftovers}


def main() -> None:
    """Parse the flags, run both modes, print the table and save the JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--calls", type=int, default=16, help="sub-calls per rollout")
    p.add_argument("--prompt-tokens", type=int, default=8000, help="words (the scripted model's tokens) per prompt")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "trainable"))
    args = p.parse_args()
    doc = asyncio.run(main_async(args))
    cols = [
        "include_sub_llm_in_trajectory", "bytes_in_per_sub_call", "bytes_out_per_sub_call",
        "token_payload_kept_per_sub_call", "redis_used_memory_peak", "redis_used_memory_after", "sub_calls_per_second",
    ]  # fmt: skip
    print(" | ".join(cols))
    for row in doc["rows"]:
        print(" | ".join(str(row[c]) for c in cols))
    print(f"spill keys left in Redis: {doc['spill_keys_left']}")
    print("saved", save_json(doc, args.out))


if __name__ == "__main__":
    main()
