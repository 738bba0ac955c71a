"""Trainable turns on a worker: what is asked of the server, what is read back, how it travels.

The model is the scripted server (a test double) in this process, reached by the worker's own
model client over HTTP; spilled payloads go to fakeredis.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import fakeredis.aioredis
import pytest

from rlmq.common import keys as K
from rlmq.common.jobs.spill import spill_result, unspill
from rlmq.common.schemas import DatasetRow, SubLLMRequest, SubLLMResult
from rlmq.common.settings import RolloutOptions
from rlmq.common.token_wire import (
    ServedTokens,
    TokenCap,
    TurnDecoder,
    TurnEncoder,
    decode_ids,
    decode_logprobs,
    encode_ids,
    encode_logprobs,
    expand_trajectory,
    served_tokens,
    turn_counts,
)
from rlmq.producer.rollout import Rollout
from rlmq.producer.root_tokens import ask_for_tokens, root_turn_tokens
from rlmq.scripted.server import ScriptedModelServer
from rlmq.workers.model import ChatClient
from rlmq.workers.subllm import SubLLMContext, run_sub_llm
from rlmq.workers.tools import ToolRegistry


def test_ids_and_logprobs_round_trip_in_binary() -> None:
    ids = [0, 1, 151_643, 2**31 - 1]
    assert decode_ids(encode_ids(ids)) == ids
    assert len(encode_ids(list(range(3000)))) == 4 * math.ceil(3000 * 4 / 3)  # int32, base64
    narrow = [-0.5, -1.25, 0.0, -17.0]
    text, dtype = encode_logprobs(narrow)
    assert dtype == "f4" and decode_logprobs(text, dtype) == narrow
    wide = [-0.1, -2.000000001]  # not float32-exact: kept as float64, unchanged
    text, dtype = encode_logprobs(wide)
    assert dtype == "f8" and decode_logprobs(text, dtype) == wide
    with pytest.raises(ValueError):
        encode_ids([2**31])
    with pytest.raises(ValueError):
        decode_ids("AAA")  # not whole int32 items


def test_later_turns_send_only_their_new_prompt_suffix() -> None:
    enc, dec = TurnEncoder(), TurnDecoder()
    t1 = ServedTokens(list(range(100, 8100)), [5, 6, 7], [-0.5, -0.25, -1.0])
    t2 = ServedTokens([*t1.prompt_ids, *t1.completion_ids, 9, 9, 9], [8], [-2.0])
    t3 = ServedTokens([1, 2, 3], [4], [-0.5])  # a re-rendered history: nothing shared
    r1, r2, r3 = (enc.encode(i + 1, t, None, {"temperature": 0.7}) for i, t in enumerate((t1, t2, t3)))
    assert r2.prefix == 8003 and decode_ids(r2.prompt) == [9, 9, 9]
    assert r2.nbytes < 60 and r1.nbytes > 8000 * 4  # the 8,000-token prompt travels once
    assert r3.prefix == 0
    out = [dec.decode(r.model_dump()) for r in (r1, r2, r3)]
    for got, want in zip(out, (t1, t2, t3), strict=True):
        assert got["prompt_token_ids"] == want.prompt_ids
        assert got["completion_token_ids"] == want.completion_ids
        assert got["completion_logprobs"] == want.logprobs
        assert got["trainable"] and got["sampling"] == {"temperature": 0.7}


def test_a_forged_record_decodes_as_untrainable_never_as_an_exception() -> None:
    enc = TurnEncoder()
    rec = enc.encode(1, ServedTokens([1, 2], [3], [-1.0]), None, {}).model_dump()
    assert TurnDecoder().decode({**rec, "prefix": 5})["untrainable_reason"] == "bad_payload"
    assert TurnDecoder().decode({**rec, "logprobs": "!!"})["untrainable_reason"] == "bad_payload"
    assert TurnDecoder().decode({**rec, "logprobs": encode_logprobs([-1.0, -2.0])[0]})["trainable"] is False
    assert TurnDecoder().decode({"turn": 2, "evil": 1})["untrainable_reason"] == "bad_payload"


def body(prompt: Any, completion: Any, logprobs: list[float] | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"token_ids": completion}
    if logprobs is not None:
        choice["logprobs"] = {"content": [{"logprob": v} for v in logprobs]}
    return {"prompt_token_ids": prompt, "choices": [choice]}


@pytest.mark.parametrize(
    ("doc", "usage", "reason"),
    [
        (body([1, 2], [3], [-1.0]), (2, 1), None),
        (body([1, 2], [3], [-1.0]), None, None),
        (body(None, [3], [-1.0]), (2, 1), "no_token_ids"),
        (body([1, 2], [3], None), (2, 1), "no_token_ids"),
        (body([1, "x"], [3], [-1.0]), (2, 1), "no_token_ids"),
        (body([1, 2], [3, 4], [-1.0]), (2, 2), "length_mismatch"),
        (body([1, 2], [3], [-1.0]), (2, 2), "usage_mismatch"),
        (body([1, 2, 3], [3], [-1.0]), (2, 1), "usage_mismatch"),
        # vLLM's reader reads vLLM's shape only: the prompt ids on the choice are SGLang's, not read
        ({"choices": [{"prompt_token_ids": [1, 2], **body(None, [3], [-1.0])["choices"][0]}]}, (2, 1), "no_token_ids"),
    ],
)
def test_served_tokens_are_checked(doc: dict[str, Any], usage: tuple[int, int] | None, reason: str | None) -> None:
    tokens, why = served_tokens(doc, usage)
    assert why == reason and (tokens is None) == (reason is not None)


def test_the_byte_cap_strips_later_turns_and_marks_them() -> None:
    enc = TurnEncoder()
    recs = [enc.encode(i, ServedTokens([i] * 100, [i], [-1.0]), None, {}) for i in range(1, 5)]
    cap = TokenCap(recs[0].nbytes + recs[1].nbytes)
    kept = [cap.admit(r) for r in recs]
    assert [k.untrainable for k in kept] == [None, None, "payload_cap", "payload_cap"]
    assert kept[2].prompt == kept[3].prompt == kept[3].completion == kept[3].logprobs == ""
    traj = [{"type": "llm_batch", "results": [{"status": "ok", "turn_tokens": [k.model_dump() for k in kept]}]}]
    assert turn_counts(traj) == {
        "trainable_turn_count": 2, "untrainable_turn_count": 2, "untrainable_turns_payload_cap": 2
    }  # fmt: skip
    turns = expand_trajectory(traj)[0]["results"][0]["steps"]
    assert [t["trainable"] for t in turns] == [True, True, False, False]
    forged = recs[0].model_copy(update={"untrainable": "no_token_ids"})  # a worker's untrainable turn with a payload
    assert TokenCap(10**9).admit(forged).prompt == ""
    assert turn_counts([{"type": "root", "content": "x"}]) == {}


def request(prompt: str, *, tokens: bool = True, sub_tools: list[str] | None = None) -> SubLLMRequest:
    now = time.time()
    return SubLLMRequest(
        model="m", rollout_id="r1", batch_id="b1", index=0, prompt=prompt, enqueued_at=now, deadline=now + 30,
        include_sub_llm_in_trajectory=tokens, max_turns=3, sub_tools=sub_tools or [], temperature=0.6,
    )  # fmt: skip


async def call(server: ScriptedModelServer, req: SubLLMRequest, frozen: bool = False) -> SubLLMResult:
    tools = ToolRegistry.from_paths(req.sub_tools)
    async with ChatClient(server.url, retries=2, backoff_base=0.01) as client:
        ctx = SubLLMContext(client=client, ledger=None, tools=tools, worker_name="w", frozen=frozen)
        return await run_sub_llm(req, ctx, job_id="j1")


async def test_a_multi_turn_sub_call_carries_every_turn_as_served() -> None:
    tool = "rlmq.workers.tools.count_words"
    prompt = 'count [[mock:tool:count_words:{"text": "a b c"}]] ' + "word " * 600
    async with ScriptedModelServer() as server:
        res = await call(server, request(prompt, sub_tools=[tool]))
        served = server.served
        params = server.stats["params"]
    assert res.status == "ok" and res.turns == 2 and res.turn_tokens is not None
    assert all(p["logprobs"] is True and p["return_token_ids"] is True for p in params)
    assert len(served) == 2
    turns = expand_trajectory([{"type": "llm_batch", "results": [res.model_dump()]}])[0]["results"][0]["steps"]
    for got, want in zip(turns, served, strict=True):
        assert got["prompt_token_ids"] == want["prompt_token_ids"]
        assert got["completion_token_ids"] == want["completion_token_ids"]
        assert got["completion_logprobs"] == want["completion_logprobs"]
        assert got["sampling"]["temperature"] == 0.6 and got["sampling"]["max_tokens"] is None
    assert [t["sampling"]["tools"] for t in turns] == [["count_words"]] * 2
    assert res.turn_tokens[1].prefix > 600  # the second turn sent only what its prompt added
    assert res.prompt_tokens == sum(len(t["prompt_token_ids"]) for t in turns)


@pytest.mark.parametrize(
    ("directive", "reason"),
    [("[[mock:token-ids:none]]", "no_token_ids"), ("[[mock:token-ids:mismatch]]", "length_mismatch"),
     ("[[mock:token-ids:usage]]", "usage_mismatch")],
)  # fmt: skip
async def test_a_turn_without_good_ids_is_kept_untrainable_never_failed(directive: str, reason: str) -> None:
    async with ScriptedModelServer() as server:
        res = await call(server, request(f"say hello {directive}"))
    assert res.status == "ok" and res.content
    assert res.turn_tokens is not None and [t.untrainable for t in res.turn_tokens] == [reason]
    assert res.turn_tokens[0].prompt == res.turn_tokens[0].completion == res.turn_tokens[0].logprobs == ""


async def test_option_off_asks_for_nothing_and_carries_nothing() -> None:
    async with ScriptedModelServer() as server:
        res = await call(server, request("say hello", tokens=False))
        params = server.stats["params"]
        assert server.served == []
    assert res.status == "ok" and res.turn_tokens is None
    assert "logprobs" not in params[-1] and "return_token_ids" not in params[-1]
    assert "turn_tokens" not in res.model_dump(exclude_none=True)


async def _frozen_sub_call() -> tuple[dict[str, Any], str | None]:
    """What a frozen worker's sub-call asked its server and the reason its one turn records."""
    async with ScriptedModelServer() as server:
        res = await call(server, request("say hello"), frozen=True)
        asked = server.stats["params"][-1]
    assert res.turn_tokens is not None and len(res.turn_tokens) == 1
    return asked, res.turn_tokens[0].untrainable


async def _frozen_root_turn() -> tuple[dict[str, Any], str | None]:
    """What a frozen REPL host's root turn asks and the reason it records, though its server sent ids."""
    rollout = Rollout(
        id="r1", row=DatasetRow(id="1", question="q", context="c"), model="m", sub_model="m", queue="q",
        options=RolloutOptions(include_sub_llm_in_trajectory=True), frozen=True,
    )  # fmt: skip
    asked = ask_for_tokens(rollout, {"model": "m", "messages": []}).get("extra_body") or {}
    body = {"prompt_token_ids": [1, 2], "choices": [{"token_ids": [3], "logprobs": {"content": [{"logprob": -0.5}]}}]}
    rollout.stats.root_turns = 1
    record = root_turn_tokens(rollout, body, {"model": "m", "messages": []}, (2, 1))
    assert record is not None and record["prompt"] == record["completion"] == ""
    return asked, record["untrainable"]


@pytest.mark.parametrize("turn", [_frozen_sub_call, _frozen_root_turn], ids=["sub_call", "root_turn"])
async def test_a_frozen_fleet_marks_its_turns_and_asks_for_nothing(
    turn: Callable[[], Awaitable[tuple[dict[str, Any], str | None]]],
) -> None:
    asked, reason = await turn()
    assert "return_token_ids" not in asked and "logprobs" not in asked
    assert reason == "frozen_fleet"


async def test_a_retried_call_carries_only_the_attempt_that_answered() -> None:
    async with ScriptedModelServer() as server:
        res = await call(server, request("hi [[mock:status:503]] [[mock:fail-times:1]]"))
        served = server.served
    assert res.status == "ok" and len(served) == 1 and res.turn_tokens is not None and len(res.turn_tokens) == 1
    got = TurnDecoder().decode(res.turn_tokens[0])
    assert got["completion_logprobs"] == served[0]["completion_logprobs"]


async def test_a_failed_call_carries_no_tokens() -> None:
    async with ScriptedModelServer() as server:
        res = await call(server, request("hi [[mock:status:400]]"))
    assert res.status == "error" and res.turn_tokens is None


async def test_a_large_payload_is_spilled_to_its_own_key_and_read_back_once() -> None:
    redis = fakeredis.aioredis.FakeRedis()
    async with ScriptedModelServer() as server:
        res = await call(server, request("word " * 8000))
    inline = res.model_copy(deep=True)
    await spill_result(redis, res, time.time() + 30)
    key = K.RolloutKeys("r1").spill("j1", 1)
    assert res.spilled and res.turn_tokens is None and len(res.model_dump_json()) < 4000
    assert 0 < await redis.ttl(key) <= 30 + 600
    back = SubLLMResult.model_validate_json(res.model_dump_json())
    await unspill(redis, [back])
    assert back.turn_tokens == inline.turn_tokens and not back.spilled
    assert await redis.exists(key) == 0  # read and deleted: Redis keeps nothing
    again = SubLLMResult.model_validate_json(res.model_dump_json())
    await unspill(redis, [again])  # gone (its TTL passed): the turn stays, untrainable
    assert again.turn_tokens is not None and [t.untrainable for t in again.turn_tokens] == ["spill_lost"]
    small = SubLLMResult.model_validate_json(inline.model_dump_json())
    small.turn_tokens = small.turn_tokens[:0] if small.turn_tokens else None
    await spill_result(redis, small, time.time() + 30)
    assert not small.spilled
    assert json.loads(inline.model_dump_json())["turn_tokens"][0]["dtype"] == "f4"


async def test_a_vllm_worker_does_not_read_sglangs_reply_shape() -> None:
    async with ScriptedModelServer() as server:
        res = await call(server, request("say hello [[mock:token-ids:sglang]]"))
    assert res.status == "ok" and res.turn_tokens is not None
    assert [t.untrainable for t in res.turn_tokens] == ["no_token_ids"]  # SGLang's: tests/unit/test_token_servers.py
