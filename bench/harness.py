"""The shared harness of rlmq's benchmarks: prompts, percentiles, probes, worker fleets, results.

Used by ``bench.queue_path`` and available to ``bench.soak`` and ``bench.lane``:

* :func:`prompt`: a small sub-LLM prompt the scripted model answers from its own text;
* :func:`pct`: a percentile of a list of numbers;
* :class:`Probe`: snapshots of Redis ``INFO`` counters and process CPU, and their deltas;
  :func:`monitor`: a ``MONITOR`` census of commands (top level vs inside Lua);
  :func:`proc_hwm_mb` / :func:`proc_cpu`: a live process's peak RSS (MB) and CPU (seconds);
* :func:`rlmq_workers` / :func:`rq_workers`: fleets of ``rlmq worker`` or stock RQ worker processes;
* :func:`save_json`: write a results document under ``bench/results`` (or anywhere);
* :func:`say`: a progress line on stderr.

Nothing here asserts a timing: benchmarks print and save figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LOG_DIR = os.path.join(tempfile.gettempdir(), "rlmq-bench-logs")  # worker / stock-RQ logs


def prompt(i: int) -> str:
    """A small sub-LLM prompt the scripted model answers from its text (about 200 bytes)."""
    name = f"ORCHID{i % 997}"
    return (
        f"Question: What is the code of vault {name}?\n"
        f"Text: The vault {name} sits in the north wing. Guards change at noon. "
        f"The code of vault {name} is {10000 + i}. Nobody else knows it."
    )


def pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100, nearest rank) of ``values``; NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def say(text: str) -> None:
    """A progress line on stderr (``[bench] ...``)."""
    print(f"[bench] {text}", file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    """CPUs, Python version and platform of this machine, for a results document."""
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def save_json(doc: dict[str, Any], stem: str) -> str:
    """Write ``doc`` to ``STEM.json`` (folders created); returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    path = f"{stem}.json"
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=2, sort_keys=False)
    return path


def proc_hwm_mb(pid: int) -> float:
    """Peak RSS (VmHWM) of a live process, MB."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def proc_cpu(pid: int) -> float:
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
            "workers_cpu": sum(proc_cpu(p) for p in worker_pids),
            "model_cpu": proc_cpu(model_pid) if model_pid else 0.0,
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


@contextlib.contextmanager
def rlmq_workers(
    redis_url: str, base_url: str, *, model: str, workers: int, concurrency: int, log_dir: str = LOG_DIR
) -> Iterator[list[int]]:
    """``workers`` ``rlmq worker`` processes serving ``model`` (``concurrency`` sub-calls each); yields their pids.

    Raises:
        RlmqError: a worker did not come up.
    """
    from rlmq.cli.local import LocalFleet

    fleet = LocalFleet(
        redis_url=redis_url,
        model=model,
        base_url=base_url,
        workers=workers,
        worker_concurrency=concurrency,
        log_dir=log_dir,
    )
    fleet.start()
    try:
        yield [p.pid for p in fleet.group.procs]
    finally:
        fleet.group.stop(timeout=15)


@contextlib.contextmanager
def rq_workers(
    redis_url: str, base_url: str, *, model: str, workers: int, log_dir: str = LOG_DIR
) -> Iterator[list[int]]:
    """``workers`` stock RQ ``SimpleWorker`` processes on ``model``'s queue, running
    ``rlmq.workers.job.run_sub_llm`` one job at a time against ``base_url``; yields their pids."""
    import redis

    from rlmq.cli.local import ProcessGroup, child_env
    from rlmq.common import keys as K

    rq_bin = os.path.join(os.path.dirname(sys.executable), "rq")
    if not os.path.exists(rq_bin):
        rq_bin = shutil.which("rq") or "rq"
    queue = K.queue_name_for_model(model)
    group = ProcessGroup(log_dir)
    env = child_env({"RLMQ_BASE_URL": base_url, "RLMQ_MODEL_RETRIES": "0", "PYTHONPATH": os.getcwd()})
    for i in range(workers):
        group.spawn(
            [
                rq_bin,
                "worker",
                "--url",
                redis_url,
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
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 30
    while client.scard(K.rq_workers_of_queue(queue)) < workers and time.monotonic() < deadline:
        time.sleep(0.05)  # polling other processes' registration, bounded
    client.close()
    try:
        yield [p.pid for p in group.procs]
    finally:
        group.stop(timeout=15)
