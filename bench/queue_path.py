"""The queue-path benchmark: rlmq against in-process fan-out and stock RQ, in one run.

``python -m bench.queue_path [--quick] [--only NAMES] [--out STEM]``

Everything runs on 127.0.0.1 against one scripted model server (``rlmq mock-llm --port 0``,
its own process) and one dedicated embedded Redis (:class:`rlmq.common.redis_server.EmbeddedRedis`),
so other users of the machine's Redis neither disturb nor are disturbed by it.

Scenarios (names for ``--only``):

* ``openai5`` / ``openai``: in-process ``openai.AsyncOpenAI`` fan-out, as the reference
  ``RLMEnv`` does it: each rollout's ``llm_batch`` runs its prompts with a per-batch
  semaphore of 5 (the reference default) / unbounded. One client process.
* ``rq``: stock RQ ``SimpleWorker`` processes running one async job per call
  (``rlmq.workers.job.run_sub_llm``); the producer is rlmq's dispatcher.
* ``rlmq`` / ``rlmq-budget``: producer (``Dispatcher.run_batch``) -> Redis -> ``rlmq worker``
  processes -> model -> reply list; with ``budget`` every rollout has a ledger
  (``BudgetLedger.open``) and every sub-call reserves and settles tokens.
* ``light``: one prompt at a time: a direct model call vs rlmq (unbudgeted and budgeted),
  interleaved round by round in one process.
* ``slow``: one worker process, a model taking 2 s per call, 10,000 sub-calls at
  concurrency 1,000 (``--quick``: 0.5 s, 1,000 at 200).
* ``sweep``: throughput and latency against concurrency (the PNG).

Each client (the in-process fan-out, or rlmq's producer) runs in its own subprocess so its
CPU time (``getrusage``) and peak RSS are its own; worker, model-server and Redis CPU come
from the OS (``psutil`` / ``INFO cpu``); Redis commands from ``INFO commandstats`` deltas
(which count the commands Lua scripts run too), split into top-level and in-script by a
short ``MONITOR`` census. The numbers are printed as a table and saved to
``bench/results/queue_path.json`` (+ ``.png`` when matplotlib is installed: ``pip install
-e '.[bench]'``); ``--quick`` and ``--only`` runs to their own files beside it, ``--out``
anywhere. Nothing here asserts a timing (``tests/e2e/test_bench_smoke.py`` runs a small
one in CI and checks only that every figure is there).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from rlmq.common.aio import run as run_loop

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LOG_DIR = os.path.join(tempfile.gettempdir(), "rlmq-bench-logs")  # worker / stock-RQ logs
MODEL = "bench-scripted"
RQ_MODEL = "bench-stock-rq"
CAP = 256  # per-call max_tokens cap (and grant cap when budgeted)


def prompt(i: int) -> str:
    """A small sub-LLM prompt the scripted model answers from its text (about 200 bytes)."""
    name = f"ORCHID{i % 997}"
    return (
        f"Question: What is the code of vault {name}?\n"
        f"Text: The vault {name} sits in the north wing. Guards change at noon. "
        f"The code of vault {name} is {10000 + i}. Nobody else knows it."
    )


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


# ======================================================================================
# Client roles (each runs in its own subprocess; see ``_client_main``)
# ======================================================================================

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
    from rlmq.common.connection import async_client
    from rlmq.common.ledger import BudgetLedger
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
        from rlmq.common.connection import async_client
        from rlmq.common.ledger import BudgetLedger
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


def _client_main(a: argparse.Namespace) -> None:
    # Every client (the baselines and rlmq's producer alike) runs on the loop `rlmq run` uses:
    # uvloop when installed (common/aio.py), so the comparison stays like for like.
    out = run_loop(_client(a))
    print("RESULT " + json.dumps(out), flush=True)


# ======================================================================================
# Orchestrator: servers, workers, probes
# ======================================================================================


def _proc_hwm_mb(pid: int) -> float:
    """Peak RSS (VmHWM) of a live process, MB."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _proc_cpu(pid: int) -> float:
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    except psutil.Error:
        return 0.0


class Probe:
    """Snapshots of Redis and process counters; ``delta`` of two snapshots."""

    def __init__(self, redis_url: str) -> None:
        import redis

        self.r = redis.Redis.from_url(redis_url)

    def snap(self, worker_pids: list[int], model_pid: int | None) -> dict[str, Any]:
        cs = self.r.info("commandstats")
        calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in cs.items()}
        for noise in ("info", "monitor", "ping", "client|setname", "client|setinfo", "scard", "hello"):
            calls.pop(noise, None)
        stats = self.r.info("stats")
        cpu = self.r.info("cpu")
        return {
            "calls": calls,
            "net_in": int(stats["total_net_input_bytes"]),
            "net_out": int(stats["total_net_output_bytes"]),
            "redis_cpu": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
            "workers_cpu": sum(_proc_cpu(p) for p in worker_pids),
            "model_cpu": _proc_cpu(model_pid) if model_pid else 0.0,
            "t": time.perf_counter(),
        }

    @staticmethod
    def delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        keys = set(a["calls"]) | set(b["calls"])
        calls = {k: b["calls"].get(k, 0) - a["calls"].get(k, 0) for k in keys}
        return {
            "calls": {k: v for k, v in sorted(calls.items(), key=lambda kv: -kv[1]) if v},
            "commands": sum(calls.values()),
            "net_in": b["net_in"] - a["net_in"],
            "net_out": b["net_out"] - a["net_out"],
            "redis_cpu": b["redis_cpu"] - a["redis_cpu"],
            "workers_cpu": b["workers_cpu"] - a["workers_cpu"],
            "model_cpu": b["model_cpu"] - a["model_cpu"],
        }


@contextlib.contextmanager
def monitor(redis_url: str) -> Iterator[Counter[tuple[bool, str]]]:
    """Count commands seen by ``MONITOR`` while the block runs: ``(in_lua, NAME) -> n``."""
    import redis

    counts: Counter[tuple[bool, str]] = Counter()
    client = redis.Redis.from_url(redis_url)
    stop = threading.Event()
    ready = threading.Event()

    def run() -> None:
        with contextlib.suppress(Exception), client.monitor() as m:
            ready.set()
            for ev in m.listen():
                cmd = str(ev.get("command", "")).split(" ", 1)[0].strip('"').upper()
                if cmd in ("INFO", "PING", "CLIENT", "HELLO", "SCARD"):
                    continue
                counts[(ev.get("client_type") == "lua", cmd)] += 1
                if stop.is_set():
                    break

    th = threading.Thread(target=run, daemon=True)
    th.start()
    ready.wait(5)
    time.sleep(0.1)
    try:
        yield counts
    finally:
        time.sleep(0.3)
        stop.set()
        with contextlib.suppress(Exception):
            client.ping()  # one more event so the listener sees the stop flag
        th.join(3)
        with contextlib.suppress(Exception):
            client.close()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from rlmq.cli.local import ProcessGroup

        self.args = args
        self.quick = args.quick
        self.group = ProcessGroup()
        self.redis_url = ""
        self.base_url = ""
        self.model_pid: int | None = None
        self.rows: dict[str, dict[str, Any]] = {}
        self.census: dict[str, dict[str, Any]] = {}
        self.light: dict[str, dict[str, Any]] = {}
        self.sweep: dict[str, list[dict[str, Any]]] = {}
        self.slow: dict[str, Any] | None = None
        self.seq = 0
        os.makedirs(LOG_DIR, exist_ok=True)
        os.makedirs(RESULTS_DIR, exist_ok=True)

    # ---------------------------------------------------------------- infrastructure

    def start(self) -> None:
        from rlmq.cli.local import start_mock_llm
        from rlmq.common.redis_server import EmbeddedRedis

        self.redis = EmbeddedRedis().start()
        self.redis_url = self.redis.url
        self.base_url = start_mock_llm(self.group, latency=0.0)
        self.model_pid = self.group.procs[-1].pid
        self.probe = Probe(self.redis_url)

    def stop(self) -> None:
        self.group.stop(timeout=10)
        self.redis.stop()

    def _tag(self) -> str:
        self.seq += 1
        return f"s{self.seq}{os.getpid() % 1000}"

    def run_client(
        self,
        role: str,
        *,
        n: int,
        rollouts: int,
        batch: int,
        worker_pids: list[int] | None = None,
        sem: int = 0,
        budgeted: bool = False,
        model: str = MODEL,
        base_url: str | None = None,
        warmup: int | None = None,
        timeout: float = 120.0,
        model_pid: int | None = None,
        census: bool = False,
    ) -> dict[str, Any]:
        """Run one measured client subprocess; returns its figures merged with the probes'."""
        from rlmq.cli.local import child_env
        from rlmq.common import keys as K

        argv = [
            sys.executable, "-m", "bench.queue_path", "--role", role, "--n", str(n), "--rollouts", str(rollouts),
            "--batch", str(batch), "--sem", str(sem), "--base-url", base_url or self.base_url,
            "--redis-url", self.redis_url, "--model", model, "--queue", K.queue_name_for_model(model),
            "--tag", self._tag(), "--timeout", str(timeout),
            "--warmup", str(warmup if warmup is not None else min(n, max(rollouts * batch, 64))),
        ]  # fmt: skip
        if budgeted:
            argv.append("--budgeted")
        env = child_env({"PYTHONPATH": os.getcwd()})
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        pids = worker_pids or []
        mpid = model_pid if model_pid is not None else self.model_pid
        try:
            line = proc.stdout.readline()
            if line.strip() != "READY":
                raise RuntimeError(f"client {role} failed to start: {line!r}")
            s0 = self.probe.snap(pids, mpid)
            mon = monitor(self.redis_url) if census else contextlib.nullcontext(None)
            with mon as counts:
                proc.stdin.write("GO\n")
                proc.stdin.flush()
                out: dict[str, Any] | None = None
                for line in proc.stdout:
                    if line.startswith("RESULT "):
                        out = json.loads(line[7:])
                        break
                s1 = self.probe.snap(pids, mpid)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if out is None:
            raise RuntimeError(f"client {role} gave no result")
        d = Probe.delta(s0, s1)
        lat = out.pop("latencies")
        row: dict[str, Any] = {
            "n": n,
            "concurrency": rollouts * (min(batch, sem) if sem else batch),
            "rollouts": rollouts,
            "batch": batch,
            "wall_s": out["wall"],
            "calls_per_s": n / out["wall"],
            "p50_ms": pct(lat, 50) * 1000,
            "p99_ms": pct(lat, 99) * 1000,
            "mean_ms": statistics.fmean(lat) * 1000 if lat else float("nan"),
            "errors": out["errors"],
            "client_cpu_ms_per_call": out["cpu"] * 1000 / n,
            "client_peak_rss_mb": out["maxrss_mb"],
            "worker_cpu_ms_per_call": d["workers_cpu"] * 1000 / n,
            "worker_peak_rss_mb": max((_proc_hwm_mb(p) for p in pids), default=0.0),
            "model_cpu_ms_per_call": d["model_cpu"] * 1000 / n,
            "redis_cpu_ms_per_call": d["redis_cpu"] * 1000 / n,
            "redis_commands_per_call": d["commands"] / n,
            "redis_bytes_per_call": (d["net_in"] + d["net_out"]) / n,
            "redis_bytes_in_per_call": d["net_in"] / n,
            "redis_bytes_out_per_call": d["net_out"] / n,
            "redis_commands": {k: round(v / n, 3) for k, v in d["calls"].items()},
        }
        if "light" in out:
            paths = out["light"]
            row["paths"] = {
                k: {"n": len(v), "p50_ms": pct(v, 50) * 1000, "p99_ms": pct(v, 99) * 1000} for k, v in paths.items()
            }
            for k, v in paths.items():
                if k != "direct":  # each round's own difference to the direct call of that round
                    diffs = [x - d for x, d in zip(v, paths["direct"], strict=True)]
                    row["paths"][k]["paired_added_p50_ms"] = pct(diffs, 50) * 1000
                    row["paths"][k]["paired_added_p99_ms"] = pct(diffs, 99) * 1000
        if counts is not None:
            top = sum(v for (lua, _), v in counts.items() if not lua)
            inner = sum(v for (lua, _), v in counts.items() if lua)
            row["census"] = {
                "top_level_per_call": top / n,
                "in_lua_per_call": inner / n,
                "top_level": {c: round(v / n, 3) for (lua, c), v in counts.most_common() if not lua},
                "in_lua": {c: round(v / n, 3) for (lua, c), v in counts.most_common() if lua},
            }
        return row

    # ---------------------------------------------------------------- worker fleets

    @contextlib.contextmanager
    def rlmq_workers(self, workers: int, concurrency: int, base_url: str | None = None) -> Iterator[list[int]]:
        from rlmq.cli.local import LocalFleet

        fleet = LocalFleet(
            redis_url=self.redis_url,
            model=MODEL,
            base_url=base_url or self.base_url,
            workers=workers,
            worker_concurrency=concurrency,
            log_dir=LOG_DIR,
        )
        fleet.start()
        try:
            yield [p.pid for p in fleet.group.procs]
        finally:
            fleet.group.stop(timeout=15)

    @contextlib.contextmanager
    def rq_workers(self, workers: int) -> Iterator[list[int]]:
        import redis

        from rlmq.cli.local import ProcessGroup, child_env
        from rlmq.common import keys as K

        rq_bin = os.path.join(os.path.dirname(sys.executable), "rq")
        if not os.path.exists(rq_bin):
            rq_bin = shutil.which("rq") or "rq"
        queue = K.queue_name_for_model(RQ_MODEL)
        group = ProcessGroup(LOG_DIR)
        env = child_env({"RLMQ_BASE_URL": self.base_url, "RLMQ_MODEL_RETRIES": "0", "PYTHONPATH": os.getcwd()})
        for i in range(workers):
            group.spawn(
                [
                    rq_bin,
                    "worker",
                    "--url",
                    self.redis_url,
                    "--serializer",
                    "rq.serializers.JSONSerializer",
                    "--worker-class",
                    "rq.worker.SimpleWorker",
                    "--logging_level",
                    "WARNING",
                    "--name",
                    f"stock-{i}-{os.getpid()}",
                    queue,
                ],  # fmt: skip
                f"rq-{i}",
                env=env,
            )
        client = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + 30
        while client.scard(K.rq_workers_of_queue(queue)) < workers and time.monotonic() < deadline:
            time.sleep(0.05)  # polling other processes' registration, bounded
        client.close()
        try:
            yield [p.pid for p in group.procs]
        finally:
            group.stop(timeout=15)

    # ---------------------------------------------------------------- scenarios

    def scenario_sizes(self) -> dict[str, int]:
        if self.quick:
            return {"n": 1000, "n_openai": 400, "n_rq": 100, "light": 60, "census": 256}
        return {"n": 20000, "n_openai": 4000, "n_rq": 600, "light": 1000, "census": 1024}

    def run(self) -> None:
        a = self.args
        only = set(a.only.split(",")) if a.only else None

        def want(name: str) -> bool:
            return only is None or name in only

        sz = self.scenario_sizes()
        rollouts, batch = a.rollouts, a.batch
        if want("openai5"):
            self._say("openai5: in-process AsyncOpenAI, per-batch semaphore 5")
            self.rows["openai5"] = self.run_client("openai", n=sz["n_openai"], rollouts=rollouts, batch=batch, sem=5)
        if want("openai"):
            self._say("openai: in-process AsyncOpenAI, unbounded")
            self.rows["openai"] = self.run_client("openai", n=sz["n_openai"], rollouts=rollouts, batch=batch)
        if want("rq"):
            self._say(f"rq: stock RQ SimpleWorker x{a.rq_workers}, one async job per call")
            with self.rq_workers(a.rq_workers) as pids:
                self.rows["rq"] = self.run_client(
                    "rlmq", n=sz["n_rq"], rollouts=rollouts, batch=batch, worker_pids=pids, model=RQ_MODEL,
                    warmup=8, census=True,
                )  # fmt: skip
        need_fleet = any(want(x) for x in ("rlmq", "rlmq-budget", "light", "sweep"))
        if need_fleet:
            with self.rlmq_workers(a.workers, a.worker_concurrency) as pids:
                for name, budgeted in (("rlmq", False), ("rlmq-budget", True)):
                    if not want(name):
                        continue
                    self._say(f"{name}: producer -> Redis -> {a.workers} rlmq worker(s) -> model")
                    self.rows[name] = self.run_client(
                        "rlmq", n=sz["n"], rollouts=rollouts, batch=batch, worker_pids=pids, budgeted=budgeted
                    )
                    self.census[name] = self.run_client(
                        "rlmq", n=sz["census"], rollouts=rollouts, batch=batch, worker_pids=pids,
                        budgeted=budgeted, census=True,
                    )["census"]  # fmt: skip
                if want("light"):
                    self._say("light: one prompt at a time, direct / rlmq / rlmq budgeted interleaved")
                    row = self.run_client("light", n=sz["light"], rollouts=1, batch=1, worker_pids=pids, warmup=30)
                    self.light = row.pop("paths")
                if want("sweep"):
                    levels = [(1, 16), (4, 64)] if self.quick else [(1, 8), (1, 64), (4, 64), (8, 64), (16, 64)]
                    for r, b in levels:
                        c = r * b
                        self._say(f"sweep: concurrency {c}")
                        n_o = min(sz["n_openai"], max(200, c * 4))
                        n_r = min(sz["n"], max(500, c * 20))
                        self.sweep.setdefault("openai", []).append(
                            self.run_client("openai", n=n_o, rollouts=r, batch=b)
                        )
                        self.sweep.setdefault("rlmq", []).append(
                            self.run_client("rlmq", n=n_r, rollouts=r, batch=b, worker_pids=pids)
                        )
        if want("slow"):
            self.run_slow()

    def run_slow(self) -> None:
        from rlmq.cli.local import ProcessGroup, start_mock_llm

        latency, n, conc = (0.5, 1000, 200) if self.quick else (2.0, 10_000, 1000)
        self._say(f"slow: one worker, model latency {latency:g} s, {n} sub-calls at concurrency {conc}")
        group = ProcessGroup()
        try:
            base = start_mock_llm(group, latency=latency)
            mpid = group.procs[-1].pid
            with self.rlmq_workers(1, conc, base_url=base) as pids:
                batch = 100
                row = self.run_client(
                    "rlmq", n=n, rollouts=conc // batch, batch=batch, worker_pids=pids, base_url=base,
                    warmup=0, timeout=600, model_pid=mpid,
                )  # fmt: skip
        finally:
            group.stop(timeout=10)
        ideal = n / conc * latency
        row.update({"model_latency_s": latency, "ideal_s": ideal, "wall_over_ideal": row["wall_s"] / ideal})
        self.slow = row

    @staticmethod
    def _say(text: str) -> None:
        print(f"[bench] {text}", file=sys.stderr, flush=True)

    # ---------------------------------------------------------------- report

    def summary(self) -> dict[str, Any]:
        rows = self.rows
        ratios: dict[str, float] = {}
        for name in ("rlmq", "rlmq-budget"):
            if name not in rows:
                continue
            for ref in ("openai5", "openai", "rq"):
                if ref in rows:
                    ratios[f"{name}/{ref} calls_per_s"] = rows[name]["calls_per_s"] / rows[ref]["calls_per_s"]
        light: dict[str, Any] = {}
        if "direct" in self.light:
            d = self.light["direct"]
            for name in ("rlmq", "rlmq-budget"):
                if name in self.light:
                    x = self.light[name]
                    light[name] = {
                        "p50_ms": x["p50_ms"],
                        "p99_ms": x["p99_ms"],
                        "added_p50_ms": x["p50_ms"] - d["p50_ms"],
                        "added_p99_ms": x["p99_ms"] - d["p99_ms"],
                        "paired_added_p50_ms": x.get("paired_added_p50_ms", float("nan")),
                        "paired_added_p99_ms": x.get("paired_added_p99_ms", float("nan")),
                        # the added p50 in direct calls: hops cost what the direct call's own
                        # wake-ups and round trips cost, so this ratio is what stays put when
                        # the shared box speeds up or slows down
                        "added_p50_per_direct_p50": (x["p50_ms"] - d["p50_ms"]) / d["p50_ms"],
                    }
            light["direct"] = {"p50_ms": d["p50_ms"], "p99_ms": d["p99_ms"]}
        budget: dict[str, Any] = {}
        if "rlmq" in self.census and "rlmq-budget" in self.census:
            u, b = self.census["rlmq"], self.census["rlmq-budget"]
            budget["round_trips_per_call"] = b["top_level_per_call"] - u["top_level_per_call"]
            budget["commands_per_call"] = (b["top_level_per_call"] + b["in_lua_per_call"]) - (
                u["top_level_per_call"] + u["in_lua_per_call"]
            )
        if "rlmq" in rows and "rlmq-budget" in rows:
            u, b = rows["rlmq"], rows["rlmq-budget"]
            budget["worker_cpu_ms_per_call"] = b["worker_cpu_ms_per_call"] - u["worker_cpu_ms_per_call"]
            budget["redis_cpu_ms_per_call"] = b["redis_cpu_ms_per_call"] - u["redis_cpu_ms_per_call"]
            budget["throughput_ratio"] = b["calls_per_s"] / u["calls_per_s"]
        if "rlmq" in light and "rlmq-budget" in light:
            budget["light_added_p50_ms"] = light["rlmq-budget"]["p50_ms"] - light["rlmq"]["p50_ms"]
            budget["light_added_p99_ms"] = light["rlmq-budget"]["p99_ms"] - light["rlmq"]["p99_ms"]
        return {"ratios": ratios, "light": light, "budget": budget}

    def report(self, argv: list[str]) -> dict[str, Any]:
        summ = self.summary()
        doc = {
            "command": "python -m bench.queue_path " + " ".join(argv),
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "platform": platform.platform(),
            },
            "settings": {
                "quick": self.quick,
                "workers": self.args.workers,
                "worker_concurrency": self.args.worker_concurrency,
                "rq_workers": self.args.rq_workers,
                "rollouts": self.args.rollouts,
                "batch": self.args.batch,
            },
            "rows": self.rows,
            "census": self.census,
            "light_rows": self.light,
            "slow": self.slow,
            "sweep": self.sweep,
            **summ,
        }
        print_table(doc)
        stem = self.args.out or os.path.join(RESULTS_DIR, results_name(self.quick, self.args.only))
        os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
        path = f"{stem}.json"
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=2, sort_keys=False)
        print(f"\nsaved {path}")
        png = plot(doc, f"{stem}.png")
        if png:
            print(f"saved {png}")
        return doc


def print_table(doc: dict[str, Any]) -> None:
    labels = {
        "openai5": "(a) AsyncOpenAI, sem 5/batch",
        "openai": "(a) AsyncOpenAI, unbounded",
        "rq": "(b) stock RQ SimpleWorker",
        "rlmq": "(c) rlmq, unbudgeted",
        "rlmq-budget": "(c) rlmq, budgeted",
    }
    head = (
        f"{'scenario':32} {'conc':>5} {'calls/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'cli cpu':>8} {'wrk cpu':>8} "
        f"{'redis cmd':>9} {'cli RSS':>8} {'wrk RSS':>8} {'err':>4}"
    )
    print("\nThroughput (CPU in ms per sub-call, RSS peak MB; redis cmd = INFO commandstats, Lua inside included)")
    print(head)
    print("-" * len(head))
    for key, row in doc["rows"].items():
        print(
            f"{labels.get(key, key):32} {row['concurrency']:>5} {row['calls_per_s']:>8.0f} {row['p50_ms']:>8.1f} "
            f"{row['p99_ms']:>8.1f} {row['client_cpu_ms_per_call']:>8.3f} {row['worker_cpu_ms_per_call']:>8.3f} "
            f"{row['redis_commands_per_call']:>9.1f} {row['client_peak_rss_mb']:>8.0f} "
            f"{row['worker_peak_rss_mb']:>8.0f} {row['errors']:>4}"
        )
    if doc["ratios"]:
        print("\nRatios (same run): " + ", ".join(f"{k} = {v:.2f}x" for k, v in doc["ratios"].items()))
    census = dict(doc["census"])
    if "rq" in doc["rows"] and "census" in doc["rows"]["rq"]:
        census["rq"] = doc["rows"]["rq"]["census"]
    if census:
        print("\nRedis commands per sub-call (MONITOR census): top-level round trips + commands run inside Lua")
        for key, c in census.items():
            print(
                f"  {labels.get(key, key):30} top-level {c['top_level_per_call']:5.2f}"
                f"  in Lua {c['in_lua_per_call']:5.2f}  total {c['top_level_per_call'] + c['in_lua_per_call']:5.2f}"
            )
    if doc["light"]:
        print("\nLight load (one prompt at a time), ms")
        for key, x in doc["light"].items():
            extra = (
                f"  added p50 {x['added_p50_ms']:.2f}  added p99 {x['added_p99_ms']:.2f}"
                f"  (per round: p50 {x['paired_added_p50_ms']:.2f}  p99 {x['paired_added_p99_ms']:.2f};"
                f"  added p50 = {x['added_p50_per_direct_p50']:.2f}x the direct p50)"
                if "added_p50_ms" in x
                else ""
            )
            print(f"  {key:12} p50 {x['p50_ms']:.2f}  p99 {x['p99_ms']:.2f}{extra}")
    if doc["budget"]:
        print("\nBudget enforcement cost (budgeted - unbudgeted rlmq): " + ", ".join(
            f"{k} = {v:.3f}" for k, v in doc["budget"].items()
        ))  # fmt: skip
    s = doc.get("slow")
    if s:
        print(
            f"\nSlow model: {s['n']} sub-calls at concurrency {s['concurrency']},"
            f" model {s['model_latency_s']:g} s/call,"
            f" one worker: wall {s['wall_s']:.2f} s vs ideal {s['ideal_s']:.2f} s ({s['wall_over_ideal']:.3f}x),"
            f" worker peak RSS {s['worker_peak_rss_mb']:.0f} MB, worker CPU {s['worker_cpu_ms_per_call']:.3f} ms/call,"
            f" errors {s['errors']}"
        )


def results_name(quick: bool, only: str | None) -> str:
    """File stem under ``bench/results``: ``queue_path`` for the full run, ``queue_path_quick``
    for ``--quick``; a subset (``--only``) gets its own, so it never overwrites a full run."""
    name = "queue_path_quick" if quick else "queue_path"
    if only:
        name += "_only_" + "_".join(sorted(x.strip().replace("-", "_") for x in only.split(",") if x.strip()))
    return name


def plot(doc: dict[str, Any], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sweep = doc.get("sweep") or {}
    if not sweep:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, pts in sweep.items():
        xs = [p["concurrency"] for p in pts]
        (line,) = ax1.plot(xs, [p["calls_per_s"] for p in pts], marker="o", label=name)
        color = line.get_color()
        ax2.plot(xs, [p["p50_ms"] for p in pts], marker="o", color=color, label=f"{name} p50")
        ax2.plot(xs, [p["p99_ms"] for p in pts], marker="x", color=color, linestyle="--", label=f"{name} p99")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sub-calls in flight")
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax1.set_ylabel("sub-calls / s")
    ax2.set_ylabel("latency per sub-call (ms, from llm_batch start)")
    ax2.set_yscale("log")
    fig.suptitle("rlmq queue path vs in-process AsyncOpenAI (zero-latency scripted model, 127.0.0.1)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m bench.queue_path", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small smoke run (< 60 s)")
    p.add_argument("--only", help="comma-separated scenarios: openai5,openai,rq,rlmq,rlmq-budget,light,slow,sweep")
    p.add_argument("--workers", type=int, default=2, help="rlmq worker processes (default 2)")
    p.add_argument("--worker-concurrency", type=int, default=256)
    p.add_argument("--rq-workers", type=int, default=2, help="stock RQ SimpleWorker processes (default 2)")
    p.add_argument("--rollouts", type=int, default=4, help="concurrent rollouts (default 4)")
    p.add_argument("--batch", type=int, default=64, help="prompts per llm_batch (default 64)")
    p.add_argument(
        "--out",
        help="path stem of the results (STEM.json, STEM.png); default bench/results/queue_path"
        "[_quick][_only_<scenarios>]",
    )
    # client-role flags (internal)
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sem", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--base-url", help=argparse.SUPPRESS)
    p.add_argument("--redis-url", help=argparse.SUPPRESS)
    p.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)
    p.add_argument("--queue", help=argparse.SUPPRESS)
    p.add_argument("--tag", default="t", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=120.0, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--budgeted", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.role:
        _client_main(a)
        return 0
    bench = Bench(a)
    t0 = time.monotonic()
    bench.start()
    try:
        bench.run()
    finally:
        bench.stop()
    bench.report(argv)
    print(f"(benchmark took {time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
