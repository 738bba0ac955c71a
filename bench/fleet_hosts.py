"""The fleet on several hosts: round trips between hosts, and a provider quota shared by the fleet.

Hosts are network namespaces on one machine (``tests/hosts``: a Redis host, a model host with the
scripted model, trainer hosts, three worker hosts), a userspace delay proxy in front of Redis and
the model adding ``rtt`` milliseconds per round trip. Needs root and ``ip`` (iproute2).

* **Round trips** (``--rtts 0,1,5,20``; 0: the proxies and namespaces alone): for each, and for the
  same fleet on one host (loopback, no
  proxy): sub-calls per second of a main job (``--rollouts`` x ``--calls`` sub-calls answered at
  once, 10 tokens each, budgeted) and the seconds of one sub-call (``--latency-n`` batches of one
  call, one after the other: median, p90); the added latency is the median minus one host's.
* **Provider quota** (``--rpm 600 --tpm 100000 --window 60``): the scripted model answers 429 past
  the quota, counting every caller; 2 trainer hosts drive 3 worker hosts; once with the workers
  declaring the same limits (``--provider-rpm`` ...), once without (each worker retrying its own
  429s, as before), in the same run: share of the requests-per-window limit used, 429s answered,
  sub-calls lost.
* **Failover** (``--failovers 3``): a Redis master, its replica and a Sentinel on this host; the
  master killed (``kill -9``) one second into a main job on two workers that reach Redis through
  the Sentinel URL (grants waiting for the replica, the default), its host back as a replica once
  the replica is promoted: seconds without service and without grants, sub-calls answered, lost,
  duplicated, budget overshoot.
* **Replica acknowledgement** (``--wait-cost``, ``--unreplicated-failovers N``; these, with
  ``--failovers``, alone, saved in ``bench/results/fleet_replica_acks.json``): what
  ``--redis-replica-acks 1`` costs a sub-call against 0 (sub-calls per second, one sub-call's
  seconds, one ledger round trip's), and failovers that lose the master's last grants and jobs,
  with and without it: tokens served past each rollout's budget.

    python -m bench.fleet_hosts                  # both parts, about 8 minutes on 2 cores
    python -m bench.fleet_hosts --quick          # a scaled-down run (window 10 s), about 2 minutes

prints each figure and saves ``bench/results/fleet_hosts.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rlmq.cli.local import LocalFleet, child_env
from tests.fleet.provider import rpm_share
from tests.hosts.fleet import ROOT, HostFleet, driver_answer

RESULTS = Path(__file__).parent / "results"
WORKERS: dict[str, list[str]] = {"w1": [], "w2": [], "w3": []}


def _job(redis_url: str, base_url: str, model: str, rollouts: int, calls: int, label: str) -> list[str]:
    return ["main-job", "--redis-url", redis_url, "--base-url", base_url, "--model", model,
            "--rollouts", str(rollouts), "--calls", str(calls), "--budget", str(calls * 100), "--cap", "50",
            "--tokens", "10", "--sleep", "0", "--timeout", "300", "--label", label]  # fmt: skip


def _latency(redis_url: str, model: str, n: int) -> list[str]:
    return ["latency", "--redis-url", redis_url, "--model", model, "--n", str(n), "--label", "lat"]


def one_host(args: argparse.Namespace) -> dict[str, Any]:
    """The round-trip figures of the fleet on one host (loopback, no proxy)."""

    def driver(*cmd: str) -> dict[str, Any]:
        argv = [sys.executable, "-m", "tests.hosts.driver", *cmd]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env=child_env())  # fmt: skip
        return driver_answer(proc, 600)

    with LocalFleet(model="hosts", workers=3, worker_concurrency=64) as f:
        url, base = str(f.redis_url), str(f.base_url)
        job = driver(*_job(url, base, "hosts", args.rollouts, args.calls, "one"))
        lat = driver(*_latency(url, "hosts", args.latency_n))
    return {"rtt_ms": 0, "hosts": 1, **_figures(job, lat)}


def _figures(job: dict[str, Any], lat: dict[str, Any]) -> dict[str, Any]:
    return {
        "subcalls": job["slots"], "lost": job["lost"], "seconds": job["seconds"],
        "subcalls_per_s": round(job["slots"] / job["seconds"], 1),
        "latency_median_s": round(lat["median"], 4), "latency_p90_s": round(lat["p90"], 4),
    }  # fmt: skip


def hosts(args: argparse.Namespace, rtt: float) -> dict[str, Any]:
    """The round-trip figures of the fleet on hosts ``rtt`` milliseconds apart."""
    with HostFleet(workers=WORKERS, rtt_ms=rtt) as f:
        job = f.driver("trainer1", *_job(f.redis_url, f.base_url, f.model, args.rollouts, args.calls, "h"), timeout=600)
        lat = f.driver("trainer1", *_latency(f.redis_url, f.model, args.latency_n), timeout=600)
    return {"rtt_ms": rtt, "hosts": 7, **_figures(job, lat)}


def quota_run(args: argparse.Namespace, limited: bool) -> dict[str, Any]:
    """The provider-quota run: 2 trainer hosts, 3 worker hosts, with or without the fleet's limits."""
    quota = ("--quota-rpm", str(args.rpm), "--quota-tpm", str(args.tpm), "--quota-window", f"{args.window:g}")
    limits = ("--provider-rpm", str(args.rpm), "--provider-tpm", str(args.tpm), "--provider-window",
              f"{args.window:g}", "--provider-window-margin", f"{args.window / 120:g}")  # fmt: skip
    flags = ("--concurrency", "256", "--heartbeat-ttl", "10", *(limits if limited else ()))
    with HostFleet(workers=WORKERS, trainers=("trainer1", "trainer2"), rtt_ms=args.quota_rtt, model_args=quota,
                   worker_flags=flags) as f:  # fmt: skip
        started = time.monotonic()
        procs = [
            f.start_driver(t, *_job(f.redis_url, f.base_url, f.model, args.quota_rollouts, args.quota_calls, f"q{i}"))
            for i, t in enumerate(f.trainers)
        ]
        jobs = [driver_answer(p, 1200) for p in procs]
        seconds = time.monotonic() - started
        stats = f.driver("trainer1", "model-stats", "--redis-url", f.redis_url, "--base-url", f.base_url,
                         "--model", f.model)["quota"]  # fmt: skip
    sent = stats["accepted"] + stats["refused"]
    return {
        "fleet_limits": limited, "rpm": args.rpm, "tpm": args.tpm, "window_s": args.window,
        "subcalls": sum(j["slots"] for j in jobs), "ok": sum(j["ok"] for j in jobs),
        "lost": sum(j["lost"] for j in jobs), "duplicated": sum(j["duplicated"] for j in jobs),
        "accepted": stats["accepted"], "answered_429": stats["refused"],
        "share_429": round(stats["refused"] / sent, 4) if sent else 0.0,
        "share_of_rpm_used": round(rpm_share(stats["accepted_at"], args.rpm, args.window), 3),
        "seconds": round(seconds, 1),
    }  # fmt: skip


def failovers(n: int) -> list[dict[str, Any]]:
    """``n`` Sentinel failovers mid-job (:func:`tests.fleet.sentinel.failover_run`)."""
    import asyncio
    import tempfile

    from tests.fleet.sentinel import failover_run

    rows = []
    for _ in range(n):
        with tempfile.TemporaryDirectory(prefix="rlmq-failover-") as folder:
            run = asyncio.run(failover_run(Path(folder)))
        out = run.pop("out")
        rows.append({**run, "subcalls": out.slots, "ok": out.ok, "rejected": out.rejected, "lost": out.lost,
                     "duplicated": out.duplicated, "overshoot": out.overshoot, "errors": dict(out.errors)})  # fmt: skip
        print("failover:", json.dumps(rows[-1]), flush=True)
    return rows


def unreplicated_failovers(n: int) -> list[dict[str, Any]]:
    """``n`` failovers that lose the master's last grants and jobs (:func:`tests.fleet.sentinel.
    unreplicated_failover_run`), each with ``--redis-replica-acks`` 0 and 1."""
    import asyncio
    import tempfile

    from tests.fleet.sentinel import unreplicated_failover_run

    rows = []
    for _ in range(n):
        for acks in (0, 1):
            with tempfile.TemporaryDirectory(prefix="rlmq-unreplicated-") as folder:
                run = asyncio.run(unreplicated_failover_run(Path(folder), replica_acks=acks))
            out = run.pop("out")
            rows.append({"replica_acks": acks, **run, "subcalls": out.slots, "ok": out.ok, "lost": out.lost,
                         "duplicated": out.duplicated, "overshoot": out.overshoot, "served": out.served,
                         "errors": dict(out.errors)})  # fmt: skip
            print("unreplicated failover:", json.dumps(rows[-1]), flush=True)
    return rows


async def _interleaved(url: str, models: dict[int, str], n: int) -> dict[int, dict[str, float]]:
    """One budgeted sub-call on each model's queue in turn, ``n`` rounds, and one grant on a client
    asking each number of replicas in turn (200 rounds; each settled): the median and p90 seconds of
    a sub-call and the median seconds of a grant, per number of replicas (the keys of ``models``)."""
    import statistics
    import uuid

    from rlmq.common import keys as K
    from rlmq.common.budget.ledger import BudgetLedger
    from rlmq.common.connection import async_client
    from rlmq.common.schemas import SubCallOptions
    from rlmq.producer.dispatch import BatchSpec, Dispatcher

    producer = async_client(url)
    clients = {acks: async_client(url, replica_acks=acks) for acks in models}
    calls: dict[int, list[float]] = {acks: [] for acks in models}
    grants: dict[int, list[float]] = {acks: [] for acks in models}
    rid = f"t_lat{uuid.uuid4().hex[:6]}"
    try:
        await BudgetLedger(producer).open(rid, 10**9, cap=100)
        dispatcher = Dispatcher(producer)
        for i in range(n):
            for acks, model in models.items():
                queue = K.tenant_queue(K.queue_name_for_model(model), "t")
                spec = BatchSpec(rollout_id=rid, batch_id=f"b{acks}x{i}", queue=queue, sub_call_timeout=60,
                                 parallelism=1, call=SubCallOptions(model=model, budgeted=True))  # fmt: skip
                started = time.perf_counter()
                results = await dispatcher.run_batch(spec, [f"Ping {i}. [[mock:tokens:10]]"])
                calls[acks].append(time.perf_counter() - started)
                assert results[0].status == "ok", results[0]
        for i in range(200):
            for acks, client in clients.items():
                ledger = BudgetLedger(client)
                started = time.perf_counter()
                grant = await ledger.reserve(rid, f"g{acks}x{i}", 10)
                grants[acks].append(time.perf_counter() - started)
                assert grant.granted, grant
                await ledger.settle(rid, f"g{acks}x{i}", 10)
    finally:
        for client in (producer, *clients.values()):
            await client.aclose()
    out = {}
    for acks, times in calls.items():
        times.sort()
        out[acks] = {"median": statistics.median(times), "p90": times[int(0.9 * (len(times) - 1))],
                     "grant": statistics.median(grants[acks])}  # fmt: skip
    return out


def wait_cost(args: argparse.Namespace) -> list[dict[str, Any]]:
    """What waiting for the replica's acknowledgement costs: a master, its replica and a Sentinel on
    this host; two fleets of two workers at once through the Sentinel URL, one with
    ``--redis-replica-acks 0`` (model ``acks0``), one with 1 (``acks1``), so both meet the same load
    of the machine: the seconds of one budgeted sub-call (``--latency-n`` on each, one after the
    other, alternating), of one grant alone (alternating), and the budgeted sub-calls per second of
    a main job (``--wait-rounds`` on each, alternating; the median)."""
    import asyncio
    import statistics
    import tempfile
    from contextlib import ExitStack

    from tests.fleet.harness import main_job
    from tests.fleet.sentinel import SentinelSet

    models = {0: "acks0", 1: "acks1"}
    with tempfile.TemporaryDirectory(prefix="rlmq-acks-") as folder, ExitStack() as stack:
        s = SentinelSet(Path(folder) / "redis")
        stack.callback(s.close)
        fleets = {acks: stack.enter_context(LocalFleet(redis_url=s.url, model=model, workers=2, worker_concurrency=64,
                                                       worker_args=["--redis-replica-acks", str(acks)]))
                  for acks, model in models.items()}  # fmt: skip
        lat = asyncio.run(_interleaved(s.url, models, args.latency_n))
        rates: dict[int, list[float]] = {acks: [] for acks in models}
        for _ in range(args.wait_rounds):
            for acks, model in models.items():
                started = time.monotonic()
                out = asyncio.run(main_job(s.url, str(fleets[acks].base_url), model, rollouts=args.rollouts,
                                           calls=args.calls, budget=args.calls * 100, cap=50, tokens=10, sleep=0,
                                           timeout=300))  # fmt: skip
                assert out.lost == 0 and out.overshoot == 0, out.summary()
                rates[acks].append(out.slots / (time.monotonic() - started))
    rows = []
    for acks in models:
        rows.append({
            "replica_acks": acks, "subcalls_per_s": round(statistics.median(rates[acks]), 1),
            "subcalls_per_s_runs": [round(r, 1) for r in rates[acks]],
            "latency_median_s": round(lat[acks]["median"], 4), "latency_p90_s": round(lat[acks]["p90"], 4),
            "grant_median_ms": round(1000 * lat[acks]["grant"], 3),
        })  # fmt: skip
        print("replica acks:", json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rtts", default="0,1,5,20", help="round trips between hosts, milliseconds (comma-separated)")
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--calls", type=int, default=250)
    p.add_argument("--latency-n", type=int, default=40)
    p.add_argument("--rpm", type=int, default=600)
    p.add_argument("--tpm", type=int, default=100_000)
    p.add_argument("--window", type=float, default=60.0)
    p.add_argument("--quota-rtt", type=float, default=1.0)
    p.add_argument("--quota-rollouts", type=int, default=3, help="rollouts per trainer host")
    p.add_argument("--quota-calls", type=int, default=250, help="sub-calls per rollout")
    p.add_argument("--skip-rtt", action="store_true")
    p.add_argument("--skip-quota", action="store_true")
    p.add_argument("--failovers", type=int, default=3, help="Sentinel failovers mid-job (0: none)")
    p.add_argument("--wait-cost", action="store_true", help="only: the cost of --redis-replica-acks 1 vs 0")
    p.add_argument("--wait-rounds", type=int, default=3, help="--wait-cost runs of each setting, interleaved")
    p.add_argument(
        "--unreplicated-failovers",
        type=int,
        default=0,
        help="only: failovers that lose the master's last grants, with and without acknowledgement",
    )
    p.add_argument("--quick", action="store_true", help="window 10 s (rpm, tpm scaled), fewer calls")
    p.add_argument("--output", default=None, help="default bench/results/fleet_hosts.json")
    args = p.parse_args()
    if args.quick:
        args.window, args.rpm, args.tpm = 10.0, args.rpm // 6, args.tpm // 6
        args.quota_calls, args.calls, args.latency_n = 42, 100, 20
    out: dict[str, Any] = {"machine": f"{platform.node()} {platform.machine()}, {platform.python_version()}"}
    if args.wait_cost or args.unreplicated_failovers:
        if args.wait_cost:
            out["replica_acks"] = wait_cost(args)
        if args.unreplicated_failovers:
            out["unreplicated_failover"] = unreplicated_failovers(args.unreplicated_failovers)
        if args.failovers:
            out["failover"] = failovers(args.failovers)
        path = Path(args.output) if args.output else RESULTS / "fleet_replica_acks.json"
        path.write_text(json.dumps(out, indent=2) + "\n")
        print(f"saved {path}")
        return
    if not args.skip_rtt:
        out["round_trips"] = [one_host(args)]
        print("one host:", json.dumps(out["round_trips"][-1]), flush=True)
        for rtt in (float(x) for x in args.rtts.split(",")):
            out["round_trips"].append(hosts(args, rtt))
            print(f"hosts {rtt:g} ms apart:", json.dumps(out["round_trips"][-1]), flush=True)
        base = out["round_trips"][0]["latency_median_s"]
        for row in out["round_trips"]:
            row["added_latency_ms"] = round(1000 * (row["latency_median_s"] - base), 1)
    if not args.skip_quota:
        out["provider_quota"] = [quota_run(args, True), quota_run(args, False)]
        for row in out["provider_quota"]:
            print("provider quota:", json.dumps(row), flush=True)
    if args.failovers:
        out["failover"] = failovers(args.failovers)
    path = Path(args.output) if args.output else RESULTS / "fleet_hosts.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
