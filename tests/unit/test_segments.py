"""Segment grants that continue an answer (fakeredis ledger + the scripted model over HTTP).

A budgeted sub-call turn is granted a segment; an answer that reaches its segment's end goes on on
the server (``continue_final_message``) under the next segment, each reserved before it is generated.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import fakeredis.aioredis
import pytest

from rlmq.common.budget.calls import Settle
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.budget.wire import ESTIMATE_SAMPLES, SEGMENT_MIN
from rlmq.common.keys import LedgerKeys
from rlmq.common.schemas import SubLLMRequest
from rlmq.common.token_wire import TurnDecoder
from rlmq.scripted.server import ScriptedModelServer
from rlmq.workers.continuation import Continuation
from rlmq.workers.model import ChatClient
from rlmq.workers.subllm import SubLLMContext, run_sub_llm
from rlmq.workers.tools import ToolRegistry

ROLLOUT = "seg1"


@pytest.fixture
async def redis() -> AsyncIterator[fakeredis.aioredis.FakeRedis]:
    r = fakeredis.aioredis.FakeRedis(max_connections=1024)
    yield r
    await r.aclose()


@pytest.fixture
async def server() -> AsyncIterator[ScriptedModelServer]:
    async with ScriptedModelServer() as srv:
        yield srv


async def _ctx(
    redis: Any, server: ScriptedModelServer, continuation: Continuation = "continue_final_message", longest: int = 200
) -> tuple[SubLLMContext, BudgetLedger]:
    """A worker's context on ``server``, and a ledger of 2,000 tokens (cap 2,048) whose longest answer
    so far is ``longest`` (later answers start with a segment of 1.25 x that)."""
    ledger = BudgetLedger(redis)
    await ledger.open(ROLLOUT, 2000, cap=2048)
    learn(ledger, longest)
    await asyncio.sleep(0.02)
    client = ChatClient(server.url, "key", retries=0)
    ctx = SubLLMContext(client=client, ledger=ledger, tools=ToolRegistry(), worker_name="w", continuation=continuation)
    return ctx, ledger


def learn(ledger: BudgetLedger, longest: int) -> None:
    """Note :data:`ESTIMATE_SAMPLES` answers that ended on their own, the longest of ``longest``
    tokens: later answers start with 1.25 x that."""
    for _ in range(ESTIMATE_SAMPLES - 1):
        ledger.note_answer(ROLLOUT, 1)
    ledger.note_answer(ROLLOUT, longest)


def _request(prompt: str, index: int = 0, **kw: Any) -> SubLLMRequest:
    now = time.time()
    values: dict[str, Any] = {
        "rollout_id": ROLLOUT, "batch_id": "b1", "index": index, "prompt": prompt, "model": "m",
        "enqueued_at": now, "deadline": now + 20, "budgeted": True, "max_completion_tokens": 2048,
    }  # fmt: skip
    values.update(kw)
    return SubLLMRequest(**values)


# ------------------------------------------------------------------------------- the ledger's rule


async def test_a_first_segment_is_an_answer_estimate_and_a_running_answer_goes_on_first(redis: Any) -> None:
    ledger = BudgetLedger(redis)
    await ledger.open(ROLLOUT, 2000, cap=2048)
    dl = time.time() + 30
    alone = await ledger.reserve(ROLLOUT, "z:1", 2048, dl, segment=0)
    assert alone.tokens == 2000  # before any answer ended: a whole cap, as without segments
    await ledger.settle(ROLLOUT, "z:1", 0)
    learn(ledger, 200)  # the longest answer so far: later answers start with 1.25 x 200
    await asyncio.sleep(0.05)
    first = await ledger.reserve(ROLLOUT, "a:1", 2048, dl, segment=0)
    assert (first.tokens, first.need) == (250, 250)
    # more answers start while another estimate stays free beside theirs (free >= 2 x 250)
    grants = [await ledger.reserve(ROLLOUT, f"b{i}:1", 2048, dl, segment=0) for i in range(6)]
    assert [g.tokens for g in grants] == [250] * 6
    late = await ledger.reserve(ROLLOUT, "c:1", 2048, dl, segment=0)
    assert late.code == 4 and not late.granted and late.need == 250  # 250 free < 500: it waits
    await ledger.settle(ROLLOUT, "a:1", 250)  # answer a stopped at its segment's end
    await ledger.settle(ROLLOUT, "b0:1", 40)  # b0 ended early: 210 back
    cont = await ledger.reserve(ROLLOUT, "a:1:s2", 2048, dl, segment=250)
    assert cont.tokens == 313  # a running answer goes on (1.25 x what it spent) where a new one may not start
    snap = await ledger.snapshot(ROLLOUT)
    assert snap is not None and snap.charged == 1853 and snap.rejections == 0


async def test_no_more_answers_run_on_an_estimate_than_answers_have_ended(redis: Any) -> None:
    """The first answers to end are the shortest: until :data:`ESTIMATE_SAMPLES` answers ended on
    their own, at most as many answers run on an estimate as have ended, and the next starts with its
    whole cap (a burst started on the shortest answer's length outran it together and was cut at the
    budget's end); answers cut or failed (noted 0) do not count."""
    ledger = BudgetLedger(redis)
    await ledger.open(ROLLOUT, 20_000, cap=2048)
    dl = time.time() + 30
    ledger.note_answer(ROLLOUT, 100)
    ledger.note_answer(ROLLOUT, 100)
    ledger.note_answer(ROLLOUT, 0)  # not on its own: no sample
    await asyncio.sleep(0.05)
    on_estimate = [await ledger.reserve(ROLLOUT, f"a{i}:1", 2048, dl, segment=0) for i in range(2)]
    assert [g.tokens for g in on_estimate] == [125, 125]  # two answers ended: two run on 1.25 x 100
    whole = await ledger.reserve(ROLLOUT, "b:1", 2048, dl, segment=0)
    assert whole.tokens == 2048  # a third starts with its whole cap
    ledger.note_answer(ROLLOUT, 160)
    await asyncio.sleep(0.05)
    third = await ledger.reserve(ROLLOUT, "c:1", 2048, dl, segment=0)
    assert third.tokens == 200  # three ended: a third runs on 1.25 x the longest
    assert await redis.hget(LedgerKeys(ROLLOUT).budget, "answered") == b"3"
    for _ in range(ESTIMATE_SAMPLES - 3):
        ledger.note_answer(ROLLOUT, 100)
    await asyncio.sleep(0.05)
    many = [await ledger.reserve(ROLLOUT, f"d{i}:1", 2048, dl, segment=0) for i in range(10)]
    assert [g.tokens for g in many] == [200] * 10  # eight ended: any number run on the estimate


async def test_answers_start_with_the_longest_answer_so_far_and_continue_before_new_ones(redis: Any) -> None:
    ledger = BudgetLedger(redis)
    await ledger.open(ROLLOUT, 3600, cap=2048)
    dl = time.time() + 30
    learn(ledger, 720)  # the longest answer so far: later answers start with 1.25 x 720
    await asyncio.sleep(0.05)
    small = await ledger.reserve(ROLLOUT, "x:1", 300, dl, segment=0)  # a job capped at 300
    assert small.tokens == 300
    a = await ledger.reserve(ROLLOUT, "a:1", 2048, dl, segment=0)
    b = await ledger.reserve(ROLLOUT, "b:1", 2048, dl, segment=0)
    assert (a.tokens, b.tokens) == (900, 900)
    c = await ledger.reserve(ROLLOUT, "c:1", 2048, dl, segment=0)
    assert c.code == 4 and c.need == 900  # 1500 free: below 2 x 900, a new answer waits
    await ledger.settle(ROLLOUT, "a:1", 900)  # a reached its segment's end: it goes on first
    a2 = await ledger.reserve(ROLLOUT, "a:1:s2", 2048, dl, segment=900)
    assert a2.tokens == 1125  # 1.25 x what it has spent
    await ledger.settle(ROLLOUT, "b:1", 900)
    b2 = await ledger.reserve(ROLLOUT, "b:1:s2", 2048, dl, segment=900)
    assert b2.tokens == 375  # what is free, from SEGMENT_MIN up
    low = await ledger.reserve(ROLLOUT, "x:1:s2", 2048, dl, segment=300)
    assert low.code == 4 and low.need == SEGMENT_MIN  # a continuation waits for SEGMENT_MIN, not a whole segment
    assert SEGMENT_MIN == 64


async def test_a_new_answer_waits_while_free_tokens_do_not_cover_what_running_answers_need(redis: Any) -> None:
    """An answer that outran its first segment is estimated up to its whole cap: a new answer starts
    only while the free budget covers that too (``docs/budget.md``); once it ends, the pledge is gone.
    A running answer goes on with 1.25 x what it has spent, and its length grows new answers' estimate."""
    ledger = BudgetLedger(redis)
    await ledger.open(ROLLOUT, 5000, cap=2048)
    dl = time.time() + 30
    learn(ledger, 400)  # the longest answer so far: an estimate of 500
    await asyncio.sleep(0.05)
    a = await ledger.reserve(ROLLOUT, "a:1", 2048, dl, segment=0)
    assert a.tokens == 500
    await ledger.settle(ROLLOUT, "a:1", 500)  # a reached its segment's end: longer than estimated
    a2 = await ledger.reserve(ROLLOUT, "a:1:s2", 2048, dl, segment=500)
    assert a2.tokens == 625  # 1.25 x the 500 a has spent
    # a holds 625 and pledges 2048 - 1125 = 923 more; new answers start with 1.25 x 500 while
    # free >= 625 + 923
    firsts = [await ledger.reserve(ROLLOUT, f"b{i}:1", 2048, dl, segment=0) for i in range(4)]
    assert [g.tokens for g in firsts] == [625] * 4
    late = await ledger.reserve(ROLLOUT, "c:1", 2048, dl, segment=0)
    assert late.code == 4 and late.need == 625  # 1375 free < 625 + 923: it waits (2 x 625 would fit)
    ledger.note_answer(ROLLOUT, 0, answer="a:1")  # a ended, not on its own (0): it pledges no more
    for _ in range(100):
        late = await ledger.reserve(ROLLOUT, "c:1", 2048, dl, segment=0)
        if late.granted:
            break
        await asyncio.sleep(0.01)
    assert late.tokens == 500  # 1.25 x the longest answer that ended (a's 0 is not one)
    snap = await ledger.snapshot(ROLLOUT)
    assert snap is not None and snap.charged == 4125 and snap.rejections == 0


async def test_a_segment_past_the_answers_cap_is_refused_without_counting_a_rejection(redis: Any) -> None:
    ledger = BudgetLedger(redis)
    await ledger.open(ROLLOUT, 5000, cap=300)
    dl = time.time() + 30
    g = await ledger.reserve(ROLLOUT, "a:1", 0, dl, segment=300)
    assert not g.granted
    snap = await ledger.snapshot(ROLLOUT)
    assert snap is not None and snap.rejections == 0 and snap.charged == 0


# ------------------------------------------------------------------------------- one answer, continued


async def test_a_long_answer_is_continued_whole_and_trainable_id_for_id(
    redis: Any, server: ScriptedModelServer
) -> None:
    ctx, ledger = await _ctx(redis, server)
    result = await run_sub_llm(
        _request("Summarize. [[mock:tokens:700]]", include_sub_llm_in_trajectory=True), ctx, job_id="j1"
    )
    assert result.status == "ok" and not result.truncated
    assert result.completion_tokens == 700 and result.segments == 3  # 250 + 313 + 137
    unsegmented = await ChatClient(server.url, "k").chat(
        model="m", messages=[{"role": "user", "content": "Summarize. [[mock:tokens:700]]"}], max_tokens=2048
    )
    assert result.content == unsegmented.content  # the same answer, joined exactly
    stats = server.stats
    assert stats["per_user"][ROLLOUT]["completion_tokens"] == 700  # the server's own count
    snap = await ledger.snapshot(ROLLOUT)
    assert snap is not None and (snap.used, snap.charged, snap.overrun) == (700, 700, 0)
    served = [s for s in server.served if s["user"] == ROLLOUT]
    assert len(served) == 3
    assert result.turn_tokens is not None and len(result.turn_tokens) == 1
    record = TurnDecoder().decode(result.turn_tokens[0])
    assert record["completion_token_ids"] == [i for s in served for i in s["completion_token_ids"]]
    assert record["completion_logprobs"] == [x for s in served for x in s["completion_logprobs"]]
    assert record["prompt_token_ids"] == served[0]["prompt_token_ids"]
    # each continuation was prompted with the first prompt and every id sampled before it
    so_far = served[0]["prompt_token_ids"] + served[0]["completion_token_ids"]
    assert served[1]["prompt_token_ids"] == so_far
    sent = [p for p in stats["params"] if p.get("user") == ROLLOUT]
    assert [p.get("continue_final_message") for p in sent] == [None, True, True]
    assert [p.get("add_generation_prompt") for p in sent] == [None, False, False]
    # 1.25 x the longest answer that ended (200), then 1.25 x what this answer has spent
    assert [p["max_tokens"] for p in sent] == [250, 313, 704]


async def test_an_answer_that_ends_with_its_call_is_noted_with_the_settlement_sent_with_finish(
    redis: Any, server: ScriptedModelServer
) -> None:
    """A one-segment answer whose last settlement rides with the worker's FINISH (``settle_out``) sends
    the ledger one operation of its own (the reservation): the note that it ended goes with that
    settlement, in the same script call, and until then the answer counts as running."""
    ctx, ledger = await _ctx(redis, server)
    ops: list[str] = []
    submit = ledger._submit

    def counted(ledger_id: str, op: str, *args: Any, **kw: Any) -> Any:
        ops.append(op)
        return submit(ledger_id, op, *args, **kw)

    ledger._submit = counted  # type: ignore[method-assign]
    out: list[Settle] = []
    result = await run_sub_llm(_request("Summarize. [[mock:tokens:120]]"), ctx, job_id="j1", settle_out=out)
    await asyncio.sleep(0.05)
    assert (result.status, result.completion_tokens, result.segments) == ("ok", 120, 1)
    assert ops == ["g::0"] and out == [Settle(ROLLOUT, "j1:1:1", 120, "j1:1:1", 120)]
    answers = LedgerKeys(ROLLOUT).answers
    assert await redis.hkeys(answers) == [b"j1:1:1"]  # running until the settlement goes out
    async with redis.pipeline(transaction=False) as pipe:
        ledger.add_settles(pipe, out)
        await pipe.execute()
    assert await redis.hkeys(answers) == []
    snap = await ledger.snapshot(ROLLOUT)
    assert snap is not None and (snap.charged, snap.used) == (120, 120)
    assert await redis.hget(LedgerKeys(ROLLOUT).budget, "longest") == b"200"  # 120 < the longest so far
    ledger._submit = submit  # type: ignore[method-assign]
    await ledger.reserve(ROLLOUT, "x:1", 2048, time.time() + 30, segment=0)
    out2: list[Settle] = []
    await run_sub_llm(_request("Summarize. [[mock:tokens:300]]"), ctx, job_id="j2", settle_out=out2)
    assert out2 == [Settle(ROLLOUT, "j2:1:1:s2", 50, "j2:1:1", 300)]  # 250, then the next segment's 50
    async with redis.pipeline(transaction=False) as pipe:
        ledger.add_settles(pipe, out2)
        await pipe.execute()
    assert await redis.hget(LedgerKeys(ROLLOUT).budget, "longest") == b"300"
    assert await redis.hkeys(answers) == [b"x:1"]


async def test_a_retokenized_boundary_marks_the_turn_untrainable(redis: Any, server: ScriptedModelServer) -> None:
    ctx, ledger = await _ctx(redis, server)
    prompt = "Summarize. [[mock:tokens:400]] [[mock:continue-boundary]]"
    result = await run_sub_llm(_request(prompt, include_sub_llm_in_trajectory=True), ctx, job_id="j1")
    assert result.status == "ok" and result.completion_tokens == 400 and result.segments == 2
    assert result.turn_tokens is not None
    record = TurnDecoder().decode(result.turn_tokens[0])
    assert (record["trainable"], record["untrainable_reason"]) == (False, "continuation_boundary")
    assert "completion_token_ids" not in record


async def test_a_server_without_continuation_keeps_whole_cap_grants(redis: Any, server: ScriptedModelServer) -> None:
    ctx, _ = await _ctx(redis, server, continuation="none")
    result = await run_sub_llm(_request("Summarize. [[mock:tokens:700]]"), ctx, job_id="j1")
    assert (result.status, result.completion_tokens, result.segments, result.granted_tokens) == ("ok", 700, 1, 2000)
    assert all("continue_final_message" not in p for p in server.stats["params"])


async def test_prefill_continues_with_a_last_assistant_message_only(redis: Any, server: ScriptedModelServer) -> None:
    ctx, ledger = await _ctx(redis, server, continuation="prefill")
    result = await run_sub_llm(_request("Summarize. [[mock:tokens:400]]"), ctx, job_id="j1")
    assert (result.status, result.completion_tokens, result.segments) == ("ok", 400, 2)
    assert all("continue_final_message" not in p for p in server.stats["params"])


async def test_the_budgets_end_cuts_one_answer_and_never_overshoots(redis: Any, server: ScriptedModelServer) -> None:
    """8 answers of 300-700 tokens, paced at 2,000 tokens/s each, under 2,000 (the longest so far 400):
    3 start at once, the server serves at most 2,000, and few answers are cut."""
    ctx, ledger = await _ctx(redis, server, longest=400)
    reqs = [_request(f"part {i} [[mock:tokens:300-700]] [[mock:tps:2000]]", i) for i in range(8)]
    results = await asyncio.gather(*(run_sub_llm(r, ctx, job_id=f"j{r.index}") for r in reqs))
    served = server.stats["per_user"][ROLLOUT]["completion_tokens"]
    assert served <= 2000 and served >= 1900
    assert sum(r.completion_tokens for r in results) == served
    assert all(r.status in ("ok", "rejected") for r in results)
    assert sum(1 for r in results if r.truncated) <= 2
    assert server.stats["in_flight_peak"] >= 3  # 3 answers of 500 at once from the start (1,000 stays free)


async def test_scripted_model_refuses_continue_final_message_with_a_generation_prompt(
    server: ScriptedModelServer,
) -> None:
    client = ChatClient(server.url, "k", retries=0)
    with pytest.raises(Exception, match="400"):
        await client.chat(
            model="m",
            messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "so"}],
            sampling={"continue_final_message": True},
        )
