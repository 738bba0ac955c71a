"""The rollout engine (producer/engine.py) on fakeredis, with an in-memory root model and REPL:
the result row, the bookkeeping it leaves in Redis, errors and the rollout deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import pytest
from redis.asyncio import Redis

from rlmq.common import keys as K
from rlmq.common.errors import ModelError, ReplStartupError
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import RolloutOptions
from rlmq.producer.engine import run_rollout
from tests.root_fakes import FakeInterception, FakeRepl, FakeRoot, code_turn, completion, host_for

ROW = DatasetRow(id="row-1", question="What is the code?", context="The code is 7.", answer="7")


@pytest.fixture
async def redis() -> AsyncIterator[Redis]:
    client = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer())
    yield client
    await client.aclose()


async def test_a_rollout_from_its_options_alone(redis: Redis) -> None:
    repls: list[FakeRepl] = []
    root = FakeRoot(code_turn("x = 1"), code_turn("answer: 7. "))
    host = host_for(redis, root, repls)
    options = RolloutOptions(root_prompt_verbosity="medium", max_turns=9, sub_llm_max_completion_tokens=500)
    res = await run_rollout(host, ROW, options, model="root-m", queue="subq@t", rollout_id="rid1")
    row = res.row
    assert (row.id, row.stop_reason, row.final_answer, row.answer, row.correct, row.error) == (
        "row-1", "answer_ready", " 7. ", "7", True, None
    )  # fmt: skip
    assert row.metrics["main_rlm_turns"] == 2 and row.metrics["repl_call_count"] == 2
    assert row.metrics["sub_llm_budget_limit"] == 500 and row.metrics["sub_llm_budget_charged"] == 0
    system, user = res.messages[:2]
    assert system["role"] == "system" and "at most 9 turns" in system["content"] and "500" in system["content"]
    assert user == {"role": "user", "content": ROW.question}
    assert root.calls[0]["model"] == "root-m"
    # its REPL was started and closed, its token withdrawn, and it is no longer live
    assert repls[0].started and repls[0].closed
    assert isinstance(host.interception, FakeInterception) and host.interception.handlers == {}
    assert await redis.zscore(K.LIVE_ROLLOUTS, "rid1") is None and len(host.live) == 0
    info = await redis.hgetall(K.RolloutKeys("rid1").info)
    assert info[b"model"] == b"root-m" and info[b"sub_model"] == b"root-m" and info[b"queue"] == b"subq@t"
    assert 0 < await redis.ttl(K.RolloutKeys("rid1").info) <= options.rollout_key_ttl
    assert await redis.hget(K.RolloutKeys("rid1").budget, "limit") == b"500"


async def test_while_it_runs_it_is_live_and_its_batch_handler_is_registered(redis: Redis) -> None:
    repls: list[FakeRepl] = []
    seen: dict[str, Any] = {}
    host = host_for(redis, FakeRoot(code_turn("answer:1")), repls)

    async def first_turn(kwargs: dict[str, Any]) -> Any:
        seen["live"] = await redis.zscore(K.LIVE_ROLLOUTS, "rid2")
        seen["in_set"] = "rid2" in host.live
        seen["handlers"] = len(host.interception.handlers)  # type: ignore[attr-defined]
        return code_turn("answer:1")

    host.root = FakeRoot(first_turn)
    res = await run_rollout(host, ROW, RolloutOptions(rollout_key_ttl=60), model="m", queue="q", rollout_id="rid2")
    assert res.row.stop_reason == "answer_ready"
    # listed live for a lease of 30 s (min(30, key TTL)) that its host refreshes, not the key TTL
    assert seen["live"] is not None and time.time() + 20 < seen["live"] <= time.time() + 31
    assert seen["in_set"] and seen["handlers"] == 1


async def test_a_failure_inside_is_an_error_row_and_everything_is_released(redis: Redis) -> None:
    repls: list[FakeRepl] = []
    host = host_for(redis, FakeRoot(code_turn("content:part"), ModelError("root answered 500", 500)), repls)
    res = await run_rollout(host, ROW, RolloutOptions(), model="m", queue="q", rollout_id="rid3")
    assert res.row.stop_reason == "error" and res.row.error == "ModelError: root answered 500"
    assert res.row.final_answer is None and res.row.correct is False
    assert repls[0].closed and host.interception.handlers == {}  # type: ignore[attr-defined]
    assert await redis.zscore(K.LIVE_ROLLOUTS, "rid3") is None

    class BadStart(FakeRepl):
        async def start(self) -> None:
            raise ReplStartupError("the REPL did not come up within 1 s")

    host.make_repl = lambda *a: BadStart()
    res = await run_rollout(host, ROW, RolloutOptions(), model="m", queue="q")
    assert res.row.stop_reason == "error" and res.row.error.startswith("ReplStartupError")  # type: ignore[union-attr]


async def test_the_deadline_ends_a_rollout_without_a_turn_limit(redis: Redis) -> None:
    repls: list[FakeRepl] = []

    async def slow(kwargs: dict[str, Any]) -> Any:
        await asyncio.sleep(0.05)
        return code_turn("again")

    host = host_for(redis, FakeRoot(slow), repls)
    options = RolloutOptions(max_turns=0, rollout_timeout=0.5)
    t0 = time.monotonic()
    res = await run_rollout(host, ROW, options, model="m", queue="q", rollout_id="rid4")
    took = time.monotonic() - t0
    assert res.row.stop_reason == "error"
    assert res.row.error == "RolloutTimeout: the rollout ran past its deadline of 0.5 s"
    assert 0.5 <= took < 5, took
    assert res.row.metrics["main_rlm_turns"] >= 3  # it kept going until the deadline
    assert repls[0].closed and await redis.zscore(K.LIVE_ROLLOUTS, "rid4") is None


async def test_a_cancelled_rollout_leaves_no_live_entry(redis: Redis) -> None:
    repls: list[FakeRepl] = []
    started = asyncio.Event()

    async def hang(kwargs: dict[str, Any]) -> Any:
        started.set()
        await asyncio.Event().wait()

    host = host_for(redis, FakeRoot(hang), repls)
    task = asyncio.create_task(run_rollout(host, ROW, RolloutOptions(), model="m", queue="q", rollout_id="rid5"))
    await asyncio.wait_for(started.wait(), 5)
    assert await redis.zscore(K.LIVE_ROLLOUTS, "rid5") is not None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert repls[0].closed and await redis.zscore(K.LIVE_ROLLOUTS, "rid5") is None and len(host.live) == 0


async def test_the_new_stops_reach_the_result_row(redis: Redis) -> None:
    from rlmq.common.errors import PromptTooLongError

    repls: list[FakeRepl] = []
    refused = PromptTooLongError("maximum context length is 100 tokens", 400)
    host = host_for(redis, FakeRoot(code_turn("content:7"), refused), repls)
    res = await run_rollout(host, ROW, RolloutOptions(), model="m", queue="q")
    assert (res.row.stop_reason, res.row.final_answer, res.row.correct, res.row.error) == (
        "prompt_too_long", "7", True, None
    )  # fmt: skip
    host.root = FakeRoot(code_turn("hang"), completion("unreached"))
    res = await run_rollout(host, ROW, RolloutOptions(abort_on_code_timeout=True), model="m", queue="q")
    assert (res.row.stop_reason, res.row.final_answer, res.row.error) == ("code_timeout", None, None)


async def test_the_live_set_refreshes_each_rollouts_keys_with_its_own_ttl(redis: Redis) -> None:
    host = host_for(redis, FakeRoot(completion("x")), [])
    await host.live.enter("a", 100, {"model": "m"})
    await host.live.enter("b", 1000, {"model": "m"})
    await redis.expire(K.RolloutKeys("a").info, 5)
    await host.live.refresh()
    assert 90 < await redis.ttl(K.RolloutKeys("a").info) <= 100
    assert 900 < await redis.ttl(K.RolloutKeys("b").info) <= 1000
    await host.live.leave("a")
    assert await redis.zscore(K.LIVE_ROLLOUTS, "a") is None and await redis.zscore(K.LIVE_ROLLOUTS, "b") is not None


async def test_a_repl_that_cannot_be_made_leaves_nothing_registered_or_live(redis: Redis) -> None:
    host = host_for(redis, FakeRoot(completion("x")), [])

    def refuse(*args: Any) -> FakeRepl:
        raise TypeError("context is not JSON-serializable")

    host.make_repl = refuse
    with pytest.raises(TypeError):
        await run_rollout(host, ROW, RolloutOptions(), model="m", queue="q", rollout_id="rid6")
    assert host.interception.handlers == {}  # type: ignore[attr-defined]
    assert await redis.zscore(K.LIVE_ROLLOUTS, "rid6") is None and len(host.live) == 0


async def test_a_rollout_cancelled_while_it_is_announced_is_not_left_live(redis: Redis) -> None:
    """Redis ran the ZADD but the caller was cancelled before the reply (a stop signal at that
    moment): the entry is withdrawn, not left for `rlmq status` to list for an hour."""
    host = host_for(redis, FakeRoot(completion("x")), [])
    zadd = redis.zadd

    async def zadd_then_cancelled(*args: Any, **kwargs: Any) -> Any:
        await zadd(*args, **kwargs)
        raise asyncio.CancelledError

    redis.zadd = zadd_then_cancelled  # type: ignore[method-assign]
    with pytest.raises(asyncio.CancelledError):
        await run_rollout(host, ROW, RolloutOptions(), model="m", queue="q", rollout_id="rid7")
    assert await redis.zscore(K.LIVE_ROLLOUTS, "rid7") is None and len(host.live) == 0
