"""The worker's job-kind registry: a kind is one registration; jobs are decoded to their kind."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rlmq.common.errors import PayloadError
from rlmq.common.jobs.record import SUB_LLM_FUNC, encode_job_data
from rlmq.common.jobs.store import StartedJob
from rlmq.common.schemas import SubLLMRequest, load_request
from rlmq.workers.kinds import JobKind, KindRegistry, Outcome


async def _run(payload: Any, job: StartedJob) -> Outcome:
    return Outcome(True, json.dumps({"ran": str(payload)}), "")


def _failure(job_id: str, meta: bytes | None, kind: str, message: str, attempt: int) -> Outcome:
    return Outcome(False, json.dumps({"job": job_id, "kind": kind, "message": message}), "")


def kind(func: str, name: str, pool: str = "model_calls", **kw: Any) -> JobKind:
    return JobKind(name=name, func=func, load=kw.pop("load", dict), run=_run, failure=_failure, pool=pool, **kw)


def test_a_second_kind_is_one_registration_and_jobs_decode_to_their_kind() -> None:
    reg = KindRegistry()
    sub = reg.register(kind(SUB_LLM_FUNC, "sub_llm", load=load_request, max_attempts=2))
    child = reg.register(kind("rlmq.workers.job.run_child_rollout", "child", pool="repl", max_attempts=1, timeout=600))
    assert reg.default is sub and list(reg) == [sub, child]
    req = {
        "rollout_id": "r",
        "batch_id": "b1",
        "index": 0,
        "prompt": "p",
        "model": "m",
        "enqueued_at": 0,
        "deadline": 1,
    }
    got, payload = reg.decode(encode_job_data(SUB_LLM_FUNC, [req]))
    assert got is sub and isinstance(payload, SubLLMRequest) and payload.prompt == "p"
    got, payload = reg.decode(encode_job_data(child.func, [{"task": "t"}]))
    assert (got.name, got.pool, got.max_attempts, payload) == ("child", "repl", 1, {"task": "t"})
    with pytest.raises(ValueError, match="registered twice"):
        reg.register(kind(SUB_LLM_FUNC, "again"))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (encode_job_data("os.system", ["rm -rf /"]), "not an rlmq job of a kind this worker runs: os.system"),
        (encode_job_data(SUB_LLM_FUNC, [{}, {}]), "not an rlmq job"),
        (b"\x80\x04pickle", "not JSON"),
        (encode_job_data(SUB_LLM_FUNC, [{"prompt": 5}]), "invalid sub-LLM request"),
        (encode_job_data(SUB_LLM_FUNC, args_json="[" * 100_000 + "]" * 100_000), "nested too deep"),
    ],
)
def test_jobs_that_are_no_registered_kind_are_payload_errors(data: bytes, message: str) -> None:
    reg = KindRegistry()
    reg.register(kind(SUB_LLM_FUNC, "sub_llm", load=load_request))
    with pytest.raises(PayloadError, match=message):
        reg.decode(data)


def test_a_kind_states_sane_limits() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        kind("f", "bad", max_attempts=0)
    with pytest.raises(ValueError, match="timeout"):
        kind("f", "bad", timeout=0)
    with pytest.raises(LookupError):
        _ = KindRegistry().default


async def test_the_worker_runs_a_registered_kind_in_its_own_pool_and_ends_it_at_its_timeout() -> None:
    import asyncio

    from rlmq.common.settings import load_settings
    from rlmq.workers.capacity import MODEL_CALLS, PoolSpec
    from rlmq.workers.worker import SubLLMWorker

    w = SubLLMWorker(load_settings(redis_url="redis://127.0.0.1:1", base_url="http://127.0.0.1:1/v1", model="m"))
    w.capacity.add_pool("repl", PoolSpec(1))
    started = asyncio.Event()

    async def hangs(payload: Any, job: StartedJob) -> Outcome:
        started.set()
        await asyncio.Event().wait()  # never set: only the kind's timeout ends it
        raise AssertionError("unreachable")

    w.kinds.register(
        JobKind(name="child", func="tests.child", load=dict, run=hangs, failure=_failure, pool="repl", timeout=0.05)
    )
    job = StartedJob(
        job_id="r-b1-0", execution_id="e1", data=encode_job_data("tests.child", [{}]), attempt=1, reply_key="k"
    )
    w.spawn(job, "q")
    assert (w.capacity.held("repl"), w.capacity.free("repl"), w.capacity.held(MODEL_CALLS)) == (1, 0, 0)
    await asyncio.wait_for(asyncio.gather(*w.jobs.tasks), 10)
    assert started.is_set()
    [done] = w.jobs.take_done()
    assert not done.ok and json.loads(done.result_json)["kind"] == "timeout"
    w.jobs.release([done.job.member])
    assert w.capacity.free("repl") == 1
    # a job of no registered kind gets the default kind's (sub-LLM) payload error, in its pool
    bad = StartedJob(
        job_id="r-b1-1", execution_id="e2", data=encode_job_data("os.system", ["x"]), attempt=1, reply_key="k"
    )
    w.spawn(bad, "q")
    [failed] = w.jobs.take_done()
    result = json.loads(failed.result_json)
    assert (result["status"], result["error_kind"], result["index"]) == ("error", "payload", 1)
    assert result["content"].startswith("[error] invalid sub-LLM job: not an rlmq job")
