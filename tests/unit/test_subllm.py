"""One sub-LLM job on a worker: model client, retries, budget, tool loop (fakeredis + a scripted model).

The OpenAI-compatible model here is scripted per test and reached through the model
client's transport seam (:class:`~rlmq.workers.model.Transport`), so no HTTP server runs:
each request pops the next step of its script (an answer, a tool call, an HTTP error, a
raw body, a hang that lasts until the client's timeout). It honours ``max_tokens``
(completion tokens = min(scripted, max_tokens)) and counts calls and tokens per ``user``.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import fakeredis.aioredis
import pytest

from rlmq.common.budget.calls import Settle
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.errors import ConfigError, ModelError, PayloadError
from rlmq.common.keys import RolloutKeys
from rlmq.common.schemas import SubLLMRequest
from rlmq.workers.model import ChatClient, HttpReply
from rlmq.workers.subllm import SubLLMContext, run_sub_llm
from rlmq.workers.tools import ToolRegistry, count_words, grep

ROLLOUT = "r1"
TOOLS = ["rlmq.workers.tools.count_words", "rlmq.workers.tools:grep"]

# --------------------------------------------------------------------------- scripted server


def answer(content: str | None, tokens: int = 10, *, usage: bool = True) -> dict[str, Any]:
    return {"kind": "answer", "content": content, "tokens": tokens, "usage": usage}


def tool_call(name: str, arguments: dict[str, Any], tokens: int = 10, content: str | None = None) -> dict[str, Any]:
    return {
        "kind": "answer",
        "content": content,
        "tokens": tokens,
        "usage": True,
        "tool_calls": [{"name": name, "arguments": json.dumps(arguments)}],
    }


def http(status: int, headers: dict[str, str] | None = None, body: str = "") -> dict[str, Any]:
    return {"kind": "http", "status": status, "headers": headers or {}, "body": body}


def raw(body: str) -> dict[str, Any]:
    return {"kind": "raw", "body": body}


def hang() -> dict[str, Any]:
    return {"kind": "hang"}


@dataclass
class ScriptedLLM:
    base_url: str = ""
    script: list[dict[str, Any]] = field(default_factory=list)
    default: dict[str, Any] = field(default_factory=lambda: answer("default answer"))
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    tokens_by_user: dict[str, int] = field(default_factory=dict)
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def calls(self) -> int:
        return len(self.requests)

    def client(self, api_key: str | None = None, **kw: Any) -> ChatClient:
        """A model client whose transport is this scripted model."""
        return ChatClient(self.base_url, api_key, transport=self, **kw)

    async def post(self, url: str, data: bytes, *, headers: Mapping[str, str], timeout: float) -> HttpReply:
        """The :class:`~rlmq.workers.model.Transport` side: one request, one scripted reply."""
        assert url == self.base_url + "/chat/completions"
        body = json.loads(data)
        self.requests.append(body)
        self.headers.append(dict(headers))
        self.arrivals.append(time.monotonic())
        step = self.script.pop(0) if self.script else self.default
        if step["kind"] == "http":
            return HttpReply(step["status"], step["headers"], step["body"].encode())
        if step["kind"] == "raw":
            return HttpReply(200, {"Content-Type": "application/json"}, step["body"].encode())
        if step["kind"] == "hang":  # as a real transport: no reply within the timeout is a TimeoutError
            self.entered.set()
            await asyncio.wait_for(self.release.wait(), timeout)
            return HttpReply(503, {}, b"")
        cap = body.get("max_tokens")
        tokens = min(step["tokens"], cap) if cap is not None else step["tokens"]
        user = body.get("user", "")
        self.tokens_by_user[user] = self.tokens_by_user.get(user, 0) + tokens
        message: dict[str, Any] = {"role": "assistant", "content": step["content"]}
        calls = step.get("tool_calls")
        if calls:
            message["tool_calls"] = [
                {"id": f"call_{self.calls}_{i}", "type": "function", "function": c} for i, c in enumerate(calls)
            ]
        finish = "tool_calls" if calls else ("length" if tokens < step["tokens"] else "stop")
        out: dict[str, Any] = {
            "id": f"chatcmpl-{self.calls}",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        }
        if step["usage"]:
            prompt = sum(len(str(m.get("content") or "")) for m in body["messages"])
            out["usage"] = {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}
        return HttpReply(200, {"Content-Type": "application/json"}, json.dumps(out).encode())

    async def close(self) -> None:
        """Nothing to close: no connection was opened."""


@pytest.fixture
async def llm() -> AsyncIterator[ScriptedLLM]:
    scripted = ScriptedLLM(base_url="http://scripted-model.test/v1")
    yield scripted
    scripted.release.set()


@pytest.fixture
async def client(llm: ScriptedLLM) -> AsyncIterator[ChatClient]:
    async with llm.client("sk-test", retries=2, backoff_base=0.001, backoff_max=0.05) as c:
        yield c


@pytest.fixture
async def redis() -> AsyncIterator[fakeredis.aioredis.FakeRedis]:
    # redis-py's asyncio pool allows 100 connections by default and then raises "Too many
    # connections"; a worker with hundreds of sub-calls in flight needs a larger pool.
    r = fakeredis.aioredis.FakeRedis(max_connections=1024)
    yield r
    await r.aclose()


@pytest.fixture
def ledger(redis: fakeredis.aioredis.FakeRedis) -> BudgetLedger:
    return BudgetLedger(redis)


@pytest.fixture
def ctx(client: ChatClient, ledger: BudgetLedger) -> SubLLMContext:
    return SubLLMContext(client=client, ledger=ledger, tools=ToolRegistry.from_paths(TOOLS), worker_name="w-test")


def make_request(**kw: Any) -> SubLLMRequest:
    now = time.time()
    values: dict[str, Any] = {
        "rollout_id": ROLLOUT,
        "batch_id": "b1",
        "index": 0,
        "prompt": "What is in the text?",
        "model": "sub-model",
        "enqueued_at": now - 0.5,
        "deadline": now + 30,
    }
    values.update(kw)
    return SubLLMRequest(**values)


# --------------------------------------------------------------------------- plain calls


async def test_plain_answer(llm: ScriptedLLM, ctx: SubLLMContext) -> None:
    llm.script = [answer("forty-two", tokens=7)]
    req = make_request(system_prompt="Be brief.", temperature=0.2)
    result = await run_sub_llm(req, ctx, job_id="r1-b1-0", started_at=req.enqueued_at + 0.25)
    assert result.status == "ok"
    assert result.content == "forty-two"
    assert (result.turns, result.tool_calls, result.grants, result.completion_tokens) == (1, 0, 0, 7)
    assert result.error is None and result.error_kind is None
    assert result.worker == "w-test" and result.job_id == "r1-b1-0" and result.attempt == 1
    assert result.queue_wait_seconds == pytest.approx(0.25)
    assert 0 < result.seconds < 5
    assert result.messages is None
    sent = llm.requests[0]
    assert sent["model"] == "sub-model"
    assert sent["user"] == ROLLOUT
    assert sent["temperature"] == 0.2
    assert "max_tokens" not in sent and "max_completion_tokens" not in sent and "tools" not in sent
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is in the text?"},
    ]
    assert llm.headers[0]["Authorization"] == "Bearer sk-test"
    assert llm.headers[0]["Content-Type"].startswith("application/json")


async def test_unbudgeted_without_ledger_sends_the_cap(llm: ScriptedLLM, client: ChatClient) -> None:
    ctx = SubLLMContext(client=client, ledger=None, tools=ToolRegistry(), worker_name="w")
    llm.script = [answer("fine", tokens=500)]
    result = await run_sub_llm(make_request(max_completion_tokens=64), ctx, job_id="j")
    assert result.status == "ok"
    assert llm.requests[0]["max_tokens"] == 64
    assert result.completion_tokens == 64


async def test_usage_totals_over_turns(llm: ScriptedLLM, ctx: SubLLMContext) -> None:
    llm.script = [tool_call("count_words", {"text": "a b c"}, tokens=12), answer("three", tokens=5)]
    request = make_request(sub_tools=["rlmq.workers.tools.count_words"], include_sub_llm_in_trajectory=True)
    result = await run_sub_llm(request, ctx, job_id="j")
    assert result.status == "ok" and result.content == "three"
    assert result.turns == 2 and result.tool_calls == 1
    assert result.completion_tokens == 17
    expected_prompt = sum(sum(len(str(m.get("content") or "")) for m in body["messages"]) for body in llm.requests)
    assert result.prompt_tokens == expected_prompt > 0
    assert result.messages is not None
    assert [m["role"] for m in result.messages] == ["user", "assistant", "tool", "assistant"]
    assert result.messages[-1]["content"] == "three"


# --------------------------------------------------------------------------- budget


async def test_grant_is_min_of_cap_and_remaining(llm: ScriptedLLM, ctx: SubLLMContext, ledger: BudgetLedger) -> None:
    await ledger.open(ROLLOUT, 100)
    llm.script = [answer("one", tokens=50), answer("two", tokens=60)]
    req = make_request(budgeted=True, max_completion_tokens=60)
    first = await run_sub_llm(req, ctx, job_id="r1-b1-0")
    second = await run_sub_llm(req.model_copy(update={"index": 1}), ctx, job_id="r1-b1-1")
    assert [r["max_tokens"] for r in llm.requests] == [60, 50]
    assert (first.grants, first.granted_tokens, first.released_tokens, first.completion_tokens) == (1, 60, 10, 50)
    assert (second.grants, second.granted_tokens, second.released_tokens, second.completion_tokens) == (1, 50, 0, 50)
    snap = await ledger.snapshot(ROLLOUT)
    assert snap is not None
    assert (snap.charged, snap.used, snap.grants, snap.released) == (100, 100, 2, 10)
    assert llm.tokens_by_user[ROLLOUT] == 100  # the server never returned more than the budget


async def test_rejected_on_first_turn(llm: ScriptedLLM, ctx: SubLLMContext, ledger: BudgetLedger) -> None:
    await ledger.open(ROLLOUT, 30)
    llm.script = [answer("spent it", tokens=30)]
    req = make_request(budgeted=True, max_completion_tokens=100)
    assert (await run_sub_llm(req, ctx, job_id="j0")).status == "ok"
    result = await run_sub_llm(req, ctx, job_id="j1")
    assert result.status == "rejected"
    assert result.content == "[rejected] sub-LLM token budget spent: 30/30 completion tokens used"
    assert (result.turns, result.grants, result.completion_tokens) == (0, 0, 0)
    assert llm.calls == 1
    snap = await ledger.snapshot(ROLLOUT)
    assert snap is not None and snap.rejections == 1


async def test_budget_runs_out_mid_loop_keeps_best_answer(
    llm: ScriptedLLM, ctx: SubLLMContext, ledger: BudgetLedger
) -> None:
    await ledger.open(ROLLOUT, 100)
    llm.script = [
        tool_call("count_words", {"text": "x y"}, tokens=60, content="Partial: two words so far."),
        tool_call("count_words", {"text": "x y z"}, tokens=60),
        answer("never asked for", tokens=5),
    ]
    req = make_request(
        budgeted=True, max_completion_tokens=60, max_turns=5, sub_tools=["rlmq.workers.tools.count_words"]
    )
    result = await run_sub_llm(req, ctx, job_id="j")
    assert result.status == "ok"
    assert result.content == "Partial: two words so far."
    assert llm.calls == 2  # no unbudgeted final call
    assert [r["max_tokens"] for r in llm.requests] == [60, 40]
    assert (result.turns, result.tool_calls, result.grants, result.granted_tokens) == (2, 2, 2, 100)
    snap = await ledger.snapshot(ROLLOUT)
    assert snap is not None and (snap.charged, snap.used, snap.overrun) == (100, 100, 0)


async def test_budget_runs_out_mid_loop_without_text_is_rejected(
    llm: ScriptedLLM, ctx: SubLLMContext, ledger: BudgetLedger
) -> None:
    await ledger.open(ROLLOUT, 50)
    llm.script = [tool_call("count_words", {"text": "x"}, tokens=50)]
    req = make_request(budgeted=True, max_completion_tokens=50, sub_tools=["rlmq.workers.tools.count_words"])
    result = await run_sub_llm(req, ctx, job_id="j")
    assert result.status == "rejected"
    assert "ran out before a final answer: 50/50" in result.content
    assert llm.calls == 1


async def test_no_usage_charges_the_whole_grant(llm: ScriptedLLM, ctx: SubLLMContext, ledger: BudgetLedger) -> None:
    await ledger.open(ROLLOUT, 100)
    llm.script = [answer("x" * 20, tokens=5, usage=False)]
    result = await run_sub_llm(make_request(budgeted=True, max_completion_tokens=40), ctx, job_id="j")
    assert result.status == "ok"
    assert result.completion_tokens == math.ceil(20 / 4)  # the estimate is reported...
    assert result.released_tokens == 0
    snap = await ledger.snapshot(ROLLOUT)
    assert snap is not None and (snap.charged, snap.used) == (40, 40)  # ...but the whole grant is charged


async def test_budget_ledger_missing(llm: ScriptedLLM, ctx: SubLLMContext) -> None:
    result = await run_sub_llm(make_request(budgeted=True, max_completion_tokens=40), ctx, job_id="j")
    assert (result.status, result.error_kind) == ("error", "budget_lost")
    assert llm.calls == 0


async def test_retried_attempt_takes_new_reservations(
    llm: ScriptedLLM, ctx: SubLLMContext, ledger: BudgetLedger, redis: fakeredis.aioredis.FakeRedis
) -> None:
    await ledger.open(ROLLOUT, 100)
    req = make_request(budgeted=True, max_completion_tokens=30)
    # Attempt 1: the worker "dies" mid-call (its task is cancelled while the server hangs).
    llm.script = [hang(), answer("second try", tokens=10)]
    first = asyncio.create_task(run_sub_llm(req, ctx, job_id="r1-b1-0", attempt=1))
    await llm.entered.wait()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    # Attempt 2 reserves under new ids; attempt 1's open reservation stays charged in full.
    result = await run_sub_llm(req, ctx, job_id="r1-b1-0", attempt=2)
    assert result.status == "ok" and result.attempt == 2
    assert llm.requests[1]["max_tokens"] == 30
    snap = await ledger.snapshot(ROLLOUT)
    assert snap is not None and snap.charged == 30 + 10
    resv = await redis.hgetall(RolloutKeys(ROLLOUT).reservations)
    assert resv == {b"r1-b1-0:1:1": b"open:30", b"r1-b1-0:2:1": b"settled:10"}
    # Reserving an open id again is idempotent: same grant, nothing more charged.
    again = await ledger.reserve(ROLLOUT, "r1-b1-0:1:1", 30)
    assert (again.tokens, again.charged) == (30, 40)
    # A redelivered copy of the settled attempt 2 is refused without calling the model.
    dup = await run_sub_llm(req, ctx, job_id="r1-b1-0", attempt=2)
    assert (dup.status, dup.error_kind) == ("error", "duplicate")
    assert llm.calls == 2


# --------------------------------------------------------------------------- tools


async def test_final_settlement_can_be_deferred_to_the_caller(
    llm: ScriptedLLM, ctx: SubLLMContext, ledger: BudgetLedger
) -> None:
    """With ``settle_out`` the last turn's settlement is handed back (the worker sends it with
    FINISH); until then the grant stays charged in full, and turns before it settle at once."""
    await ledger.open(ROLLOUT, 100)
    llm.script = [tool_call("count_words", {"text": "a b"}, tokens=5), answer("done", tokens=7)]
    req = make_request(
        budgeted=True, max_completion_tokens=40, sub_tools=["rlmq.workers.tools.count_words"], max_turns=3
    )
    out: list[Settle] = []
    result = await run_sub_llm(req, ctx, job_id="j", settle_out=out)
    assert result.status == "ok" and result.content == "done"
    assert out == [Settle(ROLLOUT, "j:1:2", 7)]  # a turn offering tools is no answer in segments
    assert (result.granted_tokens, result.released_tokens) == (80, 35 + 33)
    snap = await ledger.snapshot(ROLLOUT)
    assert snap is not None and (snap.charged, snap.used) == (5 + 40, 5)  # turn 1 settled, turn 2 held in full
    settled = await ledger.settle(*out[0][:3])
    assert settled.released == 33
    snap = await ledger.snapshot(ROLLOUT)
    assert snap is not None and (snap.charged, snap.used) == (12, 12)


async def test_gate_holds_the_first_model_call_after_the_reservation(
    llm: ScriptedLLM, ctx: SubLLMContext, ledger: BudgetLedger
) -> None:
    """A worker that starts a job before its START answered passes the answer as ``gate``:
    the reservation goes ahead, the model call waits; cancelled at the gate, no call at all."""
    await ledger.open(ROLLOUT, 100)
    req = make_request(budgeted=True, max_completion_tokens=40)
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_sub_llm(req, ctx, job_id="j", gate=gate))

    async def reserved() -> bool:
        snap = await ledger.snapshot(ROLLOUT)
        return snap is not None and snap.grants == 1

    deadline = time.monotonic() + 10
    while not await reserved():
        if task.done() or time.monotonic() > deadline:  # fail, never hang the suite
            pytest.fail(f"the sub-call did not reserve within 10 s (done: {task.done()})")
        await asyncio.sleep(0)  # yield to the sub-call until its reservation is in the ledger
    assert llm.calls == 0
    gate.set_result(None)
    result = await task
    assert result.status == "ok" and llm.calls == 1

    lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_sub_llm(make_request(), ctx, job_id="k", gate=lost))
    for _ in range(50):
        await asyncio.sleep(0)  # let it run up to the gate
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert llm.calls == 1


async def test_tool_loop_with_allowed_tool(llm: ScriptedLLM, ctx: SubLLMContext) -> None:
    llm.script = [
        tool_call("grep", {"text": "alpha\nbeta\nalphabet", "pattern": "^alpha"}),
        answer("Lines 1 and 3."),
    ]
    req = make_request(sub_tools=["rlmq.workers.tools.count_words", "rlmq.workers.tools.grep"], max_turns=3)
    result = await run_sub_llm(req, ctx, job_id="j")
    assert result.status == "ok" and result.content == "Lines 1 and 3."
    assert (result.turns, result.tool_calls) == (2, 1)
    offered = [t["function"]["name"] for t in llm.requests[0]["tools"]]
    assert offered == ["count_words", "grep"]
    tool_msg = llm.requests[1]["messages"][-1]
    assert tool_msg == {"role": "tool", "tool_call_id": "call_1_0", "content": "1: alpha\n3: alphabet"}
    assert llm.requests[1]["messages"][-2]["tool_calls"][0]["function"]["name"] == "grep"


async def test_without_the_final_answer_turn_tool_calls_on_last_turn_end_the_loop(
    llm: ScriptedLLM, ctx: SubLLMContext
) -> None:
    llm.script = [tool_call("count_words", {"text": "a"}), tool_call("count_words", {"text": "b"})]
    req = make_request(sub_tools=["rlmq.workers.tools.count_words"], max_turns=2, final_answer_turn=False)
    result = await run_sub_llm(req, ctx, job_id="j")
    assert result.status == "ok"
    assert "used all 2 turn(s)" in result.content
    assert llm.calls == 2 and result.tool_calls == 1 and result.final_turn is None


async def test_at_the_turn_limit_a_final_answer_turn_without_tools_follows(
    llm: ScriptedLLM, ctx: SubLLMContext
) -> None:
    llm.script = [tool_call("count_words", {"text": "a"}), tool_call("count_words", {"text": "b c"}), answer("2")]
    req = make_request(sub_tools=["rlmq.workers.tools.count_words"], max_turns=2)
    result = await run_sub_llm(req, ctx, job_id="j")
    assert (result.status, result.content, result.final_turn) == ("ok", "2", "answered")
    assert llm.calls == 3 and result.tool_calls == 2 and result.turns == 3
    last = llm.requests[2]
    assert not last.get("tools")  # no tools offered in the final turn
    assert last["messages"][-2] == {"role": "tool", "tool_call_id": "call_2_0", "content": "2"}
    assert last["messages"][-1]["role"] == "user" and "final answer" in last["messages"][-1]["content"]


async def test_model_calling_a_tool_not_offered_gets_a_tool_error(llm: ScriptedLLM, ctx: SubLLMContext) -> None:
    llm.script = [tool_call("grep", {"text": "a", "pattern": "a"}), answer("ok")]
    req = make_request(sub_tools=["rlmq.workers.tools.count_words"])
    result = await run_sub_llm(req, ctx, job_id="j")
    assert result.status == "ok"
    assert llm.requests[1]["messages"][-1]["content"].startswith("[tool error] unknown tool 'grep'")


async def test_disallowed_tool_is_a_payload_error(llm: ScriptedLLM, ctx: SubLLMContext) -> None:
    req = make_request(sub_tools=["rlmq.workers.tools.count_words", "os.system"])
    result = await run_sub_llm(req, ctx, job_id="j")
    assert (result.status, result.error_kind) == ("error", "payload")
    assert "os.system" in result.content
    assert llm.calls == 0


async def test_tool_registry() -> None:
    reg = ToolRegistry.from_paths(TOOLS)
    assert reg.paths == ["rlmq.workers.tools.count_words", "rlmq.workers.tools.grep"]
    (schema,) = reg.schemas(["rlmq.workers.tools:grep"])
    fn = schema["function"]
    assert schema["type"] == "function" and fn["name"] == "grep"
    assert fn["description"].startswith("Find the lines")
    params = fn["parameters"]
    assert params["required"] == ["text", "pattern"]
    assert params["properties"]["max_lines"]["default"] == 20
    assert params["properties"]["max_lines"]["type"] == "integer"
    assert "regular expression" in params["properties"]["pattern"]["description"]
    assert await reg.call("count_words", '{"text": "one two  three"}') == "3"
    assert await reg.call("rlmq.workers.tools.grep", '{"text": "a\\nb", "pattern": "z"}') == "(no matching lines)"
    bad = await reg.call("count_words", '{"text": 5, "extra": 1}')
    assert bad.startswith("[tool error] count_words: invalid arguments")
    assert (await reg.call("count_words", "{not json")).startswith("[tool error]")
    assert (await reg.call("grep", '{"text": "a", "pattern": "("}')).startswith("[tool error] grep: ValueError")
    assert (await reg.call("nope", "{}")).startswith("[tool error] unknown tool")
    with pytest.raises(PayloadError, match="os.system"):
        reg.check_allowed(["count_words", "os.system"])
    with pytest.raises(ConfigError):
        ToolRegistry.from_paths(["rlmq.workers.tools.no_such_tool"])
    with pytest.raises(ConfigError):
        ToolRegistry.from_paths(["no_such_package_xyz.mod:f"])
    with pytest.raises(ConfigError):
        ToolRegistry.from_paths(["rlmq.common.keys.PREFIX"])  # not callable
    assert count_words("a b") == 2 and grep("x\ny", "y") == "2: y"


async def test_tool_timeout_and_async_tool() -> None:
    reg = ToolRegistry.from_paths(["tests.unit.test_subllm:_slow_async_tool", "tests.unit.test_subllm._echo"])
    assert await reg.call("_echo", '{"value": {"k": [1]}}') == '{"k": [1]}'
    assert await reg.call("_slow_async_tool", '{"seconds": 0}') == "done"
    out = await reg.call("_slow_async_tool", '{"seconds": 10}', timeout=0.05)
    assert out == "[tool error] _slow_async_tool timed out after 0.05 s"


async def _slow_async_tool(seconds: float) -> str:
    """Sleep, then say done."""
    await asyncio.sleep(seconds)
    return "done"


def _echo(value: dict[str, Any]) -> dict[str, Any]:
    """Return the value."""
    return value


# --------------------------------------------------------------------------- retries and errors


async def test_429_with_retry_after_then_success(llm: ScriptedLLM, ledger: BudgetLedger) -> None:
    llm.script = [http(429, {"Retry-After": "0.3"}), answer("after the wait")]
    async with llm.client(retries=3, backoff_base=0.001, backoff_max=5.0) as client:
        ctx = SubLLMContext(client=client, ledger=ledger, tools=ToolRegistry(), worker_name="w")
        result = await run_sub_llm(make_request(), ctx, job_id="j")
        assert client.attempts == 2
    assert result.status == "ok" and result.content == "after the wait"
    assert llm.calls == 2
    assert llm.arrivals[1] - llm.arrivals[0] >= 0.29  # Retry-After honoured, not the 1 ms backoff
    assert "Authorization" not in llm.headers[0]


async def test_retry_after_is_capped_at_backoff_max(llm: ScriptedLLM) -> None:
    llm.script = [http(503, {"Retry-After": "120"}), answer("ok")]
    async with llm.client(retries=1, backoff_base=0.001, backoff_max=0.05) as client:
        t0 = time.monotonic()
        response = await client.chat(model="m", messages=[{"role": "user", "content": "hi"}])
        assert time.monotonic() - t0 < 5
    assert response.content == "ok" and llm.calls == 2


async def test_500_always_is_a_model_error(llm: ScriptedLLM, ctx: SubLLMContext, ledger: BudgetLedger) -> None:
    await ledger.open(ROLLOUT, 100)
    llm.default = http(500, body="engine crashed")
    result = await run_sub_llm(make_request(budgeted=True, max_completion_tokens=40), ctx, job_id="j")
    assert (result.status, result.error_kind) == ("error", "model")
    assert llm.calls == 3  # retries=2
    assert result.content.startswith("[error] sub-LLM call failed: model server answered 500 Internal Server Error")
    assert "after 3 attempts" in result.content and "engine crashed" in result.content
    # The server answered with an error: nothing generated, the grant goes back.
    snap = await ledger.snapshot(ROLLOUT)
    assert snap is not None and (snap.charged, snap.used, snap.released) == (0, 0, 40)
    assert result.released_tokens == 40 and result.grants == 1


async def test_400_is_not_retried(llm: ScriptedLLM, client: ChatClient) -> None:
    llm.default = http(400, body='{"error": "max_tokens too large"}')
    with pytest.raises(ModelError) as info:
        await client.chat(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=10)
    assert info.value.status == 400
    assert "400 Bad Request" in str(info.value) and "max_tokens too large" in str(info.value)
    assert llm.calls == 1


async def test_malformed_json_is_retried(llm: ScriptedLLM, ctx: SubLLMContext) -> None:
    llm.script = [raw("{not json"), raw('{"choices": []}'), answer("finally")]
    result = await run_sub_llm(make_request(), ctx, job_id="j")
    assert result.status == "ok" and result.content == "finally"
    assert llm.calls == 3


async def test_timeout_charges_the_whole_grant(llm: ScriptedLLM, ledger: BudgetLedger) -> None:
    await ledger.open(ROLLOUT, 100)
    llm.default = hang()
    async with llm.client(timeout=0.1, retries=1, backoff_base=0.001) as client:
        ctx = SubLLMContext(client=client, ledger=ledger, tools=ToolRegistry(), worker_name="w")
        result = await run_sub_llm(make_request(budgeted=True, max_completion_tokens=40), ctx, job_id="j")
    assert (result.status, result.error_kind) == ("error", "model")
    assert "timed out" in result.content and "after 2 attempts" in result.content
    snap = await ledger.snapshot(ROLLOUT)
    assert snap is not None and (snap.charged, snap.used) == (40, 40)  # tokens may have been generated


async def test_deadline_already_past(llm: ScriptedLLM, ctx: SubLLMContext, ledger: BudgetLedger) -> None:
    await ledger.open(ROLLOUT, 100)
    req = make_request(budgeted=True, max_completion_tokens=40, deadline=time.time() - 1)
    result = await run_sub_llm(req, ctx, job_id="j")
    assert (result.status, result.error_kind) == ("error", "deadline")
    assert result.content == "[error] sub-LLM call missed its deadline"
    assert llm.calls == 0
    snap = await ledger.snapshot(ROLLOUT)
    assert snap is not None and (snap.charged, snap.grants) == (0, 0)


async def test_retries_never_sleep_past_the_deadline(llm: ScriptedLLM) -> None:
    llm.default = http(503, {"Retry-After": "5"})
    async with llm.client(retries=5, backoff_max=10.0) as client:
        t0 = time.monotonic()
        with pytest.raises(ModelError) as info:
            await client.chat(model="m", messages=[], deadline=time.time() + 1.0)
        assert time.monotonic() - t0 < 1.0
    assert llm.calls == 1 and info.value.status == 503
    assert "deadline" in str(info.value)


async def test_connection_refused_is_a_model_error() -> None:
    async with ChatClient("http://127.0.0.1:9/v1", retries=1, backoff_base=0.001) as client:
        with pytest.raises(ModelError) as info:
            await client.chat(model="m", messages=[])
    assert info.value.status is None and "after 2 attempts" in str(info.value)


async def test_unexpected_exception_is_an_internal_error(llm: ScriptedLLM, ctx: SubLLMContext) -> None:
    class Boom(ChatClient):
        async def chat(self, **kwargs: Any) -> Any:
            raise RuntimeError("boom")

    ctx.client = Boom(llm.base_url)
    result = await run_sub_llm(make_request(), ctx, job_id="j")
    assert (result.status, result.error_kind) == ("error", "internal")
    assert "RuntimeError: boom" in result.content


async def test_parallel_calls_never_exceed_the_budget(
    llm: ScriptedLLM, ctx: SubLLMContext, ledger: BudgetLedger
) -> None:
    await ledger.open(ROLLOUT, 1000)
    llm.default = answer("a", tokens=30)
    req = make_request(budgeted=True, max_completion_tokens=30)
    results = await asyncio.gather(*(run_sub_llm(req, ctx, job_id=f"r1-b1-{i}") for i in range(200)))
    statuses = [r.status for r in results]
    assert statuses.count("ok") == 1000 // 30 + 1  # 33 full grants and one of 10 tokens
    assert statuses.count("rejected") == 200 - statuses.count("ok")
    assert llm.tokens_by_user[ROLLOUT] == 1000
    snap = await ledger.snapshot(ROLLOUT)
    assert snap is not None and (snap.charged, snap.used, snap.overrun) == (1000, 1000, 0)


async def test_a_job_claiming_unbudgeted_gets_its_ledgers_rules(
    llm: ScriptedLLM, ctx: SubLLMContext, ledger: BudgetLedger
) -> None:
    await ledger.open(ROLLOUT, 100, cap=40)
    llm.default = answer("long", tokens=500)
    forged = make_request(budgeted=False, max_completion_tokens=10_000)  # the payload lies
    result = await run_sub_llm(forged, ctx, job_id="j0")
    assert llm.requests[0]["max_tokens"] == 40  # the ledger's cap, not the job's
    assert (result.status, result.grants, result.granted_tokens, result.truncated) == ("ok", 1, 40, True)
    for i in range(1, 5):
        await run_sub_llm(forged, ctx, job_id=f"j{i}")
    assert llm.tokens_by_user[ROLLOUT] == 100  # the limit holds
    snap = await ledger.snapshot(ROLLOUT)
    assert snap is not None and (snap.used, snap.rejections) == (100, 2)


async def test_a_rollout_without_a_ledger_runs_unbudgeted_and_is_remembered(
    llm: ScriptedLLM, ctx: SubLLMContext, ledger: BudgetLedger
) -> None:
    llm.default = answer("free", tokens=5)
    result = await run_sub_llm(make_request(max_completion_tokens=64), ctx, job_id="j0")
    assert (result.status, result.grants, result.truncated) == ("ok", 0, False)
    assert llm.requests[0]["max_tokens"] == 64
    assert ledger.known_unbudgeted(ROLLOUT)  # later calls of this rollout skip the check


async def test_a_ledger_lost_mid_call_is_not_a_licence_to_run_unbudgeted(
    llm: ScriptedLLM,
    ctx: SubLLMContext,
    ledger: BudgetLedger,
    redis: fakeredis.aioredis.FakeRedis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await ledger.open(ROLLOUT, 1000, cap=50)
    llm.script = [tool_call("count_words", {"text": "a b"}, tokens=5), answer("done", tokens=5)]
    chat = ctx.client.chat

    async def chat_then_lose_the_ledger(**kw: Any) -> Any:
        response = await chat(**kw)
        await redis.delete(RolloutKeys(ROLLOUT).budget)  # Redis restarted without persistence
        return response

    monkeypatch.setattr(ctx.client, "chat", chat_then_lose_the_ledger)
    req = make_request(budgeted=False, sub_tools=["rlmq.workers.tools.count_words"])  # the job says "no budget"
    result = await run_sub_llm(req, ctx, job_id="j")
    assert (result.status, result.error_kind, llm.calls) == ("error", "budget_lost", 1)
    assert not await redis.exists(RolloutKeys(ROLLOUT).budget)  # the settlement did not re-create it


def test_retry_after_parsing() -> None:
    from email.utils import formatdate

    from rlmq.workers.model import _parse_retry_after

    assert _parse_retry_after("2") == 2.0
    assert _parse_retry_after(" 0.5 ") == 0.5
    assert _parse_retry_after(None) is None and _parse_retry_after("soon") is None
    in_a_minute = _parse_retry_after(formatdate(time.time() + 60, usegmt=True))
    assert in_a_minute is not None and 55 < in_a_minute <= 60
    assert _parse_retry_after(formatdate(time.time() - 60, usegmt=True)) == 0.0


async def test_a_call_charges_the_ledger_its_job_names(
    llm: ScriptedLLM, ctx: SubLLMContext, ledger: BudgetLedger
) -> None:
    """A job carries its ledger's id (a tree's ledger: not its rollout's); a job naming a ledger
    other than its rollout's must find it, whatever ``budgeted`` claims (never "unbudgeted")."""
    await ledger.open("tree", 100, cap=40)
    for node in ("tree", ROLLOUT):
        await ledger.open_node("tree", node)
    llm.script = [answer("from a child", tokens=7)]
    chain = ["tree", ROLLOUT]
    result = await run_sub_llm(make_request(ledger_id="tree", nodes=chain), ctx, job_id="j1")  # claims budgeted=False
    assert (result.status, result.completion_tokens, result.grants) == ("ok", 7, 1)
    snap = await ledger.snapshot("tree")
    assert snap is not None and (snap.charged, snap.used) == (7, 7)
    assert await ledger.snapshot(ROLLOUT) is None
    lost = await run_sub_llm(make_request(ledger_id="no-such-tree", nodes=chain), ctx, job_id="j2")
    assert (lost.status, lost.error_kind, llm.calls) == ("error", "budget_lost", 1)


async def test_a_job_naming_another_ledger_must_be_a_live_node_of_its_tree(
    llm: ScriptedLLM, ctx: SubLLMContext, ledger: BudgetLedger
) -> None:
    """Tree membership: a job whose ledger is not its rollout's carries a chain ending with its own
    rollout id, and that node must be alive in that ledger; otherwise no reservation, no call."""
    await ledger.open("tree", 100, cap=40)
    await ledger.open_node("tree", "tree")
    llm.script = [answer("never", tokens=7)] * 4
    for bad in ([], ["tree"], ["tree", "someone-else"]):  # no chain, or one not ending with its rollout
        forged = await run_sub_llm(make_request(ledger_id="tree", nodes=bad), ctx, job_id="j1")
        assert (forged.status, forged.error_kind) == ("error", "payload"), bad
        assert "node chain must end with its rollout" in (forged.error or forged.content or "")
    # the chain ends with its rollout, but that node is not alive in the ledger: refused by the script
    stranger = await run_sub_llm(make_request(ledger_id="tree", nodes=["tree", ROLLOUT]), ctx, job_id="j2")
    assert stranger.status == "rejected" and stranger.content.startswith("[rejected] sub-LLM call refused: parent_gone")
    assert ROLLOUT in stranger.content
    assert llm.calls == 0
    snap = await ledger.snapshot("tree")
    assert snap is not None and snap.charged == 0


async def test_tree_refusals_name_their_reason(llm: ScriptedLLM, ctx: SubLLMContext, ledger: BudgetLedger) -> None:
    """A closed tree (the top ended) refuses its calls with or without a chain; a liveness-only
    ledger (a tree without a budget) serves a live chain without a grant."""
    await ledger.open_unlimited("tree", ttl=60)
    for node in ("tree", ROLLOUT):
        await ledger.open_node("tree", node)
    llm.script = [answer("child answer", tokens=9)]
    ok = await run_sub_llm(make_request(ledger_id="tree", nodes=["tree", ROLLOUT]), ctx, job_id="j1")
    assert (ok.status, ok.content, ok.grants) == ("ok", "child answer", 0)
    assert "max_tokens" not in llm.requests[-1]  # no grant: the job's own cap (none here)
    await ledger.close("tree", top_node="tree")
    child = await run_sub_llm(make_request(ledger_id="tree", nodes=["tree", ROLLOUT]), ctx, job_id="j2")
    assert child.status == "rejected" and child.content.startswith("[rejected] sub-LLM call refused: tree_closed")
    top = await run_sub_llm(make_request(rollout_id="tree", budgeted=True), ctx, job_id="j3")
    assert top.status == "rejected" and "tree_closed" in top.content
    assert llm.calls == 1
