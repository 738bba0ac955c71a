"""The client roles of the queue-path benchmark, each run in its own subprocess.

``python -m bench.queue_path --role openai|rlmq|light ...`` runs one of them: it prints
``READY``, waits for ``GO`` on stdin (so the orchestrator's probes bracket exactly the
measured work), runs, writes its figures (latencies, wall time, its own CPU time and peak
RSS) as JSON to ``--result-file`` and prints ``RESULT`` (without a result file: ``RESULT <json>``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench.harness import prompt
from rlmq.common.aio import run as run_loop

MODEL = "bench-scripted"
RQ_MODEL = "bench-stock-rq"
CAP = 256  # per-call max_tokens cap (and grant cap when budgeted)

BatchFn = Callable[[int, int, list[str]], Awaitable[tuple[list[float], int]]]


async def _drive(call_batch: BatchFn, n: int, rollouts: int, batch: int, start_batch: int) -> dict[str, Any]:
    """``rollouts`` concurrent loops, each running batches of ``batch`` prompts, ``n`` calls in all."""
    latencies: list[float] = []
    errors = 0
    share = [n // rollouts + (1 if r < n % rollouts else 0) for r in range(rollouts)]

    async def rollout(r: int) -> None:
        nonlocal errors
        done, bno = 0, start_batch
        while done < share[r]:
            b = min(batch, share[r] - done)
            lat, err = await call_batch(r, bno, [prompt(r * 100_003 + done + j) for j in range(b)])
            latencies.extend(lat)
            errors += err
            done += b
            bno += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(rollout(r) for r in range(rollouts) if share[r]))
    wall = time.perf_counter() - t0
    return {"n": n, "wall": wall, "latencies": latencies, "errors": errors}


def _wait_for_go() -> None:
    print("READY", flush=True)
    line = sys.stdin.readline()
    if line.strip() != "GO":
        raise SystemExit("orchestrator went away")


LIGHT_PATHS = ("direct", "rlmq", "rlmq-budget")


async def _light(a: argparse.Namespace) -> dict[str, Any]:
    """One prompt at a time, the three paths interleaved in one process.

    Round ``i`` runs one direct model call (``rlmq.workers.model.ChatClient``, the worker's own
    client, in this process), one one-prompt ``llm_batch`` through rlmq and one through
    rlmq with a budget, in an order rotated every round, so a noisy phase of the shared
    machine hits all three alike. Latency: the call's wall time; for rlmq the whole
    ``Dispatcher.run_batch`` (enqueue to the result parsed).
    """
    from rlmq.common.budget.ledger import BudgetLedger
    from rlmq.common.connection import async_client
    from rlmq.common.schemas import SubCallOptions
    from rlmq.producer.dispatch import BatchSpec, Dispatcher
    from rlmq.workers.model import ChatClient

    chat = ChatClient(a.base_url, "bench", retries=0)
    redis = async_client(a.redis_url)
    dispatcher = Dispatcher(redis)
    plain, budgeted = f"{a.tag}light", f"{a.tag}lightb"
    await BudgetLedger(redis, ttl=3600).open(budgeted, 10**12)
    seq = 0

    async def one(path: str, p: str) -> bool:
        nonlocal seq
        if path == "direct":
            await chat.chat(model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=CAP)
            return True
        seq += 1
        spec = BatchSpec(
            rollout_id=budgeted if path == "rlmq-budget" else plain,
            batch_id=f"l{seq}",
            queue=a.queue,
            sub_call_timeout=a.timeout,
            parallelism=1,
            call=SubCallOptions(model=a.model, budgeted=path == "rlmq-budget", max_completion_tokens=CAP),
        )
        return (await dispatcher.run_batch(spec, [p]))[0].status == "ok"

    async def rounds(n: int, lat: dict[str, list[float]]) -> int:
        errors = 0
        for i in range(n):
            for k in range(len(LIGHT_PATHS)):
                path = LIGHT_PATHS[(i + k) % len(LIGHT_PATHS)]
                t0 = time.perf_counter()
                ok = await one(path, prompt(i))
                lat[path].append(time.perf_counter() - t0)
                errors += not ok
        return errors

    await rounds(a.warmup, {x: [] for x in LIGHT_PATHS})
    _wait_for_go()
    lat: dict[str, list[float]] = {x: [] for x in LIGHT_PATHS}
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    errors = await rounds(a.n, lat)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    await chat.close()
    await redis.aclose()
    return {
        "n": a.n,
        "wall": wall,
        "latencies": lat["rlmq"],
        "light": lat,
        "errors": errors,
        "cpu": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
        "maxrss_mb": r1.ru_maxrss / 1024,
        "warmup_errors": 0,
    }


async def _client(a: argparse.Namespace) -> dict[str, Any]:
    if a.role == "light":
        return await _light(a)
    close: list[Callable[[], Awaitable[Any]]] = []
    call_batch: BatchFn
    if a.role == "openai":
        import openai

        client = openai.AsyncOpenAI(base_url=a.base_url, api_key="bench", max_retries=0)
        close.append(client.close)

        async def call_batch_openai(r: int, bno: int, prompts: list[str]) -> tuple[list[float], int]:
            t0 = time.perf_counter()
            sem = asyncio.Semaphore(a.sem) if a.sem > 0 else None
            lat: list[float] = []
            errors = 0

            async def one(p: str) -> None:
                nonlocal errors
                try:
                    if sem is None:
                        await client.chat.completions.create(
                            model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=CAP
                        )
                    else:
                        async with sem:
                            await client.chat.completions.create(
                                model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=CAP
                            )
                except Exception:
                    errors += 1
                lat.append(time.perf_counter() - t0)

            await asyncio.gather(*(one(p) for p in prompts))
            return lat, errors

        call_batch = call_batch_openai
    elif a.role == "direct":
        from rlmq.workers.model import ChatClient

        chat = ChatClient(a.base_url, "bench", retries=0)
        close.append(chat.close)

        async def call_batch_direct(r: int, bno: int, prompts: list[str]) -> tuple[list[float], int]:
            lat: list[float] = []
            for p in prompts:
                t0 = time.perf_counter()
                await chat.chat(model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=CAP)
                lat.append(time.perf_counter() - t0)
            return lat, 0

        call_batch = call_batch_direct
    else:  # rlmq producer (also the producer of the stock-RQ scenario)
        import rlmq.producer.dispatch as dispatch
        from rlmq.common.budget.ledger import BudgetLedger
        from rlmq.common.connection import async_client
        from rlmq.common.schemas import SubCallOptions
        from rlmq.producer.dispatch import BatchSpec, Dispatcher

        arrivals: dict[tuple[str, str, int], float] = {}
        original = dispatch.load_result

        def timed_load_result(raw: str | bytes) -> Any:
            res = original(raw)
            arrivals[(res.rollout_id, res.batch_id, res.index)] = time.perf_counter()
            return res

        dispatch.load_result = timed_load_result  # type: ignore[assignment]  # bench-only timing hook
        redis = async_client(a.redis_url)
        close.append(redis.aclose)
        dispatcher = Dispatcher(redis)
        ledger = BudgetLedger(redis, ttl=3600)
        rollout_ids = [f"{a.tag}r{r}" for r in range(a.rollouts)]
        if a.budgeted:
            for rid in rollout_ids:
                await ledger.open(rid, 10**12)

        async def call_batch_rlmq(r: int, bno: int, prompts: list[str]) -> tuple[list[float], int]:
            spec = BatchSpec(
                rollout_id=rollout_ids[r],
                batch_id=f"b{bno}",
                queue=a.queue,
                sub_call_timeout=a.timeout,
                parallelism=len(prompts),
                call=SubCallOptions(model=a.model, budgeted=a.budgeted, max_completion_tokens=CAP),
            )
            t0 = time.perf_counter()
            results = await dispatcher.run_batch(spec, prompts)
            if len(prompts) == 1:  # one prompt at a time: when llm_batch returned (its cleanup included)
                return [time.perf_counter() - t0], sum(1 for x in results if x.status != "ok")
            lat = [
                arrivals.pop((spec.rollout_id, spec.batch_id, i), time.perf_counter()) - t0 for i in range(len(prompts))
            ]
            return lat, sum(1 for x in results if x.status != "ok")

        call_batch = call_batch_rlmq

    warm = await _drive(call_batch, a.warmup, min(a.rollouts, max(1, a.warmup)), a.batch, 0) if a.warmup else None
    _wait_for_go()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    out = await _drive(call_batch, a.n, a.rollouts, a.batch, 1_000_000)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    for c in close:
        with contextlib.suppress(Exception):
            await c()
    out["cpu"] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    out["maxrss_mb"] = r1.ru_maxrss / 1024
    out["warmup_errors"] = warm["errors"] if warm else 0
    return out


def client_main(a: argparse.Namespace) -> None:
    """Run the client role ``a.role``, write its figures (JSON) to ``a.result_file`` (a temporary
    file renamed onto it, so it is read whole) and print the line ``RESULT``; without a result
    file, print ``RESULT <json>``."""
    # Every client (the baselines and rlmq's producer alike) runs on the loop `rlmq run` uses:
    # uvloop when installed (common/aio.py), so the comparison stays like for like.
    out = run_loop(_client(a))
    if getattr(a, "result_file", None):
        tmp = f"{a.result_file}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(out, fh)
        os.replace(tmp, a.result_file)
        print("RESULT", flush=True)
    else:
        print("RESULT " + json.dumps(out), flush=True)
