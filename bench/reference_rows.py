"""Measured reasons for two rows of docs/verifiers-rlmenv.md: ``max_sub_llm_parallelism`` and ``sub_call_timeout``.

``python -m bench.reference_rows [--quick]`` (about 3 minutes; ``--quick`` under 1 minute)

Against a private ``redis-server`` (``rlmq.common.redis_server.EmbeddedRedis``), the scripted model
(``rlmq mock-llm``, a test double) and real ``rlmq worker`` processes (``rlmq.cli.local.LocalFleet``),
all on 127.0.0.1. Batches go through the producer's :class:`~rlmq.producer.dispatch.Dispatcher`, as
``llm_batch`` sends them. Every sub-call is paced like a real model: ``[[mock:tokens:200-400]]
[[mock:tps:100]]`` answers in 200-400 tokens decoded at 100 tokens/s, so 2-4 s a call (``--quick``:
100-200 tokens, 1-2 s). A prompt's length is drawn from its text, so the same prompts take the same
time in every case.

* **parallelism** (one rollout, a fleet of 2 workers x 64, never the bottleneck):

  - one ``llm_batch`` of 40 prompts (``--quick``: 20) at parallelism 5 (the reference's
    semaphore per batch; rlmq with ``max_sub_llm_parallelism=5`` runs one batch the same way) and
    at rlmq's default 64, back to back;
  - the same prompts as 4 batches of 10 (``--quick``: 2) issued one after another, the root's
    usual shape: 5 per batch against 64 per rollout;
  - the same batches issued at once (threads in the REPL): the reference's semaphore is per
    batch (4 x 5 = 20 in flight), rlmq's bound is per rollout across its batches (64; and, in the
    full run only, 5 when set to 5).

  Reports each case's wall time, the most calls the model server saw at once, and the ratios.
* **timeout** (a busy shared fleet: 2 workers x 8 = 16 slots, ``--quick`` 2 x 4): rollouts at
  once, each one ``llm_batch`` of 16 prompts at the default parallelism, so that 2x, 4x and 8x the
  fleet's slots are asked for at once. Per call: the model time (the worker's ``seconds``, from
  taking the job to its result) and the enqueue-to-result time (the worker's
  ``queue_wait_seconds`` + ``seconds``; the result's trip back adds milliseconds). The batches'
  own deadline is set far out so no call fails; the bench counts the calls that *would* have.

  The comparison: the reference bounds each sub-LLM HTTP call by 115 s and has no queue (a call
  goes straight to the server); rlmq bounds each model HTTP attempt by ``model_timeout`` (120 s)
  and the whole sub-call, queue wait included, by ``sub_call_timeout`` (300 s). Take the bench's
  longest model call as a call at its limit (120 s) and scale every bound by the same factor
  (``longest model call / 120 s``): the reference's 115 s becomes 0.958 x the longest model call,
  rlmq's 300 s becomes 2.5 x. Counted: the calls whose enqueue-to-result exceeds each scaled bound;
  and the bound that would have failed none, scaled back (the longest enqueue-to-result x 120 s /
  the longest model call).
  The scripted model does not slow under load (the fleet's slots are the scarce resource, as a
  fleet sized to its model servers makes them); a saturated model server would lengthen the model
  time itself, which both sides' per-HTTP bounds then cover.

Prints the figures and writes ``bench/results/reference_rows.json`` (``reference_rows_quick.json``).
Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.request
import uuid
from typing import Any

from bench.harness import machine, pct, save_json
from rlmq.cli.local import LocalFleet
from rlmq.common import keys as K
from rlmq.common.aio import run as run_loop
from rlmq.common.connection import async_client
from rlmq.common.redis_server import EmbeddedRedis
from rlmq.common.schemas import SubCallOptions, SubLLMResult
from rlmq.common.settings import setting_default
from rlmq.producer.dispatch import BatchSpec, Dispatcher
from rlmq.producer.inflight import RolloutInFlight

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LOGS = os.path.join(tempfile.gettempdir(), "rlmq-bench-logs")
REFERENCE_PARALLELISM = 5
"""verifiers 0.1.14 ``RLMEnv(max_sub_llm_parallelism=5)``: a semaphore per ``llm_batch``."""
REFERENCE_CALL_TIMEOUT = 115.0
"""verifiers 0.1.14: ``max(1, code_execution_timeout - 5)`` seconds per sub-LLM HTTP call."""
FAR = 3600.0
"""The batches' own deadline in the timeout part: far enough that no call fails."""


def prompts(n: int, tag: str, tokens: str) -> list[str]:
    """``n`` sub-LLM prompts paced by ``tokens`` (e.g. ``200-400``) at 100 tokens/s."""
    return [f"Summarise section {i} of report {tag}. [[mock:tokens:{tokens}]] [[mock:tps:100]]" for i in range(n)]


def model_stats(base_url: str, *, reset: bool = False) -> dict[str, Any]:
    """The scripted model's counters (``GET /stats``); ``reset``: zero them first (``DELETE``)."""
    root = base_url.removesuffix("/v1")
    if reset:
        urllib.request.urlopen(urllib.request.Request(root + "/stats", method="DELETE"), timeout=10).close()
    with urllib.request.urlopen(root + "/stats", timeout=10) as resp:
        stats: dict[str, Any] = json.load(resp)
    return stats


def spec_for(
    model: str, rollout: str, batch: str, parallelism: int, timeout: float, inflight: RolloutInFlight | None = None
) -> BatchSpec:
    """A batch of ``rollout`` as ``llm_batch`` builds it (``inflight``: the rollout's count across batches)."""
    return BatchSpec(
        rollout_id=rollout, batch_id=batch, queue=K.queue_name_for_model(model), sub_call_timeout=timeout,
        parallelism=parallelism, call=SubCallOptions(model=model), inflight=inflight,
    )  # fmt: skip


async def timed_batches(
    fleet: LocalFleet, batches: list[list[str]], parallelism: int, *, at_once: bool, shared: bool
) -> dict[str, Any]:
    """Run ``batches`` of one rollout (one after another, or ``at_once``); wall time and peak in flight.

    ``shared``: the rollout's count bounds all its batches together (rlmq); else each batch has its
    own bound (the reference's semaphore per batch).
    """
    redis = async_client(str(fleet.redis_url))
    dispatcher = Dispatcher(redis)
    rollout = f"par-{uuid.uuid4().hex[:10]}"
    inflight = RolloutInFlight(parallelism) if shared else None
    specs = [spec_for(fleet.model, rollout, f"b{i}", parallelism, 600, inflight) for i in range(len(batches))]
    await asyncio.to_thread(model_stats, str(fleet.base_url), reset=True)
    t0 = time.perf_counter()
    try:
        if at_once:
            done = await asyncio.gather(*(dispatcher.run_batch(s, b) for s, b in zip(specs, batches, strict=True)))
            results = [r for rs in done for r in rs]
        else:
            results = []
            for s, b in zip(specs, batches, strict=True):
                results += await dispatcher.run_batch(s, b)
        wall = time.perf_counter() - t0
    finally:
        await redis.aclose()
    stats = await asyncio.to_thread(model_stats, str(fleet.base_url))
    return {
        "batches": len(batches),
        "prompts": sum(len(b) for b in batches),
        "parallelism": parallelism,
        "bound": "per rollout" if shared else "per batch",
        "at_once": at_once,
        "wall_s": round(wall, 2),
        "in_flight_peak": stats.get("in_flight_peak"),
        "ok": sum(r.status == "ok" for r in results),
        "model_s_sum": round(sum(r.seconds for r in results), 2),
    }


def parallelism_part(fleet: LocalFleet, n: int, k: int, tokens: str, with_shared5: bool) -> dict[str, Any]:
    """The ``max_sub_llm_parallelism`` cases: one batch of ``n``; ``k`` batches in turn; ``k`` at once."""
    ps = prompts(n, "par", tokens)
    split = [ps[i::k] for i in range(k)]
    ref, ours = REFERENCE_PARALLELISM, setting_default("max_sub_llm_parallelism")
    run_loop(timed_batches(fleet, [prompts(8, "warm", "1")], ours, at_once=False, shared=True))  # warm-up
    out: dict[str, Any] = {}
    cases = [
        ("one_batch_5", [ps], ref, False, False),
        ("one_batch_64", [ps], ours, False, True),
        ("in_turn_5_per_batch", split, ref, False, False),
        ("in_turn_64_per_rollout", split, ours, False, True),
        ("at_once_5_per_batch", split, ref, True, False),
        ("at_once_64_per_rollout", split, ours, True, True),
    ]
    if with_shared5:
        cases.append(("at_once_5_per_rollout", split, ref, True, True))
    for name, batches, par, at_once, shared in cases:
        row = run_loop(timed_batches(fleet, batches, par, at_once=at_once, shared=shared))
        out[name] = row
        print(f"parallelism: {name:<24} {row['prompts']} prompts in {row['batches']} batch(es): "
              f"wall {row['wall_s']:6.2f} s, peak in flight {row['in_flight_peak']}", flush=True)  # fmt: skip
    out["ratios"] = {
        "one_batch_5_over_64": round(out["one_batch_5"]["wall_s"] / out["one_batch_64"]["wall_s"], 2),
        "in_turn_5_over_64": round(out["in_turn_5_per_batch"]["wall_s"] / out["in_turn_64_per_rollout"]["wall_s"], 2),
        "at_once_5_per_batch_over_64": round(
            out["at_once_5_per_batch"]["wall_s"] / out["at_once_64_per_rollout"]["wall_s"], 2
        ),
    }
    if with_shared5:
        out["ratios"]["at_once_5_per_rollout_over_5_per_batch"] = round(
            out["at_once_5_per_rollout"]["wall_s"] / out["at_once_5_per_batch"]["wall_s"], 2
        )
    print("parallelism ratios:", json.dumps(out["ratios"]), flush=True)
    return out


async def busy_fleet(fleet: LocalFleet, rollouts: int, per_rollout: int, tokens: str) -> list[SubLLMResult]:
    """``rollouts`` rollouts at once, each one batch of ``per_rollout`` prompts at the default parallelism."""
    redis = async_client(str(fleet.redis_url))
    dispatcher = Dispatcher(redis)
    par = setting_default("max_sub_llm_parallelism")
    tag = uuid.uuid4().hex[:8]

    async def rollout(r: int) -> list[SubLLMResult]:
        rid = f"busy-{tag}-{r}"
        spec = spec_for(fleet.model, rid, "b0", par, FAR, RolloutInFlight(par))
        return await dispatcher.run_batch(spec, prompts(per_rollout, f"{tag}r{r}", tokens))

    try:
        done = await asyncio.gather(*(rollout(r) for r in range(rollouts)))
    finally:
        await redis.aclose()
    return [x for rs in done for x in rs]


def spread(values: list[float]) -> dict[str, float]:
    """p50 / p95 / max of ``values``, seconds rounded to 10 ms."""
    return {"p50": round(pct(values, 50), 2), "p95": round(pct(values, 95), 2), "max": round(max(values), 2)}


def timeout_row(results: list[SubLLMResult], slots: int, oversubscription: int) -> dict[str, Any]:
    """Model time against enqueue-to-result, and the calls over each scaled bound."""
    model = [r.seconds for r in results]
    e2r = [r.queue_wait_seconds + r.seconds for r in results]
    longest = max(model)
    scale = longest / setting_default("model_timeout")
    ours = setting_default("sub_call_timeout")
    bounds = {"reference_115s": REFERENCE_CALL_TIMEOUT * scale, "rlmq_300s": ours * scale}
    over = {name: sum(t > b for t in e2r) for name, b in bounds.items()}
    return {
        "slots": slots,
        "oversubscription": oversubscription,
        "calls": len(results),
        "ok": sum(r.status == "ok" for r in results),
        "model_s": spread(model),
        "queue_wait_s": spread([r.queue_wait_seconds for r in results]),
        "enqueue_to_result_s": spread(e2r),
        "enqueue_to_result_over_longest_model_max": round(max(e2r) / longest, 2),
        "scaled_bounds_s": {k: round(v, 2) for k, v in bounds.items()},
        "over_bound": over,
        "over_bound_fraction": {k: round(v / len(results), 3) for k, v in over.items()},
        "bound_failing_none_at_120s_calls_s": round(max(e2r) / scale, 1),
    }


def timeout_part(fleet: LocalFleet, slots: int, tokens: str) -> list[dict[str, Any]]:
    """The ``sub_call_timeout`` cases: 2x, 4x and 8x the fleet's slots asked for at once."""
    per_rollout = 16
    run_loop(busy_fleet(fleet, 1, per_rollout, "1"))  # warm-up
    rows = []
    for over in (2, 4, 8):
        results = run_loop(busy_fleet(fleet, over * slots // per_rollout, per_rollout, tokens))
        row = timeout_row(results, slots, over)
        rows.append(row)
        print(f"timeout: {over}x {slots} slots, {row['calls']} calls ({row['ok']} ok): model s {row['model_s']}, "
              f"enqueue-to-result s {row['enqueue_to_result_s']}; over the scaled 115 s "
              f"({row['scaled_bounds_s']['reference_115s']} s): {row['over_bound']['reference_115s']}, "
              f"over the scaled 300 s ({row['scaled_bounds_s']['rlmq_300s']} s): {row['over_bound']['rlmq_300s']}",
              flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.reference_rows", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter calls and fewer of them (under a minute)")
    a = p.parse_args(argv)
    tokens = "100-200" if a.quick else "200-400"
    n, k, slots_per_worker = (20, 2, 4) if a.quick else (40, 4, 8)
    doc: dict[str, Any] = {
        "command": "python -m bench.reference_rows" + (" --quick" if a.quick else ""),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "call_tokens": tokens,
        "decode_tokens_per_s": 100,
    }
    t0 = time.perf_counter()
    redis_server = EmbeddedRedis().start()
    try:
        with LocalFleet(redis_url=redis_server.url, model="bench-par", workers=2, worker_concurrency=64,
                        log_dir=LOGS) as fleet:  # fmt: skip
            doc["parallelism"] = parallelism_part(fleet, n, k, tokens, with_shared5=not a.quick)
        with LocalFleet(redis_url=redis_server.url, model="bench-busy", workers=2,
                        worker_concurrency=slots_per_worker, log_dir=LOGS) as fleet:  # fmt: skip
            doc["timeout"] = timeout_part(fleet, 2 * slots_per_worker, tokens)
    finally:
        redis_server.stop()
    doc["total_s"] = round(time.perf_counter() - t0, 1)
    path = save_json(doc, os.path.join(RESULTS, "reference_rows_quick" if a.quick else "reference_rows"))
    print(f"saved {path} ({doc['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
