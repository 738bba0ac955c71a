"""The concurrent sub-LLM worker: one process, hundreds of sub-calls in flight.

A stock RQ worker runs one job at a time, which wastes a process on every in-flight
LLM call. This worker runs on one asyncio loop:

* the *fetch* task takes up to ``free slots`` queued jobs per round trip (``LRANGE``
  then the ``START`` script, which removes them from the queue and marks them started
  atomically), and when the queue is empty blocks on ``BLMOVE q q LEFT LEFT`` (a
  blocking peek that takes nothing, so a worker dying while it waits loses nothing);
* each job runs :func:`workers.subllm.run_sub_llm` as its own task;
* the *flush* task records finished jobs and pushes their results to their reply lists
  in one ``FINISH`` script call per flush (whatever finished meanwhile: natural batching
  under load, immediate at light load);
* the *heartbeat* task extends the started-registry scores of all in-flight jobs and the
  worker's own key every ``heartbeat_interval`` seconds;
* the *reaper* task re-queues (or fails) jobs of workers that stopped heartbeating for
  ``job_heartbeat_ttl`` seconds, so a ``kill -9`` loses no job.

RQ's records stay truthful: ``rq info`` and rq-dashboard list the worker (registered with
RQ's own ``Worker.register_birth``), the queue depth, and each job as queued, started,
finished or failed (see :mod:`workers.records`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import socket
import time
import uuid
from collections.abc import Callable

import redis
from rq import Queue
from rq import Worker as RQWorker
from rq.serializers import JSONSerializer

from common import keys as K
from common.connection import async_client, sync_client
from common.errors import PayloadError
from common.ledger import BudgetLedger
from common.rqjobs import SUB_LLM_FUNC, decode_job_data
from common.schemas import SubLLMRequest, SubLLMResult, load_request
from common.settings import Settings
from workers.model import ChatClient
from workers.records import FinishedJob, Records, StartedJob, rq_exc_string, rq_return_value
from workers.subllm import SubLLMContext, run_sub_llm
from workers.tools import ToolRegistry

log = logging.getLogger("rlmq.worker")


def default_worker_name() -> str:
    """``<host>.<pid>.<4 hex>``: what rq-dashboard and ``rq info`` show."""
    return f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:4]}"


class SubLLMWorker:
    """One worker process serving one queue (one model) with many sub-calls in flight.

    Args:
        settings: ``redis_url``, ``base_url``, ``model``, ``api_key``, ``worker_concurrency``
            (max in-flight sub-calls), ``heartbeat_interval`` / ``job_heartbeat_ttl``
            (seconds), ``job_max_attempts``, ``result_ttl``, ``model_timeout``,
            ``model_retries``, ``allowed_sub_tools`` are used.
        client_factory: builds the model client (a seam for tests); defaults to
            :class:`workers.model.ChatClient` on ``settings.base_url``.
        name: RQ worker name; default ``host.pid.xxxx``.

    Raises:
        ConfigError: ``base_url`` / ``model`` / ``redis_url`` missing.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        client_factory: Callable[[], ChatClient] | None = None,
        name: str | None = None,
    ) -> None:
        from common.errors import ConfigError

        if not settings.redis_url:
            raise ConfigError("the worker needs --redis-url or REDIS_URL")
        if client_factory is None and not settings.base_url:
            raise ConfigError("the worker needs --base-url")
        self.settings = settings
        self.queue = settings.worker_queue()
        self.name = name or default_worker_name()
        self.concurrency = settings.worker_concurrency
        self._client_factory = client_factory or (
            lambda: ChatClient(
                str(settings.base_url),
                settings.api_key.get_secret_value(),
                timeout=settings.model_timeout,
                retries=settings.model_retries,
                max_connections=max(100, self.concurrency),
            )
        )
        self._inflight: dict[str, StartedJob] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._done: list[FinishedJob] = []
        self._done_event = asyncio.Event()
        self._slot_free = asyncio.Event()
        self._stopping = asyncio.Event()
        self._idle = asyncio.Event()
        self.processed = 0
        self.delivered = 0

    # ------------------------------------------------------------------ lifecycle

    def request_stop(self) -> None:
        """Stop taking jobs; in-flight jobs finish (or are handed back after the grace period)."""
        self._stopping.set()
        self._slot_free.set()

    async def run(self, *, burst: bool = False, grace: float = 30.0) -> None:
        """Serve the queue until :meth:`request_stop` (or SIGTERM/SIGINT), or, with ``burst``,
        until the queue is empty and nothing is in flight.

        Args:
            burst: exit when there is no more work.
            grace: seconds in-flight jobs get to finish on shutdown before they are handed
                back to the queue.
        """
        s = self.settings
        self.redis = async_client(str(s.redis_url))
        self.blocking_redis = async_client(str(s.redis_url))
        self.records = Records(
            self.redis,
            self.queue,
            self.name,
            heartbeat_ttl=s.job_heartbeat_ttl,
            result_ttl=s.result_ttl,
            reply_ttl=s.rollout_key_ttl,
            max_attempts=s.job_max_attempts,
        )
        self.blocking_records = Records(self.blocking_redis, self.queue, self.name)
        self.ctx = SubLLMContext(
            client=self._client_factory(),
            ledger=BudgetLedger(self.redis, ttl=s.rollout_key_ttl),
            tools=ToolRegistry.from_paths(s.allowed_sub_tools),
            worker_name=self.name,
        )
        rq_worker = self._register_birth()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
        log.info(
            "worker %s serving queue %s with up to %d sub-calls in flight", self.name, self.queue, self.concurrency
        )
        aux = [
            asyncio.create_task(self._flush_loop(), name="flush"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._reaper_loop(), name="reaper"),
        ]
        try:
            await self._fetch_loop(burst)
            await self._drain(grace)
        finally:
            for t in aux:
                t.cancel()
            for t in aux:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            with contextlib.suppress(Exception):
                await self._flush_once()
            await self.ctx.client.close()
            self._register_death(rq_worker)
            await self.redis.aclose()
            await self.blocking_redis.aclose()
            log.info("worker %s stopped after %d sub-calls", self.name, self.processed)

    def _register_birth(self) -> RQWorker:
        sync = sync_client(str(self.settings.redis_url))
        q = Queue(self.queue, connection=sync, serializer=JSONSerializer)
        w = RQWorker([q], name=self.name, connection=sync, serializer=JSONSerializer)
        w.register_birth()
        sync.hset(w.key, mapping={"state": "idle", "rlmq_concurrency": self.concurrency})
        sync.sadd(K.RQ_QUEUES, q.key)
        return w

    def _register_death(self, w: RQWorker) -> None:
        with contextlib.suppress(Exception):
            w.register_death()
            w.connection.close()

    async def _drain(self, grace: float) -> None:
        if self._tasks:
            log.info("worker %s: waiting up to %.0f s for %d in-flight sub-calls", self.name, grace, len(self._tasks))
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await self._flush_once()
        left = [j.member for j in self._inflight.values()]
        if left:
            requeued, failed = await self.records.reap(left, hand_back=True)
            log.warning("worker %s handed back %d jobs (%d failed: out of attempts)", self.name, requeued, failed)
            self._inflight.clear()

    # ------------------------------------------------------------------ fetch

    async def _fetch_loop(self, burst: bool) -> None:
        backoff = 0.1
        while not self._stopping.is_set():
            free = self.concurrency - len(self._inflight)
            if free <= 0:
                self._slot_free.clear()
                await self._slot_free.wait()
                continue
            try:
                ids = await self.records.peek(min(free, 500))
                if not ids:
                    if burst and not self._inflight:
                        return
                    if burst:
                        self._slot_free.clear()
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(self._slot_free.wait(), 0.05)
                        continue
                    waiter = asyncio.create_task(self.blocking_records.wait_for_jobs(1.0))
                    stop = asyncio.create_task(self._stopping.wait())
                    await asyncio.wait({waiter, stop}, return_when=asyncio.FIRST_COMPLETED)
                    stop.cancel()
                    if not waiter.done():
                        waiter.cancel()
                        with contextlib.suppress(asyncio.CancelledError, Exception):
                            await waiter
                    continue
                started = await self.records.start(ids)
                backoff = 0.1
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                log.warning("worker %s: Redis unavailable (%s); retrying in %.1f s", self.name, exc, backoff)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            for job in started:
                self._inflight[job.member] = job
                task = asyncio.create_task(self._run_job(job))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ one job

    async def _run_job(self, job: StartedJob) -> None:
        started_at = time.time()
        ok = True
        try:
            request = self._decode(job)
        except PayloadError as exc:
            result = self._payload_error(job, str(exc))
            ok = False
        else:
            result = await run_sub_llm(request, self.ctx, job_id=job.job_id, attempt=job.attempt, started_at=started_at)
            ok = result.status != "error"
        summary = {
            "status": result.status,
            "completion_tokens": result.completion_tokens,
            "turns": result.turns,
            "seconds": round(result.seconds, 3),
        }
        payload = (
            rq_return_value(summary) if ok else rq_exc_string(f"{result.error_kind}: {result.error or result.content}")
        )
        self._done.append(FinishedJob(job=job, ok=ok, result_json=result.model_dump_json(), rq_payload=payload))
        self._done_event.set()
        self.processed += 1

    def _decode(self, job: StartedJob) -> SubLLMRequest:
        try:
            func, args, kwargs = decode_job_data(job.data)
        except ValueError as exc:
            raise PayloadError(str(exc)) from exc
        if func != SUB_LLM_FUNC or len(args) != 1 or kwargs:
            raise PayloadError(f"not an rlmq sub-LLM job: {func}")
        return load_request(args[0])

    def _payload_error(self, job: StartedJob, message: str) -> SubLLMResult:
        rollout, batch, index = "unknown", "unknown", 0
        parts = job.job_id.split("-")
        if len(parts) >= 3 and parts[-1].isdigit():
            rollout, batch, index = "-".join(parts[:-2]), parts[-2], int(parts[-1])
        return SubLLMResult(
            rollout_id=rollout,
            batch_id=batch,
            index=index,
            job_id=job.job_id,
            status="error",
            error_kind="payload",
            content=f"[error] invalid sub-LLM job: {message}",
            error=message,
            worker=self.name,
            attempt=job.attempt,
        )

    # ------------------------------------------------------------------ flush

    async def _flush_loop(self) -> None:
        while True:
            await self._done_event.wait()
            try:
                await self._flush_once()
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                log.warning("worker %s: could not record results (%s); retrying", self.name, exc)
                await asyncio.sleep(0.5)  # backoff before retrying the same results, not synchronisation

    async def _flush_once(self) -> None:
        self._done_event.clear()
        if not self._done:
            return
        batch, self._done = self._done, []
        try:
            delivered = await self.records.finish(batch)
        except BaseException:
            self._done = batch + self._done
            self._done_event.set()
            raise
        self.delivered += delivered
        for d in batch:
            self._inflight.pop(d.job.member, None)
        self._slot_free.set()
        if len(self._inflight) == 0:
            self._idle.set()

    # ------------------------------------------------------------------ heartbeat & reaper

    async def _heartbeat_loop(self) -> None:
        interval = self.settings.heartbeat_interval
        while True:
            try:
                members = list(self._inflight)
                await self.records.heartbeat(members, "busy" if members else "idle")
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                log.warning("worker %s: heartbeat failed (%s)", self.name, exc)
            await asyncio.sleep(interval)  # periodic timer, not synchronisation

    async def _reaper_loop(self) -> None:
        interval = max(0.5, self.settings.job_heartbeat_ttl / 4)
        while True:
            await asyncio.sleep(interval * (0.5 + random.random()))  # jittered timer across the fleet
            try:
                expired = [m for m in await self.records.expired_members() if m not in self._inflight]
                if expired:
                    requeued, failed = await self.records.reap(expired)
                    if requeued or failed:
                        log.warning(
                            "worker %s: took back %d abandoned jobs (%d re-queued, %d failed)",
                            self.name, len(expired), requeued, failed,
                        )  # fmt: skip
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                log.warning("worker %s: reaper failed (%s)", self.name, exc)
