"""Small batches on the lane: wasted model calls at mixed load, and light-load latency against model latency.

``python -m bench.lane [--quick]``

Two measurements, each against a private ``redis-server`` (``rlmq.common.redis_server.EmbeddedRedis``)
and the scripted model (``rlmq mock-llm``, a test double) on 127.0.0.1, with ``rlmq worker``
processes (``rlmq.cli.local.LocalFleet``):

* **waste**: rollouts at once × prompts per batch, all batches small enough for the lane
  (a batch of up to 8 goes to the most recently idle worker, whose call may start before its
  ``START`` answers; a busy worker taking the same job in between costs one wasted model
  call). Wasted calls = the model server's own request count minus the sub-calls answered.
* **latency**: one prompt at a time, a direct call (``rlmq.workers.model.ChatClient``) and a
  one-prompt ``llm_batch`` through rlmq alternating, with the model answering after 0, 10 and
  50 ms: how much rlmq adds as the processes idle longer between hops.

Prints a table and writes ``bench/results/lane.json``. Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from typing import Any

from rlmq.cli.local import LocalFleet
from rlmq.common import keys as K
from rlmq.common.aio import run as run_loop
from rlmq.common.redis_server import EmbeddedRedis

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "lane.json")
MODEL = "bench-lane"
LOGS = os.path.join(tempfile.gettempdir(), "rlmq-bench-logs")


def model_requests(base_url: str) -> int:
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/stats", timeout=10) as resp:
        return int(json.load(resp)["requests"])


async def waste(redis_url: str, base_url: str, rollouts: int, batch: int, calls: int) -> dict[str, Any]:
    from rlmq.common.connection import async_client
    from rlmq.common.schemas import SubCallOptions
    from rlmq.producer.dispatch import BatchSpec, Dispatcher

    redis = async_client(redis_url)
    dispatcher = Dispatcher(redis)
    queue = K.queue_name_for_model(MODEL)
    answered = 0

    async def rollout(r: int) -> None:
        nonlocal answered
        for b in range(max(1, calls // (rollouts * batch))):
            spec = BatchSpec(
                rollout_id=f"w{rollouts}x{batch}r{r}", batch_id=f"b{b}", call=SubCallOptions(model=MODEL),
                queue=queue, sub_call_timeout=60, parallelism=batch,
            )  # fmt: skip
            res = await dispatcher.run_batch(spec, [f"Who has key {r}.{b}.{i}? Ada has it." for i in range(batch)])
            answered += sum(x.status == "ok" for x in res)

    before = await asyncio.to_thread(model_requests, base_url)
    t0 = time.perf_counter()
    await asyncio.gather(*(rollout(r) for r in range(rollouts)))
    wall = time.perf_counter() - t0
    requests = await asyncio.to_thread(model_requests, base_url) - before
    await redis.aclose()
    return {"rollouts": rollouts, "batch": batch, "answered": answered, "model_requests": requests,
            "wasted": requests - answered, "calls_per_s": answered / wall}  # fmt: skip


async def latency(redis_url: str, base_url: str, rounds: int) -> dict[str, Any]:
    from rlmq.common.connection import async_client
    from rlmq.common.schemas import SubCallOptions
    from rlmq.producer.dispatch import BatchSpec, Dispatcher
    from rlmq.workers.model import ChatClient

    chat = ChatClient(base_url, "bench", retries=0)
    redis = async_client(redis_url)
    dispatcher = Dispatcher(redis)
    queue = K.queue_name_for_model(MODEL)
    direct: list[float] = []
    through: list[float] = []
    for i in range(rounds):
        t = time.perf_counter()
        await chat.chat(model=MODEL, messages=[{"role": "user", "content": "Who has the key? Ada."}], max_tokens=16)
        direct.append(time.perf_counter() - t)
        spec = BatchSpec(rollout_id="lat", batch_id=f"b{i}{time.time_ns()}", call=SubCallOptions(model=MODEL),
                         queue=queue, sub_call_timeout=60, parallelism=1)  # fmt: skip
        t = time.perf_counter()
        await dispatcher.run_batch(spec, ["Who has the key? Ada."])
        through.append(time.perf_counter() - t)
    await chat.close()
    await redis.aclose()
    skip = rounds // 10  # warm-up
    d, r = direct[skip:], through[skip:]
    diffs = sorted(y - x for x, y in zip(d, r, strict=True))
    return {
        "direct_p50_ms": statistics.median(d) * 1000,
        "rlmq_p50_ms": statistics.median(r) * 1000,
        "added_p50_ms": (statistics.median(r) - statistics.median(d)) * 1000,
        "per_round_added_p50_ms": diffs[len(diffs) // 2] * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lane", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller runs (about 30 s)")
    a = p.parse_args(argv)
    calls, rounds = (800, 100) if a.quick else (4000, 400)
    doc: dict[str, Any] = {"command": "python -m bench.lane" + (" --quick" if a.quick else ""),
                           "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "waste": [], "latency": []}  # fmt: skip
    redis_server = EmbeddedRedis().start()
    try:
        for workers in (2, 4):
            with LocalFleet(redis_url=redis_server.url, model=MODEL, workers=workers, log_dir=LOGS) as fleet:
                for rollouts, batch in ((1, 1), (4, 1), (32, 8), (64, 2)):
                    row = run_loop(waste(str(fleet.redis_url), str(fleet.base_url), rollouts, batch, calls))
                    row["workers"] = workers
                    doc["waste"].append(row)
                    print(f"waste: {workers} workers, {rollouts:2d} rollouts x {batch} prompts: "
                          f"{row['answered']} answered, {row['model_requests']} model requests, "
                          f"{row['wasted']} wasted ({row['calls_per_s']:.0f} calls/s)", flush=True)  # fmt: skip
        for delay in (0.0, 0.01, 0.05):
            with LocalFleet(redis_url=redis_server.url, model=MODEL, workers=2, mock_latency=delay,
                            log_dir=LOGS) as fleet:  # fmt: skip
                row = run_loop(latency(str(fleet.redis_url), str(fleet.base_url), rounds))
            row["model_latency_ms"] = delay * 1000
            doc["latency"].append(row)
            print(f"latency: model {delay * 1000:3.0f} ms: direct p50 {row['direct_p50_ms']:.2f} ms, "
                  f"rlmq p50 {row['rlmq_p50_ms']:.2f} ms, added p50 {row['added_p50_ms']:.2f} ms "
                  f"(per round {row['per_round_added_p50_ms']:.2f})", flush=True)  # fmt: skip
    finally:
        redis_server.stop()
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as fh:
        json.dump(doc, fh, indent=2)
    print(f"saved {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
