"""The rollout host of a worker that hosts child rollouts (``rlmq worker --repl-slots N``).

A child rollout (a task of a parent's ``rlm_batch``) runs on a worker with
:func:`rlmq.producer.engine.run_rollout`, as a top rollout runs in ``RLMEnv``. What the worker
lends it, built once per worker by :class:`ChildHost`:

* the root model client: the worker's own model server (``base_url`` / ``api_key``): the child's
  root model is the queue's model, the parent's sub-model, as in the RLM paper;
* an :class:`~rlmq.producer.interception.InterceptionServer` in the worker, where the child's
  REPL posts its ``llm_batch`` (and, once merged, ``rlm_batch``) calls;
* the ``llm_batch`` service on the worker's Redis, which enqueues the child's sub-calls back on
  the queues, and the live-rollout set (``rlmq status``), refreshed while the worker serves.

Before the worker serves, :func:`probe_containment` starts one REPL exactly as a child's is
started and reads what it is contained by: a worker holds Redis write rights and model keys, so
it refuses to host (:class:`~rlmq.common.errors.UncontainedReplError`) unless that REPL runs
under a uid of its own, without network and with a private file system, or the operator passed
``--allow-uncontained-repl``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from typing import TYPE_CHECKING, Protocol

from rlmq.common.errors import UncontainedReplError
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import RolloutOptions
from rlmq.producer.engine import RolloutHost, sandbox_repl
from rlmq.producer.host import root_model, start_host
from rlmq.producer.interception import InterceptionServer
from rlmq.producer.repl.containment import Containment
from rlmq.producer.root import RootModel

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from rlmq.common.metrics import Metrics
    from rlmq.common.settings import Settings
    from rlmq.common.token_servers import TokenFieldsLog

log = logging.getLogger("rlmq.worker")

SUMMARY_SECONDS = 60.0
"""How often a REPL host logs what its child rollouts did since its last summary (only when
something happened), besides its start and stop lines and each failed child."""


def fully_contained(c: Containment) -> bool:
    """Whether a REPL's containment is what a REPL host needs: a uid of its own, a network
    namespace of its own, a private file system."""
    return c.own_uid and c.network and c.private_fs


async def probe_containment(server: InterceptionServer, options: RolloutOptions) -> Containment:
    """Start one REPL as a child rollout's is started (same sandbox, an endpoint on ``server``
    that answers nothing), read its containment, and close it.

    Raises:
        ReplStartupError: the REPL did not come up.
    """

    async def nothing(prompts: list[str]) -> tuple[list[str], str]:
        return ["[error] containment probe" for _ in prompts], ""

    token = server.register(nothing)
    repl = sandbox_repl(DatasetRow(id="probe", question="", context=""), token, options, server, [])
    try:
        await repl.start()
        assert repl.containment is not None  # set by a successful start
        return repl.containment
    finally:
        try:
            await repl.close()
        finally:
            server.unregister(token)


class ChildHostPort(Protocol):
    """What the rollout host uses of its worker, and nothing else
    (:class:`rlmq.workers.worker.SubLLMWorker` is one), read at :meth:`ChildHost.start` and after:
    how to build the host (``settings``, ``redis``, ``metrics``, ``token_fields_log``: the
    worker's, so a server without token fields is reported once per worker) and the ``name``
    its log lines carry."""

    name: str
    settings: Settings
    redis: Redis
    metrics: Metrics
    token_fields_log: TokenFieldsLog


class ChildHost:
    """The worker-side :class:`~rlmq.producer.engine.RolloutHost` of one REPL-hosting worker.

    Args:
        worker: the worker (see :class:`ChildHostPort`; read at :meth:`start` and after).
    """

    def __init__(self, worker: ChildHostPort) -> None:
        self.w = worker
        self.server: InterceptionServer | None = None
        self.root: RootModel | None = None
        self._host: RolloutHost | None = None
        self.containment: Containment | None = None
        """What the probe REPL was contained by (after :meth:`start`)."""
        self.running = 0
        """Child rollouts running on this worker now."""
        self.ended: Counter[str] = Counter()
        """Child rollouts this worker finished, by stop reason (all of them)."""
        self._reported: Counter[str] = Counter()

    def began(self) -> None:
        """A child rollout starts here (count it as running)."""
        self.running += 1

    def finished(self, child: str, stop_reason: str, error: str | None = None) -> None:
        """A child rollout that :meth:`began` ended with ``stop_reason``; one ending in ``error``
        is logged at once, with its ``error`` text (cut to 300 characters)."""
        self.running = max(0, self.running - 1)
        self.ended[stop_reason] += 1
        if stop_reason == "error":
            log.warning("worker %s: child rollout %s ended in error: %.300s", self.w.name, child, error or "")

    def summary(self, since: Counter[str] | None = None) -> str:
        """``"12 finished (answer_ready=11, error=1), 3 running"``: the child rollouts ended since
        the counts ``since`` (all of them when ``None``) and those running now."""
        ended = self.ended - (since or Counter())
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(ended.items()))
        return f"{sum(ended.values())} finished{f' ({reasons})' if reasons else ''}, {self.running} running"

    async def summarize_forever(self, interval: float = SUMMARY_SECONDS) -> None:
        """Every ``interval`` seconds, log the children finished since the last line and those
        running, when any finished or runs; until cancelled."""
        while True:
            await asyncio.sleep(interval)  # the period of an operator's summary line
            if self.ended != self._reported or self.running:
                log.info("worker %s: child rollouts in the last %.0f s: %s", self.w.name, interval,
                         self.summary(self._reported))  # fmt: skip
                self._reported = Counter(self.ended)

    @property
    def host(self) -> RolloutHost:
        """The rollout host (after :meth:`start`).

        Raises:
            RuntimeError: not started.
        """
        if self._host is None:
            raise RuntimeError("the child-rollout host is not started")
        return self._host

    async def start(self) -> None:
        """Start the interception server, build the host, probe the REPL's containment.

        Raises:
            ConfigError: the worker has no ``base_url`` (its model is the children's root model).
            UncontainedReplError: the REPL is not fully contained and ``allow_uncontained_repl``
                is off (everything started is stopped again).
            ReplStartupError: the probe REPL did not come up.
        """
        s = self.w.settings
        self.root = root_model(
            s, needed_for="a worker hosting child rollouts (--repl-slots) needs --base-url: its root model"
        )
        try:
            started = await start_host(s, self.w.redis, self.root, metrics=self.w.metrics)
            self.server, self._host = started.server, started.host
            self._host.token_fields_log = self.w.token_fields_log  # the worker's: it says so once
            self.containment = c = await probe_containment(self.server, s.rollout_options())
            if not fully_contained(c):
                missing = "; ".join(c.not_contained) or "see the REPL's containment report"
                if not s.allow_uncontained_repl:
                    raise UncontainedReplError(
                        f"worker {self.w.name} refuses to host child rollouts (--repl-slots {s.repl_slots}): the "
                        f"REPL sandbox is not fully contained on this host (own uid: {c.own_uid}, no network: "
                        f"{c.network}, private file system: {c.private_fs}). Run the worker as root where Linux "
                        f"namespaces are allowed (see the README, 'Hosting child rollouts'), or pass "
                        f"--allow-uncontained-repl to run the models' code with this worker's privileges. "
                        f"NOT contained: {missing}"
                    )
                log.warning(
                    "worker %s hosts child rollouts with an UNCONTAINED REPL (--allow-uncontained-repl): %s",
                    self.w.name, missing,
                )  # fmt: skip
            else:
                log.info(
                    "worker %s hosts up to %d child rollouts per depth, each REPL contained (own uid, no network, "
                    "private file system)", self.w.name, s.repl_slots,
                )  # fmt: skip
        except BaseException:
            await self.close()
            raise

    async def refresh_forever(self) -> None:
        """Keep the hosted rollouts' keys and ``rlmq status`` entries alive, and log a summary of
        the hosted children every :data:`SUMMARY_SECONDS`, until cancelled."""
        summaries = asyncio.create_task(self.summarize_forever(), name="child-summary")
        try:
            await self.host.live.refresh_forever(self.w.settings.rollout_key_ttl / 3)
        finally:
            summaries.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await summaries

    async def close(self) -> None:
        """Stop the interception server and the root client (logging what the host's children
        did, when it hosted any); idempotent."""
        if self._host is not None and (self.ended or self.running):
            log.info("worker %s hosted child rollouts: %s", self.w.name, self.summary())
        self._host = None
        if self.server is not None:
            with contextlib.suppress(Exception):
                await self.server.stop()
            self.server = None
        if self.root is not None:
            with contextlib.suppress(Exception):
                await self.root.close()
            self.root = None
