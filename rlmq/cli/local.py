"""A whole rlmq deployment on one machine: embedded Redis, worker processes, the scripted model.

Used by ``rlmq demo``, by ``rlmq run`` when no ``REDIS_URL`` is given, by the end-to-end
tests and by the benchmarks. Everything it starts runs in its own process group, is tied to
this process (``PR_SET_PDEATHSIG``: it gets SIGTERM if this process dies, even by SIGKILL) and
is stopped on exit: SIGTERM, then SIGKILL after :data:`STOP_SECONDS`. Under an ``rlmq``
command's :class:`~common.aio.SignalLatch`, a second stop signal kills them at once.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from rlmq.common.aio import current_latch
from rlmq.common.children import die_with_parent
from rlmq.common.errors import RlmqError
from rlmq.common.redis_server import EmbeddedRedis
from rlmq.common.settings import setting_default

STOP_SECONDS = 5.0
"""How long children get between SIGTERM and SIGKILL when a :class:`ProcessGroup` stops
(a :class:`LocalFleet` adds its workers' grace)."""

WORKER_GRACE_SECONDS = 30.0
"""``rlmq worker --grace`` of a :class:`LocalFleet`'s workers unless it is told otherwise
(``rlmq run`` / ``rlmq demo`` give theirs :data:`COMMAND_WORKER_GRACE_SECONDS`)."""

COMMAND_WORKER_GRACE_SECONDS = 1.0
"""``--grace`` of the workers ``rlmq run`` / ``rlmq demo`` start: when that fleet stops, the
rollouts that wait for the in-flight sub-calls are gone, so these are handed back at once."""

LOCAL_REPL_SLOTS = 4
"""Child rollouts per depth each local worker hosts when the run's trees are deeper than 1 and no
``repl_slots`` is given (see :func:`local_repl_slots`)."""

_PORT_LINE = re.compile(r"http://[\d.]+:(\d+)/v1")


def local_repl_slots(max_depth: int, repl_slots: int = setting_default("repl_slots")) -> int:
    """``--repl-slots`` of the workers a local fleet starts: ``repl_slots`` when given (> 0), else
    :data:`LOCAL_REPL_SLOTS` when the rollouts recurse (``max_depth`` > 1: their children run on
    the workers), else 0 (plain sub-LLM workers)."""
    if repl_slots > 0:
        return repl_slots
    return LOCAL_REPL_SLOTS if max_depth > 1 else 0


def rlmq_command(*args: str) -> list[str]:
    """The argv that runs ``rlmq <args>`` with this interpreter."""
    return [sys.executable, "-m", "rlmq", *args]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for rlmq child processes: this one's, minus settings that would leak in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLMQ_") and k != "REDIS_URL"}
    env.update(extra or {})
    return env


class ProcessGroup:
    """Child processes started in their own sessions, tied to this process, stopped together.

    Their stdout/stderr go to ``log_dir`` files when given, else are discarded. While an
    ``rlmq`` command's signal latch is installed, the group registers :meth:`kill_now` with
    it, so a second Ctrl-C (or the latch's watchdog) kills them at once.
    """

    def __init__(self, log_dir: str | None = None) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.log_dir = log_dir
        self._unhook: Callable[[], None] | None = None

    def spawn(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        out: Any = subprocess.DEVNULL
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{name}.log"), "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env or child_env(),
            start_new_session=True,
            preexec_fn=die_with_parent(),  # noqa: PLW1509 - prctl only, then exec
        )
        return self.track(proc)

    def track(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        """Add ``proc`` (started in a session of its own) to the group; returns it."""
        self.procs.append(proc)
        latch = current_latch()
        if self._unhook is None and latch is not None:
            self._unhook = latch.on_hurry(self.kill_now)
        return proc

    def kill_now(self) -> None:
        """SIGKILL every child's process group; does not wait (safe in a signal handler)."""
        for p in self.procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """SIGTERM every child's group, wait up to ``timeout`` seconds, then SIGKILL."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()
        if self._unhook is not None:
            self._unhook()
            self._unhook = None


def start_mock_llm(
    group: ProcessGroup,
    *,
    latency: float = 0.0,
    spend_all: bool = False,
    timeout: float = 20.0,
    token_shape: str = "vllm",
    extra: Sequence[str] = (),
) -> str:
    """Start ``rlmq mock-llm --port 0 [extra...]`` and return its base URL (``http://127.0.0.1:P/v1``);
    ``token_shape``: the server whose token fields it answers in (``--token-shape``).

    Raises:
        RlmqError: the server did not report its port within ``timeout`` seconds.
    """
    argv = rlmq_command("mock-llm", "--port", "0", "--latency", str(latency), "--token-shape", token_shape, *extra)
    if spend_all:
        argv.append("--spend-all")
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=child_env(),
        start_new_session=True,
        preexec_fn=die_with_parent(),  # noqa: PLW1509 - prctl only, then exec
    )
    group.track(proc)
    assert proc.stdout is not None
    found: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            m = _PORT_LINE.search(raw.decode(errors="replace"))
            if m and not found:
                found.append(m.group(1))
        # keep draining so the child never blocks on a full pipe

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while not found:
        if proc.poll() is not None:
            raise RlmqError(f"scripted model exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RlmqError("scripted model did not report its port in time")
        reader.join(0.02)
    return f"http://127.0.0.1:{found[0]}/v1"


class LocalFleet:
    """Embedded Redis (unless ``redis_url`` is given), ``workers`` worker processes, and
    optionally the scripted model.

    Args:
        redis_url: use this Redis instead of starting one.
        model: the sub-model the workers serve (their queue is derived from it).
        base_url: the model server the workers call; ``None`` starts the scripted model.
        workers: number of ``rlmq worker`` processes.
        worker_concurrency: in-flight sub-calls per worker.
        worker_args: extra ``rlmq worker`` flags.
        repl_slots: child rollouts each worker hosts per depth (``--repl-slots``; 0: none).
        allow_uncontained_repl: pass ``--allow-uncontained-repl`` to REPL-hosting workers.
        mock_token_shape: the server whose token fields the scripted model answers in (``vllm``, ``sglang``).
        worker_grace: ``rlmq worker --grace`` (seconds in-flight sub-calls get when the fleet stops).
        worker_env: extra environment of the workers (``RLMQ_API_KEY``: secrets go here, not in argv).
        log_dir: where child logs go (``None``: discarded).
        say: called with a line of text when the fleet stops because of a signal.
    """

    def __init__(
        self,
        *,
        redis_url: str | None = None,
        model: str = "scripted",
        base_url: str | None = None,
        workers: int = 2,
        worker_concurrency: int = setting_default("worker_concurrency"),
        worker_args: list[str] | None = None,
        repl_slots: int = setting_default("repl_slots"),
        allow_uncontained_repl: bool = setting_default("allow_uncontained_repl"),
        mock_latency: float = 0.0,
        mock_spend_all: bool = False,
        mock_token_shape: str = "vllm",
        worker_grace: float = WORKER_GRACE_SECONDS,
        worker_env: dict[str, str] | None = None,
        log_dir: str | None = None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.redis_url = redis_url
        self.model = model
        self.base_url = base_url
        self.n_workers = workers
        self.worker_concurrency = worker_concurrency
        self.worker_args = list(worker_args or [])
        if repl_slots > 0:
            self.worker_args += ["--repl-slots", str(repl_slots)]
            if allow_uncontained_repl:
                self.worker_args.append("--allow-uncontained-repl")
        self.mock_latency = mock_latency
        self.mock_spend_all = mock_spend_all
        self.mock_token_shape = mock_token_shape
        self.worker_grace = worker_grace
        self.worker_env = dict(worker_env or {})
        self.say = say
        self.group = ProcessGroup(log_dir)
        self._redis: EmbeddedRedis | None = None

    @property
    def stop_seconds(self) -> float:
        """At most how long :meth:`stop` waits before it kills: the workers' grace + :data:`STOP_SECONDS`."""
        return self.worker_grace + STOP_SECONDS

    def start(self) -> LocalFleet:
        try:
            if self.redis_url is None:
                self._redis = EmbeddedRedis().start()
                self.redis_url = self._redis.url
            if self.base_url is None:
                self.base_url = start_mock_llm(
                    self.group,
                    latency=self.mock_latency,
                    spend_all=self.mock_spend_all,
                    token_shape=self.mock_token_shape,
                )
            for i in range(self.n_workers):
                self.start_worker(f"worker-{i}")
            self.wait_for_workers(self.n_workers)
        except BaseException:
            self.stop()
            raise
        return self

    def start_worker(self, name: str, extra: list[str] | None = None) -> subprocess.Popen[bytes]:
        """Start one more ``rlmq worker`` process against this fleet's Redis and model."""
        argv = rlmq_command(
            "worker", "--base-url", str(self.base_url), "--model", self.model,
            "--concurrency", str(self.worker_concurrency), "--grace", f"{self.worker_grace:g}",
            *self.worker_args, *(extra or []),
        )  # fmt: skip
        # The Redis URL (it may hold a password) goes by environment, not argv, which `ps` shows.
        env = child_env({**self.worker_env, "RLMQ_REDIS_URL": str(self.redis_url)})
        return self.group.spawn(argv, name, env=env)

    def wait_for_workers(self, n: int, timeout: float = 30.0) -> None:
        """Block until ``n`` workers are registered on this fleet's queue.

        Raises:
            RlmqError: they did not register within ``timeout`` seconds (a worker died).
        """
        from rlmq.common import keys as K
        from rlmq.common.connection import sync_client

        queue = K.queue_name_for_model(self.model)
        client = sync_client(str(self.redis_url))  # a Sentinel URL too
        deadline = time.monotonic() + timeout
        try:
            while client.scard(K.rq_workers_of_queue(queue)) < n:
                dead = [p for p in self.group.procs if p.poll() is not None]
                if dead:
                    raise RlmqError(f"a worker process exited with {dead[0].returncode} while starting")
                if time.monotonic() > deadline:
                    raise RlmqError(f"{n} workers did not register on {queue} within {timeout:g} s")
                time.sleep(0.02)  # polling a condition in another process, bounded by the deadline
        finally:
            client.close()

    def stop(self) -> None:
        """Stop the workers and the scripted model (SIGTERM, then SIGKILL after the workers'
        grace plus :data:`STOP_SECONDS`), then the embedded Redis. Safe to call twice."""
        self.group.stop(timeout=self.stop_seconds)
        if self._redis is not None:
            self._redis.stop()
            self._redis = None

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.say is not None and exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            what = [f"{len(self.group.procs)} local process(es) (workers hand back in-flight sub-calls)"]
            if self._redis is not None:
                what.append(f"the embedded Redis {self.redis_url}")
            self.say(f"rlmq: stopping {' and '.join(what)}, at most {self.stop_seconds:g} s")
        self.stop()
