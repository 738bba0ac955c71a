"""Each server's token fields, exactly as its current release writes them; weight versions; sampling.

The model is the scripted server (a test double) in this process, answering in the shape of the
server it plays (:mod:`rlmq.scripted.tokens`), reached by a worker's own model client over HTTP.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import aiohttp
import pytest

from rlmq.common.schemas import SubLLMRequest, SubLLMResult
from rlmq.common.token_servers import TokenApi, check_versions, id_fields, sampled_with
from rlmq.common.token_wire import ServedTokens, TurnDecoder, TurnEncoder, expand_trajectory, served_tokens
from rlmq.scripted.server import ScriptedModelServer
from rlmq.scripted.tokens import next_label
from rlmq.workers.model import ChatClient
from rlmq.workers.subllm import SubLLMContext, run_sub_llm
from rlmq.workers.tools import ToolRegistry

SGLANG = TokenApi("sglang")
VERSIONS = TokenApi("vllm", versions=True)


def request(prompt: str, *, temperature: float | None = 0.6, sampling: dict[str, Any] | None = None) -> SubLLMRequest:
    now = time.time()
    return SubLLMRequest(
        model="m", rollout_id="r1", batch_id="b1", index=0, prompt=prompt, enqueued_at=now, deadline=now + 30,
        include_sub_llm_in_trajectory=True, max_turns=3, temperature=temperature, sampling=sampling or {},
    )  # fmt: skip


async def call(client: ChatClient, req: SubLLMRequest) -> SubLLMResult:
    ctx = SubLLMContext(client=client, ledger=None, tools=ToolRegistry.from_paths([]), worker_name="w")
    return await run_sub_llm(req, ctx, job_id="j1")


def steps(res: SubLLMResult) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = expand_trajectory([{"type": "llm_batch", "results": [res.model_dump()]}])[0]["results"][
        0
    ]["steps"]
    return out


async def test_sglangs_chat_shape_gives_turns_whose_ids_are_what_it_served() -> None:
    async with ScriptedModelServer(token_shape="sglang") as server:
        async with ChatClient(server.url, retries=0, token_api=SGLANG) as client:
            res = await call(client, request("say hello"))
        (served,) = server.served
        params = server.stats["params"][-1]
    assert served["shape"] == "sglang"
    assert params["return_token_ids"] is params["return_prompt_token_ids"] is params["logprobs"] is True
    assert "stream" not in params and "return_weight_versions" not in params
    (turn,) = steps(res)
    assert turn["trainable"] and turn["prompt_token_ids"] == served["prompt_token_ids"]
    assert turn["completion_token_ids"] == served["completion_token_ids"]
    assert turn["completion_logprobs"] == served["completion_logprobs"]


def test_sglangs_shape_is_read_exactly() -> None:
    lp = {"content": [{"logprob": -0.5}]}
    now = {"choices": [{"prompt_token_ids": [1, 2], "response_token_ids": [3], "logprobs": lp}]}
    old = {"choices": [{"prompt_token_ids": [1, 2], "token_ids": [3], "logprobs": lp}]}
    vllm = {"prompt_token_ids": [1, 2], "choices": [{"token_ids": [3], "logprobs": lp}]}
    tokens, why = served_tokens(now, (2, 1), SGLANG)
    assert why is None and tokens == ServedTokens([1, 2], [3], [-0.5])
    assert served_tokens(old, (2, 1), SGLANG) == (None, "no_token_ids")
    assert served_tokens(vllm, (2, 1), SGLANG) == (None, "no_token_ids")
    assert served_tokens(now, (2, 1), TokenApi("vllm")) == (None, "no_token_ids")
    assert served_tokens(vllm, (2, 1), TokenApi("vllm"))[1] is None
    assert id_fields(old) == ["choices[0].prompt_token_ids", "choices[0].token_ids"]


async def test_the_old_sglang_field_alone_is_untrainable_and_said_once_per_worker(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="rlmq.model")
    async with ScriptedModelServer(token_shape="sglang") as server:
        async with ChatClient(server.url, retries=0, token_api=SGLANG) as client:
            results = [
                await call(client, request(f"say hello {i} [[mock:token-ids:sglang-token-ids]]")) for i in range(3)
            ]
        async with ChatClient(server.url, retries=0, token_api=SGLANG) as other:  # another worker says it too
            await call(other, request("say hi [[mock:token-ids:sglang-token-ids]]"))
    for res in results:
        assert res.status == "ok" and res.turn_tokens is not None
        assert [t.untrainable for t in res.turn_tokens] == ["no_token_ids"]
    lines = [r.getMessage() for r in caplog.records if "token fields of sglang" in r.getMessage()]
    assert len(lines) == 2  # one per worker (model client), not one per call
    assert "choices[0].prompt_token_ids, choices[0].token_ids" in lines[0]


async def test_a_turn_sampled_across_a_weight_update_carries_two_spans() -> None:
    async with ScriptedModelServer() as server:
        server.update_weight_version("step-41")
        async with ChatClient(server.url, retries=0, token_api=VERSIONS) as client:
            whole = await call(client, request("say hello world"))
            split = await call(client, request("say hello [[mock:tokens:12]] [[mock:weight-update:5]]"))
            after = await call(client, request("say hello again"))
        served = server.served
        assert server.stats["params"][-1]["return_weight_versions"] is True
    (t1,), (t2,), (t3,) = steps(whole), steps(split), steps(after)
    assert len(t2["completion_token_ids"]) == 12
    assert t1["weight_versions"] == [{"version": "step-41", "start": 0, "end": len(t1["completion_token_ids"])}]
    assert t2["weight_versions"] == [
        {"version": "step-41", "start": 0, "end": 5}, {"version": "step-42", "start": 5, "end": 12}
    ]  # fmt: skip
    assert t3["weight_versions"][0]["version"] == "step-42"
    assert [t["weight_versions"] for t in (t1, t2, t3)] == [s["weight_versions"] for s in served]


async def test_weight_versions_off_asks_for_none_and_carries_none() -> None:
    async with ScriptedModelServer() as server:
        async with ChatClient(server.url, retries=0) as client:
            res = await call(client, request("say hello [[mock:weight-update:1]]"))
        assert "return_weight_versions" not in server.stats["params"][-1]
    assert "weight_versions" not in steps(res)[0] and "weight_versions" not in res.model_dump_json()


async def test_spans_that_do_not_cover_the_completion_are_refused() -> None:
    assert check_versions([{"version": "a", "start": 0, "end": 2}, {"version": "b", "start": 2, "end": 3}], 3)
    assert check_versions([], 0) == []
    for bad in (
        [{"version": "a", "start": 0, "end": 2}],  # short of the end
        [{"version": "a", "start": 1, "end": 3}],  # not from 0
        [{"version": "a", "start": 0, "end": 2}, {"version": "b", "start": 1, "end": 3}],  # overlapping
        [{"version": "", "start": 0, "end": 3}],
        [{"version": "a", "start": 0, "end": True}],
        "a",
    ):
        assert check_versions(bad, 3) is None
    doc = {"prompt_token_ids": [1], "choices": [{"token_ids": [3], "logprobs": {"content": [{"logprob": -1.0}]}}]}
    doc["choices"][0]["weight_versions"] = [{"version": "a", "start": 0, "end": 5}]
    assert served_tokens(doc, None, VERSIONS) == (None, "version_mismatch")
    rec = TurnEncoder().encode(1, ServedTokens([1], [3], [-1.0], [("a", 0, 1)]), None, {}).model_dump()
    assert TurnDecoder().decode(rec)["weight_versions"] == [{"version": "a", "start": 0, "end": 1}]
    forged = {**rec, "versions": [["a", 0, 2]]}  # a worker's record whose spans pass the completion
    assert TurnDecoder().decode(forged)["untrainable_reason"] == "bad_payload"


async def test_every_turn_records_the_temperature_its_tokens_were_drawn_at() -> None:
    async with ScriptedModelServer() as server:
        async with ChatClient(server.url, retries=0) as client:
            unset = await call(client, request("say hello", temperature=None))
            chosen = await call(client, request("say hello", temperature=0.6, sampling={"top_p": 0.9}))
        assert "temperature" not in server.stats["params"][0]
    assert steps(unset)[0]["sampled_with"] == {
        "temperature": 1.0, "temperature_source": "server_default", "top_p": 1.0, "top_p_source": "server_default"
    }  # fmt: skip
    assert steps(chosen)[0]["sampled_with"] == {
        "temperature": 0.6, "temperature_source": "request", "top_p": 0.9, "top_p_source": "request"
    }  # fmt: skip
    assert sampled_with({"temperature": True}, TokenApi())["temperature_source"] == "server_default"


async def test_the_scripted_weights_take_a_label_as_vllms_dev_endpoint_sets_it() -> None:
    assert (next_label("step-7"), next_label("run-a/9"), next_label("v")) == ("step-8", "run-a/10", "v-1")
    async with ScriptedModelServer() as server, aiohttp.ClientSession() as session:
        base = server.url.removesuffix("/v1")
        async with session.post(f"{base}/update_weight_version", json={"new_version": "ckpt-3"}) as r:
            assert r.status == 200
        async with session.post(f"{base}/update_weight_version", json={"new_version": 3}) as r:
            assert r.status == 400
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "return_token_ids": True,
                "logprobs": True, "return_weight_versions": True}  # fmt: skip
        async with session.post(f"{server.url}/chat/completions", json=body) as r:
            choice = (await r.json())["choices"][0]
    assert choice["weight_versions"] == [{"version": "ckpt-3", "start": 0, "end": len(choice["token_ids"])}]


def test_a_workers_record_with_a_forged_sampled_with_is_bad_payload() -> None:
    rec = TurnEncoder().encode(1, ServedTokens([1], [3], [-1.0]), None, {}, {"temperature": 0.7}).model_dump()
    assert TurnDecoder().decode(rec)["sampled_with"] == {"temperature": 0.7}
    for forged in ({"temperature": "hot"}, {"temperature_source": "trust me"}, {"note": "x" * 10_000}):
        assert TurnDecoder().decode({**rec, "sampled_with": forged})["untrainable_reason"] == "bad_payload"


def test_root_turns_are_asked_and_read_with_the_hosts_api_and_a_missing_field_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from rlmq.common.schemas import DatasetRow
    from rlmq.common.settings import RolloutOptions
    from rlmq.common.token_servers import TokenFieldsLog
    from rlmq.producer.rollout import Rollout
    from rlmq.producer.root_tokens import ask_for_tokens, root_turn_tokens

    caplog.set_level(logging.WARNING, logger="rlmq.model")
    log = TokenFieldsLog()  # the host's: one for all its rollouts
    rollouts = [
        Rollout(id=f"r{i}", row=DatasetRow(id="1", question="q", context="c"), model="m", sub_model="m", queue="q",
                options=RolloutOptions(include_sub_llm_in_trajectory=True), token_api=SGLANG, token_fields_log=log)
        for i in range(2)
    ]  # fmt: skip
    kwargs = ask_for_tokens(rollouts[0], {"model": "m", "messages": [], "extra_body": {"top_p": 0.5}})
    assert kwargs["extra_body"] == {"top_p": 0.5, **SGLANG.request_fields()}
    lp = {"content": [{"logprob": -0.5}]}
    now = {"choices": [{"prompt_token_ids": [1, 2], "response_token_ids": [3], "logprobs": lp}]}
    old = {"choices": [{"prompt_token_ids": [1, 2], "token_ids": [3], "logprobs": lp}]}
    rollouts[0].stats.root_turns = 1
    record = root_turn_tokens(rollouts[0], now, kwargs, (2, 1))
    assert record is not None and record["untrainable"] is None
    assert record["sampling"] == {"top_p": 0.5} and record["sampled_with"]["top_p_source"] == "request"
    for ro in rollouts:
        ro.stats.root_turns = 1
        bad = root_turn_tokens(ro, old, kwargs, (2, 1))
        assert bad is not None and bad["untrainable"] == "no_token_ids"
    assert len([r for r in caplog.records if "token fields of sglang" in r.getMessage()]) == 1


async def test_a_vllm_without_weight_versions_keeps_its_turns_trainable_and_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="rlmq.model")
    async with ScriptedModelServer() as server:
        async with ChatClient(server.url, retries=0, token_api=VERSIONS) as client:
            prompts = [f"say hi {i} [[mock:token-ids:vllm-no-weight-versions]]" for i in range(2)]
            results = [await call(client, request(p)) for p in prompts]
    assert all(steps(r)[0]["trainable"] and "weight_versions" not in steps(r)[0] for r in results)
    assert len([r for r in caplog.records if "without weight_versions" in r.getMessage()]) == 1
