"""Prometheus metrics of rlmq workers and producers (``prometheus-client``).

One :class:`Metrics` object per process, built at start-up and passed down; it owns its
own ``CollectorRegistry`` (no module-level globals, so tests and several objects in one
process never collide). :meth:`Metrics.serve` starts the HTTP exporter.

Worker side: :meth:`~Metrics.observe_result` for every sub-call result it produces
(outcome, error kind, tokens by kind, budget rejections, queue wait, model latency),
:meth:`~Metrics.lane_job` for every job taken from a lane entry,
:meth:`~Metrics.inflight` whenever the number of in-flight sub-calls changes,
:meth:`~Metrics.reconnect` when Redis had to be reconnected.

Producer side: :meth:`~Metrics.observe_batch` for every ``llm_batch`` (its size and
wall time), :meth:`~Metrics.observe_rollout` for every finished rollout (by stop
reason), :meth:`~Metrics.observe_result` only for results the producer made itself (the
up-front rejections when the budget is already spent), so no sub-call is counted twice
across a fleet.

Where an ``rlm_batch`` result arrives (the parent rollout's host, a producer or a REPL-hosting
worker): :meth:`~Metrics.observe_child` for each result a child rollout answered, by the
child's depth and stop reason. A child reports to one parent only, so each is counted once
across a fleet.

Every metric is named ``rlmq_*``; times are seconds, tokens are tokens.
"""

from __future__ import annotations

import threading
from typing import Any, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from rlmq.common.errors import ConfigError
from rlmq.common.schemas import ResultRow, StopReason, SubLLMResult

# Sub-calls wait in the queue from milliseconds (idle fleet) to minutes (a burst).
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# One sub-call (all turns of its tool loop): tens of milliseconds to minutes.
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 10_000)
BATCH_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
OUTCOMES = ("ok", "rejected", "error")
TOKEN_KINDS = ("prompt", "completion", "granted", "released")
LANE_OUTCOMES = ("early", "after_start", "lost")
MAX_DEPTH_LABEL = 64
"""Child depths above this are counted under it (a tree's node chain holds at most 64 ids)."""
STOP_REASONS: tuple[str, ...] = get_args(StopReason)


class Metrics:
    """The Prometheus metrics of one rlmq process, in their own registry.

    Args:
        registry: the registry to register in (default: a fresh one).

    Attributes are the ``prometheus_client`` metric objects themselves (``subcalls``,
    ``tokens``, ...), for anything the helper methods do not cover.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.inflight_subcalls = Gauge("rlmq_inflight_subcalls", "Sub-LLM calls in flight in this process", registry=r)
        self.subcalls = Counter(
            "rlmq_subcalls", "Sub-LLM calls finished, by outcome and error kind", ["outcome", "error_kind"], registry=r
        )
        self.tokens = Counter(
            "rlmq_tokens",
            "Sub-LLM tokens by kind: prompt, completion (reported by the server), granted and released "
            "(budget reservations), overrun (completion tokens beyond the max_tokens sent, included in completion), "
            "underreported (completion ids served beyond the usage the server reported, included in completion)",
            ["kind"],
            registry=r,
        )
        self.budget_rejections = Counter(
            "rlmq_budget_rejections", "Sub-LLM calls rejected because the rollout's budget was spent", registry=r
        )
        self.budget_waits = Counter(
            "rlmq_budget_waits", "Times a budgeted sub-LLM call parked waiting for a release of its budget", registry=r
        )
        self.budget_wait_seconds = Counter(
            "rlmq_budget_wait_seconds", "Seconds budgeted sub-LLM calls spent parked waiting for budget", registry=r
        )
        self.hosted_tool_calls = Counter(
            "rlmq_hosted_tool_calls",
            "Sub-LLM calls of hosted tools run in this (the rollout's) process, by outcome (ok, error); "
            "a request sent again for a call already run is not counted",
            ["outcome"],
            registry=r,
        )
        self.truncated = Counter(
            "rlmq_truncated",
            'Sub-LLM calls whose last model turn ended with finish_reason "length" (cut by grant or cap)',
            registry=r,
        )
        self.queue_wait = Histogram(
            "rlmq_queue_wait_seconds",
            "Seconds a sub-LLM job waited in the queue before a worker took it",
            buckets=QUEUE_WAIT_BUCKETS,
            registry=r,
        )
        self.model_latency = Histogram(
            "rlmq_model_latency_seconds",
            "Seconds of one sub-LLM call on a worker (all model turns of its tool loop)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.lane_jobs = Counter(
            "rlmq_lane_jobs",
            "Jobs an idle worker took from a lane entry: early (model call started before START answered), "
            "after_start (started once START answered), lost (another worker took it first; the early call "
            "was cancelled)",
            ["outcome"],
            registry=r,
        )
        self.reconnects = Counter("rlmq_redis_reconnects", "Times Redis was unavailable and retried", registry=r)
        self.batches = Counter("rlmq_batches", "llm_batch calls dispatched by this producer", registry=r)
        self.batch_size = Histogram(
            "rlmq_batch_size", "Prompts per llm_batch call", buckets=BATCH_SIZE_BUCKETS, registry=r
        )
        self.batch_seconds = Histogram(
            "rlmq_batch_seconds", "Wall seconds of one llm_batch call", buckets=BATCH_SECONDS_BUCKETS, registry=r
        )
        self.rollouts = Counter("rlmq_rollouts", "Finished rollouts by stop reason", ["stop_reason"], registry=r)
        self.rollouts_correct = Counter("rlmq_rollouts_correct", "Finished rollouts graded correct", registry=r)
        self.child_rollouts = Counter(
            "rlmq_child_rollouts",
            "Child rollouts (rlm_batch) that reported to their parent, by depth (2 = a top rollout's child) and "
            "stop reason",
            ["depth", "stop_reason"],
            registry=r,
        )
        self.child_root_tokens = Counter(
            "rlmq_child_root_completion_tokens",
            "Root-model completion tokens of the child rollouts that reported, by depth (charged to their tree's "
            "budget)",
            ["depth"],
            registry=r,
        )
        self.provider_waits = Counter(
            "rlmq_provider_limit_waits",
            "Model requests that waited for a fleet-wide provider limit (requests, tokens, concurrency, a 429 pause)",
            ["upstream"],
            registry=r,
        )
        self.provider_wait_seconds = Counter(
            "rlmq_provider_limit_wait_seconds", "Seconds model requests waited for provider limits", ["upstream"],
            registry=r,
        )  # fmt: skip
        self.provider_429 = Counter(
            "rlmq_provider_429", "Model requests the provider answered 429 (each pauses its upstream fleet-wide)",
            ["upstream"], registry=r,
        )  # fmt: skip
        for outcome in OUTCOMES:  # export zeros, so rate() works from the first scrape
            self.subcalls.labels(outcome=outcome, error_kind="")
        for kind in TOKEN_KINDS:
            self.tokens.labels(kind=kind)
        for outcome in LANE_OUTCOMES:
            self.lane_jobs.labels(outcome=outcome)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ observations

    def observe_result(self, result: SubLLMResult) -> None:
        """Count one finished sub-call: outcome, tokens, rejections, queue wait, latency."""
        kind = (result.error_kind or "") if result.status == "error" else ""
        self.subcalls.labels(outcome=result.status, error_kind=kind).inc()
        for name, value in (
            ("prompt", result.prompt_tokens),
            ("completion", result.completion_tokens),
            ("granted", result.granted_tokens),
            ("released", result.released_tokens),
            ("overrun", result.overrun_tokens),
            ("underreported", result.underreported_tokens),
        ):
            if value > 0:
                self.tokens.labels(kind=name).inc(value)
        if result.status == "rejected":
            self.budget_rejections.inc()
        if result.budget_waits:
            self.budget_waits.inc(result.budget_waits)
            self.budget_wait_seconds.inc(result.budget_wait_seconds)
        if result.truncated:
            self.truncated.inc()
        if result.job_id:  # made by a worker (not a producer's up-front rejection)
            self.queue_wait.observe(max(0.0, result.queue_wait_seconds))
            if result.status != "rejected":
                self.model_latency.observe(max(0.0, result.seconds))

    def inflight(self, n: int) -> None:
        """Set the number of sub-calls in flight in this process now."""
        self.inflight_subcalls.set(n)

    def lane_job(self, outcome: str) -> None:
        """Count one job taken from a lane entry; ``outcome`` is one of ``LANE_OUTCOMES``."""
        self.lane_jobs.labels(outcome=outcome).inc()

    def reconnect(self) -> None:
        """Count one Redis reconnect (a command failed for a connection error and is retried)."""
        self.reconnects.inc()

    def observe_batch(self, n: int, seconds: float) -> None:
        """Count one ``llm_batch`` call of ``n`` prompts that took ``seconds`` (producer side)."""
        self.batches.inc()
        self.batch_size.observe(n)
        self.batch_seconds.observe(max(0.0, seconds))

    def observe_rollout(self, row: ResultRow | dict[str, Any]) -> None:
        """Count one finished rollout by its stop reason (a :class:`ResultRow` or its dict)."""
        data = row.model_dump() if isinstance(row, ResultRow) else row
        self.rollouts.labels(stop_reason=str(data.get("stop_reason"))).inc()
        if data.get("correct"):
            self.rollouts_correct.inc()

    def observe_child(self, result: SubLLMResult) -> None:
        """Count one ``rlm_batch`` result a child rollout answered (``result.child`` set; a result
        without it, a plain call or a slot no child answered, is not counted here): the child by
        depth and stop reason (``other`` for one rlmq does not know), its root completion tokens
        (``main_rlm_completion_tokens`` of its metrics) by depth."""
        child = result.child
        if child is None:
            return
        depth = str(min(child.depth, MAX_DEPTH_LABEL))
        stop = child.stop_reason if child.stop_reason in STOP_REASONS else "other"
        self.child_rollouts.labels(depth=depth, stop_reason=stop).inc()
        tokens = child.metrics.get("main_rlm_completion_tokens", 0)
        if tokens > 0:
            self.child_root_tokens.labels(depth=depth).inc(tokens)

    # ------------------------------------------------------------------ export

    def exposition(self) -> bytes:
        """The registry in Prometheus text format (what the exporter serves)."""
        return bytes(generate_latest(self.registry))

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the HTTP exporter (``GET /metrics``) in a daemon thread; returns the bound port.

        Args:
            port: TCP port; 0 picks a free one.
            host: address to bind (``0.0.0.0`` in a container that Prometheus scrapes).

        Raises:
            RuntimeError: already serving.
            ConfigError: the port is taken or the address cannot be bound (a mistake in the
                command, exit 2, not a bug).
        """
        if self._server is not None:
            raise RuntimeError("metrics exporter already started")
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {host}:{port} (--metrics-port): {exc.strerror or exc}") from exc
        return int(self._server.server_port)

    @property
    def port(self) -> int | None:
        """The exporter's port, or ``None`` when not serving."""
        return None if self._server is None else int(self._server.server_port)

    def close(self) -> None:
        """Stop the HTTP exporter; idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server, self._thread = None, None
