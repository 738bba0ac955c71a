"""Tree soak: recursive trees that live for minutes, paced like a real model server, while
workers and REPL hosts are killed and Redis restarts.

    python -m bench.tree_soak [--seconds 1800] [--trees 6] [--tps 60] [--fault-every 60]

Starts its own persistent ``redis-server`` (append-only, fsynced at every write, as a fleet's
Redis must be: a restart keeps every key), the scripted model (a test double: every answer is
200-2,000 tokens, decoded at ``--tps`` tokens per second, so a sub-call takes seconds), plain
``rlmq worker`` processes and ``rlmq worker --repl-slots`` hosts. One ``RLMEnv`` keeps
``--trees`` trees of depth 3 in flight, starting a new one whenever one ends: the top asks two
children (depth 2), each of which asks three sub-LLM calls and then two grandchildren (depth 3),
each of which asks three sub-LLM calls. Every ``--fault-every`` seconds the next fault of the
cycle strikes: ``kill -9`` of a plain worker, ``kill -9`` of a REPL host (each replaced at
once), a Redis restart. With two REPL hosts and one of them killed every three faults, a long child
can lose two hosts in a row: workers run with ``--job-max-attempts`` 3 (``job_max_attempts``).

Every prompt of a tree carries a ``[[mock:tag:<tree>]]``, so the model server counts what it
served to each tree (sub-calls and child root turns; the top's own root turns are not charged to
the tree's budget and carry no tag). Prints and writes ``bench/results/tree_soak.json``:

* ``slots_bad``: ``llm_batch`` / ``rlm_batch`` slots (at every depth) refused or failed for any
  reason other than a spent budget, with their texts (must be 0);
* ``stalls``: calls refused after waiting out their deadline for tokens held by running calls,
  and trees that ran past ``--tree-timeout`` (must be 0); ``tree_seconds`` p50 / p99 / max;
* ``overshoot_tokens``: tokens served to a tree beyond its budget (must be 0);
* ``memory``: Redis ``used_memory`` and key count every ``--sample-every`` seconds, and
  whether the last third of the run stays within 20 % (+2 MB) of the middle third.

Exit status 0 when every zero holds and memory is flat.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from typing import Any

from bench.soak import memory_flat
from rlmq.cli.local import LocalFleet
from rlmq.common.redis_server import EmbeddedRedis
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv
from rlmq.scripted.server import root_code_directive

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tree_soak.json")

LEAF = """
out = llm_batch([{prompts}])
answer['content'] = f'leaf {{sum(not x.startswith("[") for x in out)}}/{{len(out)}}'
answer['ready'] = True
"""

MIDDLE = """
out = llm_batch([{prompts}])
kids = rlm_batch([{tasks}])
answer['content'] = f'mid {{sum(not x.startswith("[") for x in out)}} ' + ' | '.join(kids)
answer['ready'] = True
"""

TOP = """
kids = rlm_batch([{tasks}])
answer['content'] = ' || '.join(kids)
answer['ready'] = True
"""


def tree_question(tree: str, tps: float, fanout: int = 2, calls: int = 3) -> str:
    """The top's question: two children, each with ``calls`` sub-calls and two grandchildren."""
    tags = f"[[mock:tag:{tree}]] [[mock:tps:{tps:g}]]"

    def prompts(level: str) -> str:
        return ", ".join(
            repr(f"{level} {uuid.uuid4().hex[:8]} call {i}: summarise. [[mock:tokens:200-2000]] {tags}")
            for i in range(calls)
        )

    leaf = root_code_directive(LEAF.format(prompts=prompts("leaf")))
    grandchildren = ", ".join(repr(f"grandchild {i} {tags} {leaf}") for i in range(fanout))
    middle = root_code_directive(MIDDLE.format(prompts=prompts("mid"), tasks=grandchildren))
    children = ", ".join(repr(f"child {i} {tags} {middle}") for i in range(fanout))
    return f"tree {tree} " + root_code_directive(TOP.format(tasks=children))


def slots(trajectory: list[Any], depth: int = 1) -> list[tuple[int, dict[str, Any]]]:
    """``(depth, result)`` of every ``llm_batch`` / ``rlm_batch`` slot of a tree, at every depth."""
    out: list[tuple[int, dict[str, Any]]] = []
    for event in trajectory:
        if not isinstance(event, dict) or event.get("type") not in ("llm_batch", "rlm_batch"):
            continue
        for res in event.get("results") or []:
            out.append((depth, res))
            child = res.get("child") or {}
            out.extend(slots(child.get("trajectory") or [], depth + 1))
    return out


def classify(res: dict[str, Any]) -> str:
    """``ok``, ``budget`` (refused because the budget is spent: allowed), ``stall`` (waited out
    its deadline for tokens held by running calls) or ``bad`` (anything else)."""
    content = str(res.get("content") or "")
    if res.get("status") == "ok":
        child = res.get("child") or {}
        return "budget" if child.get("stop_reason") == "budget_spent" else "ok"
    if "waited" in content and "held by running calls" in content:
        return "stall"
    if res.get("status") == "rejected" and ("budget spent" in content or "budget ran out" in content):
        return "budget"
    return "bad"


class TreeSoak:
    """The soak's state: the fleet's processes, the faults struck, what every tree did."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.workers: dict[str, Any] = {}  # name -> process
        self.hosts: set[str] = set()  # the names of REPL hosts
        self.seq = 0
        self.faults: list[tuple[float, str]] = []
        self.trees: list[dict[str, Any]] = []
        self.samples: list[dict[str, float]] = []
        self.budgets: dict[str, int] = {}

    def start_worker(self, fleet: LocalFleet, host: bool) -> None:
        self.seq += 1
        name = f"{'host' if host else 'w'}{self.seq}-{uuid.uuid4().hex[:4]}"
        extra = ["--repl-slots", str(self.args.repl_slots)] if host else []
        self.workers[name] = fleet.start_worker(name, ["--name", name, *extra])
        if host:
            self.hosts.add(name)

    def live(self, host: bool) -> list[str]:
        return [n for n, p in self.workers.items() if p.poll() is None and (n in self.hosts) == host]

    async def inject(self, fleet: LocalFleet, server: EmbeddedRedis, stop: asyncio.Event) -> None:
        cycle = self.args.faults.split(",")
        for i in range(10**6):
            try:
                await asyncio.wait_for(stop.wait(), self.args.fault_every)
                return
            except TimeoutError:
                pass
            kind = cycle[i % len(cycle)]
            if kind in ("kill9_worker", "kill9_host"):
                host = kind == "kill9_host"
                victims = self.live(host)
                if victims:
                    os.kill(self.workers[self.rng.choice(victims)].pid, signal.SIGKILL)
                    self.start_worker(fleet, host)
            elif kind == "redis_restart":
                await asyncio.to_thread(server.restart)
            self.faults.append((time.time(), kind))
            print(f"[{time.strftime('%H:%M:%S')}] fault: {kind}", flush=True)

    async def sample(self, url: str, stop: asyncio.Event) -> None:
        import redis

        client = redis.Redis.from_url(url, socket_timeout=5)
        t0 = time.time()
        try:
            while not stop.is_set():
                try:
                    info = client.info("memory")
                    self.samples.append({"t": round(time.time() - t0, 1), "used_memory": int(info["used_memory"]),
                                         "keys": int(client.dbsize())})  # fmt: skip
                except (redis.RedisError, OSError):
                    pass  # Redis restarting: no sample this time
                try:
                    await asyncio.wait_for(stop.wait(), self.args.sample_every)
                except TimeoutError:
                    pass
        finally:
            client.close()

    async def run_trees(self, env: RLMEnv, model: str, stop: asyncio.Event) -> None:
        async def one(slot: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                tree = f"t{slot}x{n}{uuid.uuid4().hex[:6]}"
                self.budgets[tree] = self.args.budget
                row = DatasetRow(id=tree, question=tree_question(tree, self.args.tps), context="x")
                t0 = time.time()
                try:
                    res = await env.rollout(row, model=model, rollout_id=tree)
                except Exception as exc:  # noqa: BLE001 - a rollout that could not even start is a finding
                    self.trees.append({"id": tree, "start": t0, "seconds": time.time() - t0, "stop": "raised",
                                       "error": repr(exc)[:300], "slots": []})  # fmt: skip
                    continue
                self.trees.append({
                    "id": tree, "start": t0, "seconds": time.time() - t0, "stop": res.row.stop_reason,
                    "error": res.row.error, "slots": [(d, classify(r), str(r.get("content"))[:200])
                                                      for d, r in slots(res.trajectory)],
                    "charged": res.row.metrics.get("tree_charged_completion_tokens"),
                })  # fmt: skip
                print(f"[{time.strftime('%H:%M:%S')}] tree {tree}: {res.row.stop_reason} in "
                      f"{time.time() - t0:.0f} s", flush=True)  # fmt: skip

        await asyncio.gather(*(one(i) for i in range(self.args.trees)))

    def report(self, base_url: str, seconds: float) -> dict[str, Any]:
        with urllib.request.urlopen(base_url.removesuffix("/v1") + "/stats", timeout=10) as resp:
            served = json.load(resp)["per_tag"]
        kinds: Counter[str] = Counter()
        bad: list[str] = []
        stalls: list[str] = []
        for t in self.trees:
            for depth, kind, text in t["slots"]:
                kinds[kind] += 1
                if kind == "bad":
                    bad.append(f"{t['id']} depth {depth}: {text}")
                elif kind == "stall":
                    stalls.append(f"{t['id']} depth {depth}: {text}")
            if t["stop"] not in ("answer_ready",):
                bad.append(f"{t['id']}: tree ended {t['stop']} {t.get('error')}")
            if t["seconds"] > self.args.tree_timeout:
                stalls.append(f"{t['id']}: {t['seconds']:.0f} s")
        overshoot = {
            tree: served[tree]["completion_tokens"] - budget
            for tree, budget in self.budgets.items()
            if tree in served and served[tree]["completion_tokens"] > budget
        }
        durations = sorted(t["seconds"] for t in self.trees) or [0.0]
        return {
            "seconds": round(seconds, 1),
            "trees_finished": len(self.trees),
            "slots_by_kind": dict(kinds),
            "slots_bad": len(bad),
            "slots_bad_examples": bad[:20],
            "stalls": len(stalls),
            "stall_examples": stalls[:20],
            "overshoot_tokens": sum(overshoot.values()),
            "overshoot_trees": overshoot,
            "tokens_served_to_trees": sum(v["completion_tokens"] for v in served.values()),
            "tree_seconds": {
                "p50": round(statistics.median(durations), 1),
                "p99": round(durations[min(len(durations) - 1, int(0.99 * len(durations)))], 1),
                "max": round(durations[-1], 1),
            },  # fmt: skip
            "faults": dict(Counter(k for _, k in self.faults)),
            "workers_started": self.seq,
            "memory": memory_flat(self.samples, (("used_memory", 2_000_000), ("keys", 500))),
            "memory_curve": self.samples,
            "args": vars(self.args),
        }


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    soak = TreeSoak(args)
    server = EmbeddedRedis(persistent=True).start()
    model = f"treesoak-{uuid.uuid4().hex[:6]}"
    log_dir = tempfile.mkdtemp(prefix="rlmq-tree-soak-")
    fleet = LocalFleet(
        redis_url=server.url, model=model, workers=0, worker_concurrency=args.concurrency,
        worker_args=["--heartbeat-ttl", "5"], log_dir=log_dir,
        worker_env={"RLMQ_JOB_MAX_ATTEMPTS": str(args.job_max_attempts)},
    )  # fmt: skip
    try:
        fleet.start()
        for i in range(args.workers + args.hosts):
            soak.start_worker(fleet, host=i >= args.workers)
        fleet.wait_for_workers(args.workers + args.hosts)
        settings = load_settings(
            redis_url=server.url, base_url=fleet.base_url, model=model, max_depth=3,
            sub_call_timeout=args.sub_call_timeout, rollout_timeout=args.tree_timeout,
        )  # fmt: skip
        stop = asyncio.Event()
        t0 = time.time()
        async with RLMEnv(settings=settings, sub_llm_max_completion_tokens=args.budget) as env:
            work = asyncio.create_task(soak.run_trees(env, model, stop))
            faults = asyncio.create_task(soak.inject(fleet, server, stop))
            sampler = asyncio.create_task(soak.sample(server.url, stop))
            await asyncio.sleep(args.seconds)  # the soak's duration
            stop.set()
            await faults
            await asyncio.wait_for(work, args.tree_timeout + 60)
            await sampler
        report = soak.report(str(fleet.base_url), time.time() - t0)
        report["logs"] = log_dir
        return report
    finally:
        fleet.stop()
        server.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=1800, help="how long trees keep starting")
    p.add_argument("--trees", type=int, default=6, help="trees in flight at once")
    p.add_argument("--budget", type=int, default=8_000, help="completion tokens per tree")
    p.add_argument("--tps", type=float, default=60.0, help="tokens per second the scripted model decodes")
    p.add_argument("--workers", type=int, default=2, help="plain sub-LLM workers")
    p.add_argument("--hosts", type=int, default=2, help="REPL hosts (rlmq worker --repl-slots)")
    p.add_argument("--repl-slots", type=int, default=8, help="REPL slots per depth per host")
    p.add_argument("--concurrency", type=int, default=64, help="sub-calls in flight per worker")
    p.add_argument("--sub-call-timeout", type=float, default=120.0)
    p.add_argument("--tree-timeout", type=float, default=900.0, help="a tree's rollout_timeout (seconds)")
    p.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults")
    p.add_argument("--faults", default="kill9_worker,kill9_host,redis_restart", help="the fault cycle")
    p.add_argument("--sample-every", type=float, default=15.0, help="seconds between Redis memory samples")
    p.add_argument(
        "--job-max-attempts",
        type=int,
        default=3,
        help="the workers' job_max_attempts: a child whose "
        "host is killed this many times is lost (hosts die every 3 faults here)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    report = asyncio.run(amain(args))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    for k, v in report.items():
        if k not in ("memory_curve", "args"):
            print(f"{k:<24}  {v}")
    ok = not report["slots_bad"] and not report["stalls"] and not report["overshoot_tokens"]
    ok = ok and report["memory"].get("flat") is not False
    print("zeros hold" if ok else "ZEROS VIOLATED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
