"""An rlmq fleet on several hosts (network namespaces, :mod:`tests.hosts.netns`).

Hosts: ``redis`` (a ``redis-server``), ``model`` (the scripted model), trainer hosts (the jobs of
:mod:`tests.hosts.driver`: producers, ``RLMEnv`` trees) and worker hosts (``rlmq worker``; a REPL
host also hosts child rollouts with ``--repl-slots``). Each service host runs a delay proxy
(:mod:`tests.hosts.delay_proxy`) in front of its service, so every client on another host sees a
round trip of ``rtt_ms`` more than the link's; the clients use the proxy's address only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from rlmq.cli.local import ProcessGroup, child_env, rlmq_command
from rlmq.common.redis_server import find_redis_server
from tests.hosts.netns import HostNet

REDIS_PORT, MODEL_PORT, PROXY_OFFSET = 6379, 8000, 1
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class HostFleet:
    """Redis, model, trainer and worker hosts with ``rtt_ms`` between them (see the module docstring).

    Args:
        workers: worker host names -> extra ``rlmq worker`` flags (``--repl-slots 1`` for a REPL host).
        trainers: trainer host names.
        model: the sub-model the workers serve.
        rtt_ms: round trip added between hosts (milliseconds).
        worker_flags: flags of every worker.
        log_dir: where each process's log goes.
        model_latency: seconds the scripted model takes per call.
        model_args: more ``rlmq mock-llm`` flags (``--quota-rpm``, ...).
    """

    def __init__(
        self,
        *,
        workers: dict[str, list[str]],
        trainers: tuple[str, ...] = ("trainer1",),
        model: str = "hosts",
        rtt_ms: float = 1.0,
        worker_flags: tuple[str, ...] = ("--concurrency", "64", "--heartbeat-ttl", "3"),
        log_dir: str | None = None,
        model_latency: float = 0.0,
        model_args: tuple[str, ...] = (),
    ) -> None:
        self.model_latency, self.model_args = model_latency, list(model_args)
        self.workers, self.trainers, self.model, self.rtt_ms = workers, trainers, model, rtt_ms
        self.worker_flags = list(worker_flags)
        self.group = ProcessGroup(log_dir)
        self.net = HostNet()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        try:
            for host in ("redis", "model", *trainers, *workers):
                self.net.add(host)
            self.redis_url = f"redis://{self.net.hosts['redis']}:{REDIS_PORT + PROXY_OFFSET}/0"
            self.base_url = f"http://{self.net.hosts['model']}:{MODEL_PORT + PROXY_OFFSET}/v1"
            self._start_services()
            for host, flags in workers.items():
                self.start_worker(host, flags)
            self.wait_for_workers(len(workers))
        except BaseException:
            self.close()
            raise

    def spawn(
        self, host: str, argv: list[str], name: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` (logged as ``name``)."""
        proc = self.group.spawn(self.net.argv(host, argv), name, env=child_env(env))
        self.procs[name] = proc
        return proc

    def _proxy(self, host: str, port: int) -> None:
        argv = [sys.executable, "-m", "tests.hosts.delay_proxy", "--listen", f"0.0.0.0:{port + PROXY_OFFSET}",
                "--to", f"127.0.0.1:{port}", "--rtt-ms", f"{self.rtt_ms:g}"]  # fmt: skip
        self.spawn(host, argv, f"{host}-proxy")

    def _start_services(self) -> None:
        redis_argv = [find_redis_server(), "--port", str(REDIS_PORT), "--bind", "127.0.0.1", "--save", "",
                      "--appendonly", "no"]  # fmt: skip
        self.spawn("redis", redis_argv, "redis")
        self.spawn(
            "model",
            rlmq_command(
                "mock-llm",
                "--host",
                "127.0.0.1",
                "--port",
                str(MODEL_PORT),
                "--latency",
                f"{self.model_latency:g}",
                *self.model_args,
            ),
            "model",
        )
        self._proxy("redis", REDIS_PORT)
        self._proxy("model", MODEL_PORT)
        for host, port in (("redis", REDIS_PORT), ("model", MODEL_PORT)):
            for p in (port, port + PROXY_OFFSET):
                self._wait_port(host, "127.0.0.1" if p == port else self.net.hosts[host], p)

    def _wait_port(self, host: str, address: str, port: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        probe = self.net.argv(host, ["bash", "-c", f"exec 3<>/dev/tcp/{address}/{port}"])
        while subprocess.run(probe, capture_output=True, timeout=10).returncode != 0:
            if time.monotonic() > deadline:
                raise AssertionError(f"{host}: nothing listens on {address}:{port} after {timeout:g} s")
            time.sleep(0.1)  # polling another process's socket, bounded by the deadline

    def start_worker(self, host: str, flags: list[str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``rlmq worker`` on ``host``."""
        argv = rlmq_command("worker", "--base-url", self.base_url, "--model", self.model, *self.worker_flags,
                            *(flags or []))  # fmt: skip
        return self.spawn(host, argv, host, env={"RLMQ_REDIS_URL": self.redis_url})

    def driver(self, host: str, *args: str, timeout: float = 120.0) -> dict[str, Any]:
        """Run :mod:`tests.hosts.driver` on ``host``; its JSON answer.

        Raises:
            AssertionError: it failed or printed no JSON.
        """
        argv = self.net.argv(host, [sys.executable, "-m", "tests.hosts.driver", *args])
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=child_env())
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise AssertionError(f"driver {args[0]} on {host} failed ({done.returncode}): {done.stderr[-3000:]}")
        answer: dict[str, Any] = json.loads(lines[-1])
        return answer

    def start_driver(self, host: str, *args: str) -> subprocess.Popen[str]:
        """Start :mod:`tests.hosts.driver` on ``host`` in the background (read it with :func:`driver_answer`)."""
        argv = self.net.argv(host, [sys.executable, "-m", "tests.hosts.driver", *args])
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env=child_env(), start_new_session=True)  # fmt: skip

    def wait_for_workers(self, n: int) -> None:
        """Wait until ``n`` workers serve the model's queue."""
        self.driver(self.trainers[0], "wait-workers", "--redis-url", self.redis_url, "--model", self.model,
                    "--n", str(n))  # fmt: skip

    def close(self) -> None:
        """Stop every process and remove the hosts (idempotent)."""
        try:
            self.group.stop(timeout=5)
        finally:
            self.net.close()

    def __enter__(self) -> HostFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def driver_answer(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """The JSON answer of a driver started with :meth:`HostFleet.start_driver`.

    Raises:
        AssertionError: it failed, printed no JSON, or ran past ``timeout`` seconds (then it is killed).
    """
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the driver ran past {timeout:g} s (a stall): {err[-3000:]}") from None
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"the driver failed ({proc.returncode}): {err[-3000:]}")
    answer: dict[str, Any] = json.loads(lines[-1])
    return answer
