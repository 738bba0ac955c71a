"""Fault-injection fixtures: real worker processes, the scripted model and real Redis.

Every wait here is a condition polled against a deadline (Redis state, process state),
never a sleep used as synchronisation. Workers run with ``--heartbeat-ttl 2`` so a dead
worker is detected within about three seconds (see ``tests/faults/README.md``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis

from rlmq.cli.local import LocalFleet
from rlmq.common import keys as K

HEARTBEAT_TTL = 2
"""Seconds a worker may be silent before its jobs are taken back (the CLI's minimum)."""


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Poll ``pred`` until it returns a truthy value or ``timeout`` seconds pass (then fail)."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)  # polling another process's state, bounded by the deadline


async def await_until(pred: Callable[[], Awaitable[Any]], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Async :func:`wait_until` (keeps the event loop serving while it polls)."""
    deadline = time.monotonic() + timeout
    while True:
        value = await pred()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)  # polling another process's state, bounded by the deadline


def model_stats(base_url: str) -> dict[str, Any]:
    """The scripted model server's own counters (``GET /stats``)."""
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/stats", timeout=10) as resp:
        stats: dict[str, Any] = json.load(resp)
    return stats


def process_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (or is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def worker_registered(client: redis.Redis, name: str) -> bool:
    """Whether the RQ worker ``name`` is registered (its ``rq:worker:<name>`` hash exists)."""
    return bool(client.exists(K.rq_worker(name)))


def start_named_worker(fleet: LocalFleet, label: str, *flags: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start one more ``rlmq worker`` with a unique RQ name (``<label>-<pid>-<n>``) and wait
    until it has registered; returns the process and the name."""
    name = f"{label}-{os.getpid()}-{time.time_ns() % 10**6}"
    proc = fleet.start_worker(label, ["--name", name, *flags])
    client = redis.Redis.from_url(str(fleet.redis_url))
    try:
        wait_until(lambda: worker_registered(client, name), 30, f"the worker {name} to register")
    finally:
        client.close()
    return proc, name


@pytest.fixture
def fault_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    """The scripted model and no worker yet (tests start and kill their own), on a queue of its own."""
    logs = tmp_path_factory.mktemp("fault-logs")
    fleet = LocalFleet(
        redis_url=redis_url,
        model=f"faults-{uuid.uuid4().hex[:8]}",
        workers=0,
        worker_concurrency=256,
        worker_args=["--heartbeat-ttl", str(HEARTBEAT_TTL)],
        log_dir=str(logs),
    )
    fleet.start()
    try:
        yield fleet
    finally:
        fleet.stop()
        for name in sorted(os.listdir(logs)):
            path = os.path.join(logs, name)
            with open(path, errors="replace") as f:
                tail = f.read()[-3000:]
            print(f"----- {name} -----\n{tail}")
