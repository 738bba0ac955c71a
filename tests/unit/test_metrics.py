"""Prometheus metrics: observed values come out of a real HTTP scrape."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlmq.common.metrics import Metrics
from rlmq.common.schemas import ChildOutcome, ResultRow, SubLLMResult


def result(status: str = "ok", **kw: object) -> SubLLMResult:
    base: dict[str, object] = dict(rollout_id="r1", batch_id="b1", index=0, job_id="r1-b1-0", content="x")
    base.update(kw)
    return SubLLMResult(status=status, **base)  # type: ignore[arg-type]


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(snap: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return snap[(name, frozenset(labels.items()))]


@pytest.fixture
def served() -> Iterator[tuple[Metrics, int]]:
    m = Metrics()
    port = m.serve(0)
    try:
        yield m, port
    finally:
        m.close()


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        return samples(resp.read().decode())


def test_worker_side_metrics_are_scraped_over_http(served: tuple[Metrics, int]) -> None:
    m, port = served
    assert port > 0 and m.port == port
    before = scrape(port)
    assert value(before, "rlmq_subcalls_total", outcome="ok", error_kind="") == 0
    assert value(before, "rlmq_inflight_subcalls") == 0

    m.inflight(7)
    m.observe_result(
        result(prompt_tokens=100, completion_tokens=20, granted_tokens=64, released_tokens=44,
               queue_wait_seconds=0.02, seconds=0.7)
    )  # fmt: skip
    m.observe_result(result(prompt_tokens=50, completion_tokens=5, queue_wait_seconds=3.0, seconds=1.5))
    m.observe_result(result("rejected", content="[rejected] budget spent", queue_wait_seconds=0.001))
    m.observe_result(result("error", error_kind="model_timeout", content="[error]", seconds=120.0))
    m.reconnect()
    m.reconnect()

    snap = scrape(port)
    assert value(snap, "rlmq_inflight_subcalls") == 7
    assert value(snap, "rlmq_subcalls_total", outcome="ok", error_kind="") == 2
    assert value(snap, "rlmq_subcalls_total", outcome="rejected", error_kind="") == 1
    assert value(snap, "rlmq_subcalls_total", outcome="error", error_kind="model_timeout") == 1
    assert value(snap, "rlmq_tokens_total", kind="prompt") == 150
    assert value(snap, "rlmq_tokens_total", kind="completion") == 25
    assert value(snap, "rlmq_tokens_total", kind="granted") == 64
    assert value(snap, "rlmq_tokens_total", kind="released") == 44
    assert value(snap, "rlmq_budget_rejections_total") == 1
    assert value(snap, "rlmq_redis_reconnects_total") == 2
    # queue wait: every worker-made result; latency: those that reached the model
    assert value(snap, "rlmq_queue_wait_seconds_count") == 4
    assert value(snap, "rlmq_queue_wait_seconds_bucket", le="0.025") == 3
    assert value(snap, "rlmq_queue_wait_seconds_sum") == pytest.approx(3.021)
    assert value(snap, "rlmq_model_latency_seconds_count") == 3
    assert value(snap, "rlmq_model_latency_seconds_bucket", le="1.0") == 1
    assert value(snap, "rlmq_model_latency_seconds_bucket", le="+Inf") == 3


async def test_producer_side_metrics_are_scraped_with_aiohttp(served: tuple[Metrics, int]) -> None:
    m, port = served
    m.observe_batch(5, 0.4)
    m.observe_batch(40, 2.0)
    m.observe_rollout(
        ResultRow(id="a", final_answer="x", answer="x", correct=True, stop_reason="answer_ready", metrics={})
    )
    m.observe_rollout({"id": "b", "stop_reason": "max_turns", "correct": False})
    # the producer's own up-front rejection (no job id): counted, but no queue wait observed
    m.observe_result(result("rejected", job_id="", content="[rejected]"))
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as resp:
        assert resp.status == 200
        snap = samples(await resp.text())
    assert value(snap, "rlmq_batches_total") == 2
    assert value(snap, "rlmq_batch_size_count") == 2
    assert value(snap, "rlmq_batch_size_sum") == 45
    assert value(snap, "rlmq_batch_size_bucket", le="8.0") == 1
    assert value(snap, "rlmq_batch_seconds_sum") == pytest.approx(2.4)
    assert value(snap, "rlmq_rollouts_total", stop_reason="answer_ready") == 1
    assert value(snap, "rlmq_rollouts_total", stop_reason="max_turns") == 1
    assert value(snap, "rlmq_rollouts_correct_total") == 1
    assert value(snap, "rlmq_budget_rejections_total") == 1
    assert value(snap, "rlmq_queue_wait_seconds_count") == 0


def test_child_rollouts_are_counted_by_depth_and_stop_reason(served: tuple[Metrics, int]) -> None:
    m, port = served

    def child(depth: int, stop: str, tokens: int) -> SubLLMResult:
        outcome = ChildOutcome(
            rollout_id="c-1", depth=depth, stop_reason=stop, metrics={"main_rlm_completion_tokens": tokens}
        )
        return result(child=outcome)

    m.observe_child(child(2, "answer_ready", 40))
    m.observe_child(child(2, "answer_ready", 60))
    m.observe_child(child(3, "max_turns", 7))
    m.observe_child(child(900, "<made up>", 0))  # labels stay bounded
    m.observe_child(result())  # a plain call (no child): not a child rollout
    snap = scrape(port)
    assert value(snap, "rlmq_child_rollouts_total", depth="2", stop_reason="answer_ready") == 2
    assert value(snap, "rlmq_child_rollouts_total", depth="3", stop_reason="max_turns") == 1
    assert value(snap, "rlmq_child_rollouts_total", depth="64", stop_reason="other") == 1
    assert sum(v for (name, _), v in snap.items() if name == "rlmq_child_rollouts_total") == 4
    assert value(snap, "rlmq_child_root_completion_tokens_total", depth="2") == 100
    assert value(snap, "rlmq_child_root_completion_tokens_total", depth="3") == 7


def test_each_metrics_object_has_its_own_registry_and_port() -> None:
    a, b = Metrics(), Metrics()
    a.reconnect()
    assert b"rlmq_redis_reconnects_total 1.0" in a.exposition()
    assert b"rlmq_redis_reconnects_total 0.0" in b.exposition()
    pa, pb = a.serve(0), b.serve(0)
    try:
        assert pa != pb
        with pytest.raises(RuntimeError):
            a.serve(0)
    finally:
        a.close()
        b.close()
        a.close()  # idempotent
    assert a.port is None


def test_a_taken_metrics_port_is_a_usage_error_naming_it() -> None:
    import socket

    from rlmq.common.errors import ConfigError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        metrics = Metrics()
        with pytest.raises(ConfigError, match=rf"127\.0\.0\.1:{port} \(--metrics-port\)"):
            metrics.serve(port)
        metrics.close()
