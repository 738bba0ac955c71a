"""Soak: rollouts for a bounded time against a local fleet while faults are injected on a schedule.

    python bench/soak.py [--seconds 600] [--workers 3] [--rollouts 6] [--batch 24] [--drop-rate 0.01]

Starts its own ``redis-server`` (so it can restart it), the scripted model and ``--workers``
``rlmq worker`` processes (``--heartbeat-ttl 2``), then runs ``--rollouts`` rollouts at a
time, each with a sub-LLM budget and two ``llm_batch`` calls whose prompts carry model
fault directives (429 + Retry-After, 500, 503, malformed JSON, no usage, connection resets,
slow calls). The producer and the workers reach Redis through two fault proxies
(``tests/faults/proxy.py``) that drop ``--drop-rate`` of the commands after Redis ran them
(the client sees a lost reply and sends the command again). Every ``--fault-every`` seconds
the next fault of the cycle is injected: ``kill -9`` a worker (and start a new one), SIGTERM
a worker (and start a new one), a 2-second burst of ``-READONLY`` replies to every write on
both sides, restart Redis (no persistence).

Prints and writes to ``bench/results/soak.json``: rollouts finished, sub-calls answered,
errors by kind, results lost (a slot that got no worker result although no Redis restart
overlapped its batch; must be 0), duplicates delivered to the REPL (must be 0), budget
overshoot (tokens the model server served to a rollout beyond its budget; must be 0),
wedged workers (alive, but still holding jobs or silent 30 s after the load stopped; must be
0) and p50/p99 batch time, overall and for batches overlapping a fault window (fault time + 15 s).

Fleet conditions: ``--acl`` runs the workers and the producer as the ACL users of
:mod:`rlmq.common.acl` (a tenant producer, confined to ``soak_*`` rollouts; the users are
created again after each Redis restart); ``--skew S`` keeps one worker whose wall clock runs
``S`` seconds ahead (libfaketime); ``--result-ttl`` sets the workers' RQ result TTL; every
``--sample-every`` seconds Redis's ``used_memory``, key count and the sizes of RQ's finished
and failed registries and worker sets are sampled (``memory_curve``; ``memory_flat`` compares
the last third of the run with the middle third). ``--faults`` picks the fault cycle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rlmq.producer.dispatch as dispatch_mod  # noqa: E402
from rlmq.cli.local import LocalFleet  # noqa: E402
from rlmq.common import keys as K  # noqa: E402
from rlmq.common.acl import acl_rules  # noqa: E402
from rlmq.common.redis_server import EmbeddedRedis  # noqa: E402
from rlmq.common.schemas import DatasetRow, SubLLMResult  # noqa: E402
from rlmq.common.settings import load_settings  # noqa: E402
from rlmq.producer.env import RLMEnv  # noqa: E402
from rlmq.scripted.server import root_code_directive  # noqa: E402
from tests.faults.proxy import FaultProxy  # noqa: E402
from tests.fleet.harness import skewed_env  # noqa: E402

FAULT_WINDOW = 15.0
DIRECTIVES = [
    ("", 60),
    ("[[mock:sleep:1]]", 10),
    ("[[mock:spend-all]]", 8),
    ("[[mock:status:429:retry-after=0.5]] [[mock:fail-times:1]]", 4),
    ("[[mock:status:503]] [[mock:fail-times:2]]", 4),
    ("[[mock:status:500]]", 2),
    ("[[mock:malformed]] [[mock:fail-times:1]]", 3),
    ("[[mock:no-usage]]", 3),
    ("[[mock:reset]] [[mock:fail-times:1]]", 3),
    ("[[mock:sleep:30]]", 1),  # slower than the sub-call deadline
]


def memory_flat(samples: list[dict[str, float]], slacks: tuple[tuple[str, int], ...]) -> dict[str, Any]:
    """Whether each sampled figure stays flat: the last third of ``samples`` peaks within 20 % of
    the middle third's peak plus its slack (``(figure, slack)`` pairs: bytes, keys, members)."""
    n = len(samples)
    if n < 6:
        return {"flat": None, "why": f"{n} samples"}
    mid, last = samples[n // 3 : 2 * n // 3], samples[2 * n // 3 :]
    out: dict[str, Any] = {}
    for key, slack in slacks:
        a, b = max(x[key] for x in mid), max(x[key] for x in last)
        out[key] = {"middle_max": a, "last_max": b, "flat": b <= 1.2 * a + slack}
    out["flat"] = all(v["flat"] for v in out.values() if isinstance(v, dict))
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 3)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.batches: list[dict[str, Any]] = []
        self.seen: dict[tuple[str, str, int], set[bytes]] = {}
        """Distinct results read per slot: a re-read after a dropped reply is the same entry, not a duplicate."""
        self.faults: list[tuple[float, str]] = []
        self.restarts: list[tuple[float, float]] = []  # (down, up) wall times of Redis restarts
        self.rollouts_done = 0
        self.rollout_errors: Counter[str] = Counter()
        self.budgets: dict[str, int] = {}
        self.workers: dict[str, Any] = {}
        self.worker_seq = 0
        self.rng = random.Random(args.seed)
        self.wedged: list[str] = []
        self.skewed: set[str] = set()
        self.samples: list[dict[str, float]] = []
        self.users: dict[str, tuple[str, str, str | None]] = {}  # role -> (name, password, tenant)

    # -------------------------------------------------------------- instrumentation

    def instrument(self) -> None:
        real_load, real_run = dispatch_mod.load_result, dispatch_mod.Dispatcher.run_batch
        soak = self

        def counting(raw: str | bytes) -> SubLLMResult:
            res = real_load(raw)
            soak.seen.setdefault((res.rollout_id, res.batch_id, res.index), set()).add(
                raw if isinstance(raw, bytes) else raw.encode()
            )
            return res

        async def timed(self: Any, spec: Any, prompts: list[str]) -> list[SubLLMResult]:
            t0 = time.time()
            results = await real_run(self, spec, prompts)
            soak.batches.append({"start": t0, "end": time.time(), "n": len(prompts), "results": results,
                                 "rollout": spec.rollout_id, "timeout": spec.sub_call_timeout,
                                 "slow": {i for i, p in enumerate(prompts) if "[[mock:sleep:30]]" in p}})  # fmt: skip
            return results

        dispatch_mod.load_result = counting  # type: ignore[assignment]
        dispatch_mod.Dispatcher.run_batch = timed  # type: ignore[method-assign]

    # -------------------------------------------------------------- fleet & faults

    def start_worker(self, fleet: LocalFleet) -> None:
        self.worker_seq += 1
        name = f"soak-w{self.worker_seq}-{uuid.uuid4().hex[:4]}"
        skew = self.args.skew and not any(n in self.skewed for n in self.live_workers())
        env = dict(fleet.worker_env)
        if skew:  # one live worker at a time runs with its clock ahead
            fleet.worker_env = {**env, **skewed_env(self.args.skew)}
            self.skewed.add(name)
        try:
            self.workers[name] = fleet.start_worker(name, ["--name", name])
        finally:
            fleet.worker_env = env

    def create_users(self, admin_url: str) -> None:
        """(Re)create the ACL users (a restarted Redis without persistence forgot them)."""
        import redis

        client = redis.Redis.from_url(admin_url)
        try:
            for role, (name, password, tenant) in self.users.items():
                client.execute_command(
                    "ACL", "SETUSER", name, "reset", "on", f">{password}", *acl_rules(role.split(":")[0], tenant)
                )
        finally:
            client.close()

    async def sample(self, admin_url: str, stop: asyncio.Event) -> None:
        """Every ``--sample-every`` seconds: Redis memory, keys, registry and worker-set sizes."""
        import redis

        client = redis.Redis.from_url(admin_url, socket_timeout=5)
        t0 = time.time()
        try:
            while not stop.is_set():
                try:
                    queues = [K.queue_of_key(q) for q in client.smembers(K.RQ_QUEUES)]
                    regs = sum(client.zcard(K.rq_finished(q)) + client.zcard(K.rq_failed(q)) for q in queues)
                    wsets = client.scard(K.RQ_WORKERS) + sum(client.scard(K.rq_workers_of_queue(q)) for q in queues)
                    self.samples.append({
                        "t": round(time.time() - t0, 1), "used_memory": int(client.info("memory")["used_memory"]),
                        "keys": int(client.dbsize()), "registry_members": int(regs), "worker_set_members": int(wsets),
                    })  # fmt: skip
                except (redis.RedisError, OSError):
                    pass  # Redis restarting: no sample this time
                try:
                    await asyncio.wait_for(stop.wait(), self.args.sample_every)
                except TimeoutError:
                    pass
        finally:
            client.close()

    def memory_flat(self) -> dict[str, Any]:
        """Last third of the samples against the middle third: memory and registries must not grow."""
        if self.restarts:
            return {"flat": None, "why": "Redis restarted during the run: memory starts again from empty"}
        return memory_flat(self.samples, (("used_memory", 2_000_000), ("registry_members", 200), ("keys", 500)))

    def live_workers(self) -> list[str]:
        return [n for n, p in self.workers.items() if p.poll() is None]

    async def inject(
        self, fleet: LocalFleet, server: EmbeddedRedis, proxies: list[FaultProxy], stop: asyncio.Event
    ) -> None:
        cycle = self.args.faults.split(",")
        i = 0
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.args.fault_every)
                return
            except TimeoutError:
                pass
            kind = cycle[i % len(cycle)]
            i += 1
            now = time.time()
            self.faults.append((now, kind))
            live = self.live_workers()
            if kind in ("kill9", "sigterm") and live:
                victim = self.rng.choice(live)
                os.kill(self.workers[victim].pid, signal.SIGKILL if kind == "kill9" else signal.SIGTERM)
                self.start_worker(fleet)
            elif kind == "readonly_burst":
                for proxy in proxies:
                    proxy.refuse_writes(2.0)
            elif kind == "redis_restart":
                server.stop()
                server.start()
                if self.users:
                    self.create_users(server.url)
                self.restarts.append((now, time.time()))
            print(f"[{time.strftime('%H:%M:%S')}] fault: {kind}", flush=True)

    # -------------------------------------------------------------- rollouts

    def question(self) -> str:
        population = [d for d, _ in DIRECTIVES]
        weights = [w for _, w in DIRECTIVES]
        codes = []
        for _ in range(2):
            prompts = [
                f"Soak {uuid.uuid4().hex[:6]} item {j}. The code is {j}. What is the code? "
                + self.rng.choices(population, weights)[0]
                for j in range(self.args.batch)
            ]
            codes.append(f"out = llm_batch({prompts!r})\nprint(len(out))")
        codes[-1] += "\nanswer['content'] = 'done'\nanswer['ready'] = True"
        return "Soak. " + root_code_directive(codes[0]) + root_code_directive(codes[1], turn=2)

    def find_wedged(self, redis_url: str, queue: str, timeout: float = 30.0) -> list[str]:
        """Live workers that still hold jobs, or stopped heartbeating, ``timeout`` s after the load."""
        import redis

        client = redis.Redis.from_url(redis_url)
        deadline = time.monotonic() + timeout
        try:
            while True:
                bad = []
                for name in self.live_workers():
                    holding = client.scard(K.rq_worker_executions(name))
                    alive = (client.zscore(K.serving(queue), name) or 0) > time.time()
                    if holding or not alive:
                        bad.append(f"{name} (holding {holding}, heartbeat {'ok' if alive else 'stale'})")
                if not bad or time.monotonic() > deadline:
                    return bad
                time.sleep(0.5)  # polling other processes' state, bounded by the deadline
        finally:
            client.close()

    async def rollouts(self, env: RLMEnv, model: str, stop: asyncio.Event) -> None:
        async def one() -> None:
            while not stop.is_set():
                rid = f"soak_{uuid.uuid4().hex[:12]}"
                self.budgets[rid] = self.args.budget
                row = DatasetRow(id=rid, question=self.question(), context="x")
                try:
                    res = await env.rollout(row, model=model, rollout_id=rid)
                except Exception as exc:  # Redis down while the rollout started
                    self.rollout_errors[type(exc).__name__] += 1
                    await asyncio.sleep(0.5)  # back off before the next rollout, not synchronisation
                    continue
                if res.row.stop_reason == "answer_ready":
                    self.rollouts_done += 1
                else:
                    self.rollout_errors[res.row.stop_reason] += 1

        await asyncio.gather(*(one() for _ in range(self.args.rollouts)))

    # -------------------------------------------------------------- report

    def served_per_user(self, base_url: str) -> dict[str, Any]:
        with urllib.request.urlopen(base_url.removesuffix("/v1") + "/stats", timeout=10) as resp:
            stats: dict[str, Any] = json.load(resp)
        return dict(stats["per_user"])

    def report(self, base_url: str, seconds: float) -> dict[str, Any]:
        errors: Counter[str] = Counter()
        statuses: Counter[str] = Counter()
        lost = 0
        lost_in_restart = 0
        times, fault_times = [], []
        for b in self.batches:
            overlap_restart = any(down <= b["end"] and up >= b["start"] - b["timeout"] for down, up in self.restarts)
            in_fault = any(t <= b["end"] and b["start"] <= t + FAULT_WINDOW for t, _ in self.faults)
            dt = b["end"] - b["start"]
            times.append(dt)
            if in_fault:
                fault_times.append(dt)
            for r in b["results"]:
                statuses[r.status] += 1
                if r.index in b["slow"]:
                    continue  # slower than its deadline on purpose: a deadline error is the right result
                if r.status == "error":
                    errors[r.error_kind or "unknown"] += 1
                lost_kinds = ("deadline", "no_worker", "redis", "redis_lost")
                if r.status == "error" and r.error_kind in lost_kinds and not r.worker:
                    if overlap_restart:
                        lost_in_restart += 1
                    else:
                        lost += 1
        errors["deadline_slow_on_purpose"] = sum(
            1 for b in self.batches for r in b["results"] if r.index in b["slow"] and r.error_kind == "deadline"
        )
        duplicates = sum(len(v) - 1 for v in self.seen.values() if len(v) > 1)
        served = self.served_per_user(base_url)
        overshoot = sum(max(0, served.get(rid, {}).get("completion_tokens", 0) - b) for rid, b in self.budgets.items())
        answered = sum(statuses.values())
        return {
            "seconds": round(seconds, 1),
            "rollouts_finished": self.rollouts_done,
            "rollout_errors": dict(self.rollout_errors),
            "batches": len(self.batches),
            "sub_calls_answered": answered,
            "sub_calls_by_status": dict(statuses),
            "errors_by_kind": dict(errors),
            "results_lost": lost,
            "results_lost_with_redis_state": lost_in_restart,
            "duplicates_delivered": duplicates,
            "budget_overshoot_tokens": overshoot,
            "wedged_workers": self.wedged,
            "faults": dict(Counter(k for _, k in self.faults)),
            "batch_seconds_p50": pct(times, 0.5),
            "batch_seconds_p99": pct(times, 0.99),
            "batch_seconds_p99_during_faults": pct(fault_times, 0.99),
            "batches_during_faults": len(fault_times),
            "conditions": {
                "acl": self.args.acl,
                "skew_seconds": self.args.skew,
                "result_ttl": self.args.result_ttl,
                "skewed_workers": sorted(self.skewed),
                "faults": self.args.faults,
            },  # fmt: skip
            "memory_flat": self.memory_flat(),
            "memory_curve": self.samples,
        }


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    soak = Soak(args)
    soak.instrument()
    server = EmbeddedRedis().start()
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    worker_proxy = FaultProxy(port, seed=args.seed).start()
    producer_proxy = FaultProxy(port, seed=args.seed + 1).start()
    proxies = [worker_proxy, producer_proxy]
    logs = tempfile.mkdtemp(prefix="rlmq-soak-")
    model = f"soak-{uuid.uuid4().hex[:6]}"
    worker_url, producer_url = worker_proxy.url, producer_proxy.url
    if args.acl:
        for role, tenant in (("worker", None), ("producer", "soak")):
            soak.users[role] = (f"soak-{role}", uuid.uuid4().hex, tenant)
        soak.create_users(server.url)

        def with_user(url: str, role: str) -> str:
            name, password, _ = soak.users[role]
            return url.replace("redis://", f"redis://{name}:{password}@", 1)

        worker_url, producer_url = with_user(worker_url, "worker"), with_user(producer_url, "producer")
    fleet = LocalFleet(
        redis_url=worker_url, model=model, workers=0, worker_concurrency=args.concurrency,
        worker_args=["--heartbeat-ttl", "2"], log_dir=logs,
        worker_env={"RLMQ_RESULT_TTL": str(args.result_ttl)} if args.result_ttl is not None else None,
    )  # fmt: skip
    try:
        fleet.start()
        for _ in range(args.workers):
            soak.start_worker(fleet)
        fleet.wait_for_workers(args.workers)
        for proxy in proxies:
            proxy.drop_rate = args.drop_rate
        settings = load_settings(
            redis_url=producer_url, base_url=fleet.base_url, model=model, sub_call_timeout=args.sub_call_timeout,
            tenant="soak",
        )  # fmt: skip
        stop = asyncio.Event()
        t0 = time.time()
        async with RLMEnv(
            settings=settings, sub_llm_max_completion_tokens=args.budget, sub_llm_per_call_max_tokens=40,
            max_sub_llm_parallelism=args.batch, code_execution_timeout=args.sub_call_timeout + 30,
        ) as env:  # fmt: skip
            work = asyncio.create_task(soak.rollouts(env, model, stop))
            faults = asyncio.create_task(soak.inject(fleet, server, proxies, stop))
            sampler = asyncio.create_task(soak.sample(server.url, stop))
            await asyncio.sleep(args.seconds)  # the soak's duration
            stop.set()
            await faults
            await sampler
            await asyncio.wait_for(work, args.sub_call_timeout + 120)
        for proxy in proxies:
            proxy.drop_rate = 0.0
        soak.wedged = await asyncio.to_thread(soak.find_wedged, server.url, K.queue_name_for_model(model))
        report = soak.report(str(fleet.base_url), time.time() - t0)
        report["connection_drops"] = {"workers": worker_proxy.stats.dropped, "producer": producer_proxy.stats.dropped}
        report["commands_through_proxies"] = worker_proxy.stats.forwarded + producer_proxy.stats.forwarded
        report["writes_refused_readonly"] = worker_proxy.stats.refused + producer_proxy.stats.refused
        report["logs"] = logs
        report["workers_started"] = soak.worker_seq
        return report
    finally:
        fleet.stop()
        for proxy in proxies:
            proxy.stop()
        server.stop()
        _ = K  # keys imported for readers of this script


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=64, help="in-flight sub-calls per worker")
    p.add_argument("--rollouts", type=int, default=6, help="rollouts run at once")
    p.add_argument("--batch", type=int, default=24, help="prompts per llm_batch")
    p.add_argument("--budget", type=int, default=1500, help="sub-LLM completion tokens per rollout")
    p.add_argument("--sub-call-timeout", type=float, default=20.0)
    p.add_argument("--fault-every", type=float, default=20.0, help="seconds between injected faults")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drop-rate", type=float, default=0.01, help="share of commands whose reply the proxies drop")
    p.add_argument("--faults", default="kill9,sigterm,readonly_burst,redis_restart", help="the fault cycle")
    p.add_argument("--acl", action="store_true", help="workers and producer as rlmq's ACL users")
    p.add_argument("--skew", type=float, default=0.0, help="one worker's clock this many seconds ahead (libfaketime)")
    p.add_argument("--result-ttl", type=int, default=None, help="the workers' RQ result TTL (seconds)")
    p.add_argument("--sample-every", type=float, default=15.0, help="seconds between Redis memory samples")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "soak.json"))
    args = p.parse_args()
    report = asyncio.run(amain(args))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    width = max(len(k) for k in report)
    for k, v in report.items():
        print(f"{k:<{width}}  {v}")
    ok = (
        report["results_lost"] == 0
        and report["duplicates_delivered"] == 0
        and report["budget_overshoot_tokens"] == 0
        and not report["wedged_workers"]
        and report["memory_flat"].get("flat") is not False
    )
    print("zeros hold" if ok else "ZEROS VIOLATED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
