"""One rollout's hosted-tool flood against another rollout's tool round trip.

Against a private ``redis-server`` (``rlmq.common.redis_server.EmbeddedRedis``), in two processes
as in a fleet: a *rollout process* serves two rollouts' hosted tools
(:class:`~rlmq.producer.hosted_tools.HostedToolServer`, one per rollout: the hog and the victim),
and a *worker process* (this one) sends their calls through
:func:`~rlmq.workers.hosted_tools.call_hosted` with a worker's per-rollout cap
(:class:`~rlmq.workers.hosted_tools.RolloutSlots`) and a pool of 64 Redis connections.

Each repetition measures the victim's round trip of a trivial sync tool, ``--samples`` calls one
after the other, first alone and then while the hog has a flood of calls outstanding (started
``--settle`` seconds before), then cancels the flood and lets it settle. The floods (``--floods``):

- ``slow``: ``--slow-calls`` calls (default 2,000) of a sync tool that sleeps 1 s;
- ``quick``: ``--quick-calls`` calls (default 10,000) of a sync tool that answers at once;
- ``async-quick`` (not by default): as many calls of an async tool that answers at once (no thread).

Prints, per flood, the victim's median and p90 round trip alone and beside the flood (over all
samples of all repetitions), their ratios, and each repetition's ratio of medians; writes
``bench/results/tool_flood_<date>[_<variant>].json`` with every sample, the flood's progress and
both processes' CPU share in each window. Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench.harness import machine, pct, proc_cpu, save_json, say
from rlmq.common.connection import async_client
from rlmq.common.redis_server import EmbeddedRedis
from rlmq.common.tool_wire import CALLS_PER_ROLLOUT, ToolCallRequest
from rlmq.producer.hosted_tools import HostedTools, HostedToolServer
from rlmq.workers.hosted_tools import RolloutSlots, call_hosted

SLOW = "bench.tool_flood.slow"
QUICK = "bench.tool_flood.quick"
AQUICK = "bench.tool_flood.aquick"
POOL = 64
"""Redis connections of the worker's pool."""


def slow(key: str) -> str:
    """Answer after 1 s (a sync tool, run in a thread).

    Args:
        key: anything.
    """
    time.sleep(1.0)
    return f"slow {key}"


def quick(key: str) -> str:
    """Answer at once.

    Args:
        key: anything.
    """
    return f"quick {key}"


async def aquick(key: str) -> str:
    """Answer at once (an async tool: awaited in the rollout's event loop, no thread).

    Args:
        key: anything.
    """
    return f"quick {key}"


async def _serve(url: str, rollouts: list[str]) -> None:
    """The rollout process: serve each of ``rollouts``' hosted tools until SIGTERM."""
    redis = async_client(url)
    tools = HostedTools([(SLOW, slow), (QUICK, quick), (AQUICK, aquick)], timeout=30, max_args_bytes=1024)
    servers = [HostedToolServer(redis, rid, tools, answer_ttl=120) for rid in rollouts]
    tasks = [asyncio.create_task(s.serve()) for s in servers]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("serving", flush=True)
    await stop.wait()
    for s in servers:
        s.stop()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await redis.aclose()


async def _victim(redis: Any, rid: str, slots: RolloutSlots, samples: int) -> list[float]:
    """Seconds of ``samples`` round trips of the victim's ``quick`` calls, one after the other."""
    times: list[float] = []
    for i in range(samples):
        req = ToolCallRequest(id=f"v:{uuid.uuid4().hex[:10]}:{i}", tool=QUICK, arguments='{"key": "v"}', wait=60)
        t0 = time.perf_counter()
        text = await call_hosted(redis, rid, req, name="quick", deadline=time.time() + 60, slots=slots)
        times.append(time.perf_counter() - t0)
        if text != "quick v":
            raise RuntimeError(f"the victim's call answered {text[:200]!r}")
    return times


async def _flood_started(slots: RolloutSlots, hog: str, calls: int, settle: float) -> None:
    """Wait (at most 30 s) until the hog's calls hold all their slots, then ``settle`` seconds more
    (the flood's first calls sent, read and run: it is under way)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30:
        if slots.in_flight(hog) >= slots.per_rollout:
            await asyncio.sleep(settle)
            return
        await asyncio.sleep(0.01)
    raise RuntimeError(f"the flood of {calls} calls never took the hog's slots")


async def _repetition(
    redis: Any, hog: str, victim: str, flood: str, server_pid: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One repetition: the victim alone, then beside the hog's flood of ``flood`` calls; with the
    CPU share (of one core) the worker and the rollout process used in each window."""
    calls = args.slow_calls if flood == "slow" else args.quick_calls  # quick and async-quick
    slots = RolloutSlots(per_rollout=args.per_rollout)
    here, there, t0 = proc_cpu(os.getpid()), proc_cpu(server_pid), time.monotonic()
    alone = await _victim(redis, victim, slots, args.samples)
    cpu_alone = _shares(here, there, t0, server_pid)
    tool, name = {"slow": (SLOW, "slow"), "quick": (QUICK, "quick"), "async-quick": (AQUICK, "aquick")}[flood]
    tag = uuid.uuid4().hex[:8]
    tasks: list[asyncio.Task[str]] = []
    for i in range(calls):
        req = ToolCallRequest(id=f"h:{tag}:{i}", tool=tool, arguments=f'{{"key": "{i}"}}', wait=600)
        coro = call_hosted(redis, hog, req, name=name, deadline=time.time() + 600, slots=slots)
        tasks.append(asyncio.create_task(coro))
    try:
        await _flood_started(slots, hog, calls, args.settle)
        in_use = len(redis.connection_pool._in_use_connections)
        done_before = sum(t.done() for t in tasks)
        here, there, t0 = proc_cpu(os.getpid()), proc_cpu(server_pid), time.monotonic()
        beside = await _victim(redis, victim, slots, args.samples)
        cpu_beside = _shares(here, there, t0, server_pid)
        window = time.monotonic() - t0
        done = sum(t.done() for t in tasks)
        return {
            "alone_s": alone,
            "beside_s": beside,
            "flood_calls_done_before_window": done_before,
            "flood_calls_done_in_window": done - done_before,
            "flood_calls_pending_after": calls - done,
            "victim_window_s": round(window, 3),
            "worker_pool_in_use_at_window_start": in_use,
            "cpu_share_alone": cpu_alone,
            "cpu_share_beside": cpu_beside,
        }
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(args.settle + (1.0 if flood == "slow" else 0.0))  # the hog's last calls end


def _shares(here: float, there: float, t0: float, server_pid: int) -> dict[str, float]:
    """The worker's (this process) and the rollout process's CPU since ``here`` / ``there`` (their
    CPU seconds at ``t0``, ``time.monotonic()``), as shares of one core."""
    wall = max(time.monotonic() - t0, 1e-9)
    return {
        "worker": round((proc_cpu(os.getpid()) - here) / wall, 2),
        "rollout_process": round((proc_cpu(server_pid) - there) / wall, 2),
    }


def _figures(reps: list[dict[str, Any]]) -> dict[str, Any]:
    alone = [x for r in reps for x in r["alone_s"]]
    beside = [x for r in reps for x in r["beside_s"]]
    a50, a90, b50, b90 = pct(alone, 50), pct(alone, 90), pct(beside, 50), pct(beside, 90)
    return {
        "alone_p50_ms": round(a50 * 1000, 2),
        "alone_p90_ms": round(a90 * 1000, 2),
        "beside_p50_ms": round(b50 * 1000, 2),
        "beside_p90_ms": round(b90 * 1000, 2),
        "ratio_p50": round(b50 / a50, 2),
        "ratio_p90": round(b90 / a90, 2),
        "rep_ratio_p50": [round(pct(r["beside_s"], 50) / pct(r["alone_s"], 50), 2) for r in reps],
        "median_rep_ratio_p50": round(pct([pct(r["beside_s"], 50) / pct(r["alone_s"], 50) for r in reps], 50), 2),
        "samples_per_side": len(alone),
    }


async def _measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    hog, victim = f"hog-{uuid.uuid4().hex[:6]}", f"victim-{uuid.uuid4().hex[:6]}"
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.tool_flood", "--switch-interval", str(sys.getswitchinterval()), "--serve", url]
        + [hog, victim],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    redis = async_client(url, max_connections=POOL)
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "serving":
            raise RuntimeError("the rollout process did not start")
        await _victim(redis, victim, RolloutSlots(), 20)  # warm: connections opened, code paths run
        out: dict[str, Any] = {}
        for flood in args.floods.split(","):
            calls = args.slow_calls if flood == "slow" else args.quick_calls
            reps = []
            for rep in range(args.repetitions):
                say(f"{flood} flood of {calls} calls, repetition {rep + 1}/{args.repetitions}")
                reps.append(await _repetition(redis, hog, victim, flood, child.pid, args))
            out[flood] = {"calls": calls, **_figures(reps), "repetitions": reps}
        return out
    finally:
        await redis.aclose()
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=20)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=20)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=10)
    parser.add_argument("--samples", type=int, default=15, help="victim calls per side of a repetition")
    parser.add_argument(
        "--floods", default="slow,quick", help="which floods, in order: slow, quick, async-quick (an async tool)"
    )
    parser.add_argument("--tag", default="", help="a suffix of the results file's name")
    parser.add_argument("--slow-calls", type=int, default=2000)
    parser.add_argument("--quick-calls", type=int, default=10000)
    parser.add_argument(
        "--settle", type=float, default=1.0, help="seconds between the flood's start and the victim's calls"
    )
    parser.add_argument(
        "--per-rollout", type=int, default=CALLS_PER_ROLLOUT, help="the worker's cap on one rollout's calls in flight"
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval in both processes (seconds; default: Python's own, 0.005)",
    )
    parser.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)  # the rollout process: URL ROLLOUT...
    args = parser.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.serve:
        asyncio.run(_serve(args.serve[0], args.serve[1:]))
        return 0
    started = time.time()
    with EmbeddedRedis() as server:
        figures = asyncio.run(_measure(server.url, args))
    doc = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": "python -m bench.tool_flood " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "load_average_at_start": list(os.getloadavg()),
        "calls_per_rollout": CALLS_PER_ROLLOUT,
        "worker_cap_per_rollout": args.per_rollout,
        "switch_interval_s": sys.getswitchinterval(),
        "worker_pool_connections": POOL,
        "wall_s": round(time.time() - started, 1),
        **figures,
    }
    print(f"{'flood':6s} {'calls':>6s} {'alone p50/p90 ms':>18s} {'beside p50/p90 ms':>19s} {'ratio p50/p90':>14s}")
    for flood in args.floods.split(","):
        f = doc[flood]
        print(
            f"{flood:6s} {f['calls']:6d} {f['alone_p50_ms']:>8.2f} / {f['alone_p90_ms']:<7.2f} "
            f"{f['beside_p50_ms']:>8.2f} / {f['beside_p90_ms']:<8.2f} {f['ratio_p50']:>5.2f} / {f['ratio_p90']:<5.2f}"
            f"  per repetition (p50): {f['rep_ratio_p50']}, median {f['median_rep_ratio_p50']}"
        )
    stem = f"tool_flood_{doc['date']}" + (f"_cap{args.per_rollout}" if args.per_rollout != CALLS_PER_ROLLOUT else "")
    stem += f"_switch{args.switch_interval:g}" if args.switch_interval is not None else ""
    stem += f"_{args.tag}" if args.tag else ""
    path = save_json(doc, str(Path(__file__).parent / "results" / stem))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
