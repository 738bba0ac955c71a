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

Modules: this one orchestrates (servers, fleets, scenarios); :mod:`bench.queue_path_clients`
holds the measured client roles, :mod:`bench.queue_path_report` the summary, tables and
plot, and :mod:`bench.harness` what every benchmark shares (probes, fleets, percentiles).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import Any

from bench.harness import (
    LOG_DIR,
    RESULTS_DIR,
    Probe,
    machine,
    monitor,
    pct,
    proc_hwm_mb,
    rlmq_workers,
    rq_workers,
    save_json,
    say,
)
from bench.queue_path_clients import MODEL, RQ_MODEL, client_main
from bench.queue_path_report import plot, print_table, results_name, summarize

__all__ = ["Bench", "main", "results_name"]


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
        result_dir = tempfile.mkdtemp(prefix="rlmq-bench-client-")
        result_file = os.path.join(result_dir, "result.json")
        argv += ["--result-file", result_file]
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
                out = client_result(proc.stdout, result_file)
                s1 = self.probe.snap(pids, mpid)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            shutil.rmtree(result_dir, ignore_errors=True)
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
            "worker_peak_rss_mb": max((proc_hwm_mb(p) for p in pids), default=0.0),
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

    def rlmq_workers(
        self, workers: int, concurrency: int, base_url: str | None = None
    ) -> contextlib.AbstractContextManager[list[int]]:
        return rlmq_workers(
            self.redis_url, base_url or self.base_url, model=MODEL, workers=workers, concurrency=concurrency
        )

    def rq_workers(self, workers: int) -> contextlib.AbstractContextManager[list[int]]:
        return rq_workers(self.redis_url, self.base_url, model=RQ_MODEL, workers=workers)

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
        say(text)

    # ---------------------------------------------------------------- report

    def report(self, argv: list[str]) -> dict[str, Any]:
        summ = summarize(self.rows, self.census, self.light)
        doc = {
            "command": "python -m bench.queue_path " + " ".join(argv),
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine(),
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
        path = save_json(doc, stem)
        print(f"\nsaved {path}")
        png = plot(doc, f"{stem}.png")
        if png:
            print(f"saved {png}")
        return doc


def client_result(lines: Iterable[str], result_file: str) -> dict[str, Any] | None:
    """The figures of a measured client: read whole from ``result_file`` once the client's
    ``RESULT`` line comes on ``lines`` (its stdout), whatever their size; ``None`` when its stdout
    ends first. (The figures once came on that line itself, and a pipe cut a 131 KB line.)

    Raises:
        ValueError: the file is not one JSON object.
    """
    for line in lines:
        if line.rstrip("\n") == "RESULT":
            with open(result_file, encoding="utf-8") as fh:
                out = json.load(fh)
            if not isinstance(out, dict):
                raise ValueError(f"{result_file}: not a JSON object")
            return out
    return None


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
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--budgeted", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.role:
        client_main(a)
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
