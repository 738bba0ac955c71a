"""The child-rollout job kind's results that need no rollout: a deadline already passed, invalid
options, an abandoned job."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import pytest

from rlmq.common.jobs.record import CHILD_ROLLOUT_FUNC, encode_job_data
from rlmq.common.jobs.store import StartedJob
from rlmq.common.schemas import ChildRolloutRequest, ResultRow, SubLLMResult
from rlmq.common.settings import RolloutOptions, load_settings
from rlmq.producer.child_trajectory import CHILD_TRAJECTORY_MAX_CHARS
from rlmq.producer.rollout import RolloutResult
from rlmq.workers import child_kind
from rlmq.workers.child_kind import CHILD_ABANDONED_CONTENT, child_node
from rlmq.workers.worker import SubLLMWorker


class _LiveParents:
    """A ledger stand-in in which every parent node is alive (the parent check passes)."""

    async def node_alive(self, ledger_id: str, node_id: str) -> bool:
        return True


def _worker() -> SubLLMWorker:
    s = load_settings(redis_url="redis://127.0.0.1:1", base_url="http://127.0.0.1:1/v1", model="m", repl_slots=1)
    w = SubLLMWorker(s, name="w-test")
    w.ledger = _LiveParents()  # type: ignore[assignment]
    return w


def _req(**kw: object) -> ChildRolloutRequest:
    now = time.time()
    fields: dict[str, object] = {
        "rollout_id": "top", "batch_id": "b1", "index": 2, "child_id": "c9", "ledger_id": "top", "nodes": ["top"],
        "depth": 2, "max_depth": 2, "prompt": "p", "model": "m", "enqueued_at": now, "deadline": now + 60,
    }  # fmt: skip
    fields.update(kw)
    return ChildRolloutRequest.model_validate(fields)


def _job(req: ChildRolloutRequest, attempt: int = 1) -> StartedJob:
    data = encode_job_data(CHILD_ROLLOUT_FUNC, [req.model_dump(mode="json")])
    return StartedJob("top-b1-2", "e1", data, attempt, "k")


async def test_a_child_past_its_parents_deadline_or_with_invalid_options_ends_as_an_error_slot() -> None:
    w = _worker()
    late = await w.children.run(_req(deadline=time.time() - 1), _job(_req(), attempt=2))
    res = SubLLMResult.model_validate_json(late.result_json)
    assert not late.ok and (res.status, res.error_kind, res.index, res.attempt, res.worker) == (
        "error", "deadline", 2, 2, "w-test",
    )  # fmt: skip
    bad = await w.children.run(_req(options={"max_turns": "many"}), _job(_req()))
    res = SubLLMResult.model_validate_json(bad.result_json)
    assert (res.error_kind, res.child) == ("payload", None) and "max_turns" in (res.error or "")


def test_an_abandoned_child_names_its_slot_and_attempts_run_under_fresh_ids() -> None:
    w = _worker()
    meta = json.dumps({"rollout_id": "top", "batch_id": "b1", "index": 2}).encode()
    res = SubLLMResult.model_validate_json(w.children.abandoned("top-b1-2", meta))
    assert (res.rollout_id, res.batch_id, res.index, res.error_kind) == ("top", "b1", 2, "abandoned")
    assert res.content == CHILD_ABANDONED_CONTENT
    assert [child_node("c9", n) for n in (1, 2)] == ["c9-1", "c9-2"]


async def test_a_child_trajectory_of_many_mb_is_cut_on_its_worker_before_it_reaches_redis(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hostile child prints 40 MB into its trajectory: the result that leaves the worker is
    bounded, says what it left out, and keeps the last event (the answer's turn) and the metrics."""
    w = _worker()
    big = "x" * 1_000_000
    trajectory: list[dict[str, Any]] = [{"type": "cell", "code": "print(x)", "output": big} for _ in range(40)]
    trajectory.append({"type": "root", "n": 41, "content": "answer['ready'] = True"})

    async def fake_run_rollout(*args: Any, **kwargs: Any) -> RolloutResult:
        row = ResultRow(id="c9", final_answer="42", answer=None, correct=None, stop_reason="answer_ready",
                        metrics={"turns": 41, "main_rlm_turns": 41})  # fmt: skip
        return RolloutResult(row=row, trajectory=trajectory, messages=[])

    monkeypatch.setattr(child_kind, "run_rollout", fake_run_rollout)
    w.child_host._host = object()  # type: ignore[assignment]  # run_rollout is faked: the host is only passed on
    out = await w.children.run(_req(), _job(_req()))
    assert len(out.result_json) <= CHILD_TRAJECTORY_MAX_CHARS + 10_000
    res = SubLLMResult.model_validate_json(out.result_json)
    assert res.status == "ok" and res.content == "42" and res.child is not None
    assert res.child.metrics["main_rlm_turns"] == 41
    events = res.child.trajectory
    assert events[-2] == trajectory[-1]
    cut = events[-1]
    assert cut["type"] == "cut" and cut["events_dropped"] == 41 - len(events) + 1 and cut["chars"] > 40_000_000


async def test_a_childs_payload_never_makes_its_worker_pip_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """pip runs outside the REPL sandbox with the worker's rights: a child job naming packages
    (a tenant's payload, or a parent's --pip-install-packages) runs without them."""
    w = _worker()
    got: list[RolloutOptions] = []

    async def fake_run_rollout(host: Any, row: Any, options: RolloutOptions, **kwargs: Any) -> RolloutResult:
        got.append(options)
        res = ResultRow(id="c9", final_answer="ok", answer=None, correct=None, stop_reason="answer_ready", metrics={})
        return RolloutResult(row=res, trajectory=[], messages=[])

    monkeypatch.setattr(child_kind, "run_rollout", fake_run_rollout)
    w.child_host._host = object()  # type: ignore[assignment]  # run_rollout is faked: the host is only passed on
    req = _req(options={"pip_install_packages": ["git+https://example.invalid/evil.git"], "max_turns": 7})
    out = await w.children.run(req, _job(req))
    assert out.ok and got[0].pip_install_packages == [] and got[0].max_turns == 7


async def test_a_child_answer_and_trajectory_with_lone_surrogates_still_reach_the_parent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A child's REPL answer (json.loads of its bytes passes surrogates) and a root model's text
    (JSON escapes) can hold lone surrogates, which JSON for Redis cannot carry."""
    w = _worker()

    async def fake_run_rollout(*args: Any, **kwargs: Any) -> RolloutResult:
        res = ResultRow(id="c9", final_answer="a\ud800b", answer=None, correct=None, stop_reason="answer_ready",
                        metrics={})  # fmt: skip
        return RolloutResult(row=res, trajectory=[{"type": "root", "content": "x\udcffy"}], messages=[])

    monkeypatch.setattr(child_kind, "run_rollout", fake_run_rollout)
    w.child_host._host = object()  # type: ignore[assignment]  # run_rollout is faked: the host is only passed on
    out = await w.children.run(_req(), _job(_req()))
    res = SubLLMResult.model_validate_json(out.result_json)
    assert out.ok and res.content == "a\ufffdb" and res.child is not None
    assert res.child.trajectory == [{"type": "root", "content": "x\ufffdy"}]


async def test_a_job_whose_run_raises_still_ends_with_an_error_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: an exception past the child's run (e.g. serialising its result) left the job held
    by the worker, and its parent waited until the slot's deadline."""
    w = _worker()
    finished: list[Any] = []
    monkeypatch.setattr(w, "finish_job", lambda job, outcome: finished.append(outcome))

    async def broken(req: Any, job: Any) -> Any:
        raise ValueError("a bug past the rollout")

    kind = dataclasses.replace(w.children.kind(max_attempts=2), run=broken)
    await w._run_job(_job(_req()), kind, _req())
    (outcome,) = finished
    res = SubLLMResult.model_validate_json(outcome.result_json)
    assert not outcome.ok and (res.status, res.error_kind, res.index) == ("error", "host", 2)
    assert "ValueError: a bug past the rollout" in res.content


def test_the_child_rollout_job_names_a_real_function_that_refuses_on_a_stock_rq_worker() -> None:
    """``CHILD_ROLLOUT_FUNC`` resolves as RQ resolves a job's function; called (a stock RQ worker
    took the job) it refuses in one line naming what can run it."""
    import importlib

    from rlmq.common.errors import ConfigError
    from rlmq.common.jobs.record import SUB_LLM_FUNC

    for path in (CHILD_ROLLOUT_FUNC, SUB_LLM_FUNC):
        module, name = path.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), name)), path
    module, name = CHILD_ROLLOUT_FUNC.rsplit(".", 1)
    with pytest.raises(ConfigError, match=r"--repl-slots") as info:
        getattr(importlib.import_module(module), name)({})
    assert "\n" not in str(info.value)
