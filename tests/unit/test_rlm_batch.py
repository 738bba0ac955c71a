"""``rlm_batch`` on fakeredis and in-process: the scaffold per depth, the child-rollout
jobs the dispatcher writes, the service's results, event and stats, the interception route's
refusals and the REPL global's validation."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import fakeredis
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from rq.job import Job
from rq.serializers import JSONSerializer

from rlmq.common import keys as K
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.jobs.record import CHILD_ROLLOUT_FUNC, decode_job_data
from rlmq.common.schemas import ChildOutcome, ChildRolloutRequest, DatasetRow, RlmTask, SubLLMResult
from rlmq.common.settings import RolloutOptions
from rlmq.common.tree import TreePosition
from rlmq.producer.budget import LEDGER_LOST, RolloutBudget
from rlmq.producer.child_trajectory import KeptChildren, json_chars
from rlmq.producer.dispatch import Dispatcher
from rlmq.producer.engine import RolloutHost, run_rollout
from rlmq.producer.interception import InterceptionServer
from rlmq.producer.llm_batch import LlmBatchService
from rlmq.producer.repl import Repl
from rlmq.producer.rlm_batch import RENDERED_CONTEXT_CHARS, TREE_CLOSED, RlmBatchService, render_task
from rlmq.producer.rollout import Rollout
from rlmq.producer.scaffold import root_system_prompt
from rlmq.producer.tree_metrics import tree_metrics
from rlmq.scripted.recursion import Recursion, recursion_of, scaffold_line
from tests.root_fakes import FakeInterception, FakeRepl, FakeRoot, code_turn, fake_repl_factory

QUEUE = "rlmq.sub.m"


# --------------------------------------------------------------------------- scaffold per depth


def test_scaffold_says_nothing_of_rlm_batch_at_max_depth_1() -> None:
    assert root_system_prompt("ctx", max_depth=1) == root_system_prompt("ctx")
    assert "rlm_batch" not in root_system_prompt("ctx", verbosity="heavy", max_depth=1)


def test_scaffold_per_depth() -> None:
    top = root_system_prompt("ctx", depth=1, max_depth=3)
    assert "rlm_batch(tasks: list) -> list[str]" in top and "child RLM" in top and "depth 1 of 3" in top
    assert "go 1 level(s) deeper" in top
    deepest = root_system_prompt("ctx", depth=3, max_depth=3)
    assert "your rlm_batch runs plain sub-LLM calls" in deepest and "child RLM" not in deepest
    # the line the scripted model decides recursion by (rlmq.scripted.recursion)
    assert scaffold_line(1, 3) in top.splitlines() and scaffold_line(3, 3) in deepest.splitlines()
    assert recursion_of(top) == Recursion(True, 1, 3) and recursion_of(deepest) == Recursion(False, 3, 3)
    assert recursion_of(root_system_prompt("ctx", depth=2, max_depth=3)) == Recursion(True, 2, 3)
    assert recursion_of(root_system_prompt("ctx")) == Recursion(False)
    assert "llm_batch(prompts" in top and "llm_batch(prompts" in deepest  # llm_batch is unchanged


def test_render_task_puts_the_context_after_the_prompt_bounded() -> None:
    assert render_task(RlmTask(prompt="q")) == "q"
    assert render_task(RlmTask(prompt="q", context="abc")) == "q\n\nContext:\nabc"
    assert render_task(RlmTask(prompt="q", context={"k": [1, "ä"]})) == 'q\n\nContext:\n{"k": [1, "ä"]}'
    long = render_task(RlmTask(prompt="q", context="x" * (RENDERED_CONTEXT_CHARS + 10)))
    assert long.endswith(
        f"[... context cut at {RENDERED_CONTEXT_CHARS:,} of {RENDERED_CONTEXT_CHARS + 10:,} characters]"
    )


# --------------------------------------------------------------------------- the service on fakeredis


def rollout(rid: str = "par1", **options: Any) -> Rollout:
    return Rollout(
        id=rid, row=DatasetRow(id="row", question="q", context="c"), model="root-m", sub_model="m",
        queue=QUEUE, options=RolloutOptions(**options),
    )  # fmt: skip


async def open_tree(r: Any, ledger: str, *nodes: str) -> None:
    """The tree's node keys, as the hosts of its open rollouts keep them."""
    for n in nodes:
        await r.set(K.LedgerKeys(ledger).node(n), 1)


async def child_host(r: Any, queue: str, seen: list[ChildRolloutRequest], n: int) -> None:
    """A stand-in REPL host: pops ``n`` child-rollout jobs and answers each with a child outcome."""
    for _ in range(n):
        got = await r.blpop([K.rq_queue(queue)], timeout=5)
        assert got is not None, "no child-rollout job was enqueued"
        jid = got[1].decode()
        func, args, _ = decode_job_data(await r.hget(K.rq_job(jid), "data"))
        assert func == CHILD_ROLLOUT_FUNC
        req = ChildRolloutRequest.model_validate(args[0])
        seen.append(req)
        child = ChildOutcome(
            rollout_id=f"{req.child_id}-1", depth=req.depth, stop_reason="answer_ready",
            metrics={"main_rlm_turns": 2, "sub_llm_call_count": req.index},
            trajectory=[{"type": "turn", "n": 1}],
        )  # fmt: skip
        res = SubLLMResult(
            rollout_id=req.rollout_id, batch_id=req.batch_id, index=req.index, job_id=jid, status="ok",
            content=f"child says {req.prompt} / {json.dumps(req.context)}", turns=2, child=child,
        )  # fmt: skip
        reply = (await r.hget(K.rq_job(jid), "rlmq_reply")).decode()
        await r.xadd(reply, {K.REPLY_FIELD: res.model_dump_json()})


async def test_children_below_the_depth_limit() -> None:
    server = fakeredis.FakeServer()
    r = fakeredis.aioredis.FakeRedis(server=server)
    service = RlmBatchService(LlmBatchService(Dispatcher(r)))
    ro = rollout(max_depth=3, include_sub_llm_in_trajectory=False)
    tree = TreePosition(ledger_id="top", depth=2, max_depth=3, nodes=("top",), parent_id="top")
    queue = K.child_queue(QUEUE, 3)
    await r.zadd(K.serving(queue), {"host": 1e12})  # a live REPL host serves depth 3
    await open_tree(r, "top", "top", "par1")
    seen: list[ChildRolloutRequest] = []
    host = asyncio.create_task(child_host(r, queue, seen, 2))
    tasks = [RlmTask(prompt="a"), RlmTask(prompt="b", context={"k": [1]})]
    contents, summary = await service.run(ro, tasks, tree, remaining=100.0)
    await host
    assert contents == ["child says a / null", 'child says b / {"k": [1]}']
    assert summary.startswith("rlm_batch: 2 task(s) as child rollouts at depth 3 of 3 in ")
    assert "2 ok, 0 rejected, 0 error" in summary and "stop=answer_ready" in summary
    by_index = sorted(seen, key=lambda q: q.index)
    assert [(q.depth, q.max_depth, q.nodes, q.ledger_id, q.model) for q in by_index] == [
        (3, 3, ["top", "par1"], "top", "m")
    ] * 2
    assert by_index[1].context == {"k": [1]} and by_index[0].context is None
    assert len({q.child_id for q in by_index}) == 2 and all(len(q.child_id) == 32 for q in by_index)
    assert all(99 < q.deadline - q.enqueued_at <= 100 for q in by_index)
    opts = RolloutOptions.model_validate(by_index[0].options)  # the parent's options, JSON, valid
    assert opts.max_depth == 3 and opts.rollout_timeout == 100.0
    sync = fakeredis.FakeRedis(server=server)
    job = Job.fetch("par1-r1-1", connection=sync, serializer=JSONSerializer)
    assert job.description == "child rollout depth=3 parent=par1 index=1 model=m"
    meta = json.loads(sync.hget(K.rq_job("par1-r1-1"), "rlmq_meta"))
    assert meta["depth"] == 3 and meta["parent"] == "par1" and meta["index"] == 1
    assert sync.llen(K.lane(queue)) == 0  # no lane entry: lanes carry sub-LLM requests
    (event,) = ro.trajectory
    assert set(event) == {"type", "batch_id", "seconds", "tasks", "results"}
    assert (event["type"], event["batch_id"], event["tasks"]) == ("rlm_batch", "r1", ["a", "b"])
    assert event["results"][1]["child"]["trajectory"] == [{"type": "turn", "n": 1}]
    own = ro.stats.metrics()
    m = tree_metrics(ro.trajectory, own, depth=2, max_depth=3)  # the event is what the tree figures read
    assert m["rlm_call_count"] == 2 and m["depth3_rollouts"] == 2 and m["depth3_root_turns"] == 4
    assert own["sub_llm_call_count"] == 0


async def test_a_parent_keeps_child_trajectories_only_within_its_allowance() -> None:
    """A parent that calls rlm_batch again and again: its trajectory stops growing with its
    children's trajectories once its allowance is spent; answers and metrics still arrive."""
    server = fakeredis.FakeServer()
    r = fakeredis.aioredis.FakeRedis(server=server)
    service = RlmBatchService(LlmBatchService(Dispatcher(r)))
    ro = rollout(max_depth=3, include_sub_llm_in_trajectory=False)
    ro.kept_children = KeptChildren(max_chars=json_chars([{"type": "turn", "n": 1}]) * 3)
    tree = TreePosition(ledger_id="top", depth=2, max_depth=3, nodes=("top",), parent_id="top")
    queue = K.child_queue(QUEUE, 3)
    await r.zadd(K.serving(queue), {"host": 1e12})
    await open_tree(r, "top", "top", "par1")
    for _ in range(2):
        host = asyncio.create_task(child_host(r, queue, [], 2))
        contents, _ = await service.run(ro, [RlmTask(prompt="a"), RlmTask(prompt="b")], tree, remaining=100.0)
        await host
        assert contents == ["child says a / null", "child says b / null"]
    kept = [res["child"] for ev in ro.trajectory for res in ev["results"]]
    assert [len(c["trajectory"]) for c in kept] == [1, 1, 1, 0]
    assert kept[3]["trajectory_cut"] == 1 and kept[3]["metrics"]["main_rlm_turns"] == 2


async def test_no_host_for_the_children_ends_their_slots_with_no_worker() -> None:
    r = fakeredis.aioredis.FakeRedis()
    service = RlmBatchService(LlmBatchService(Dispatcher(r, no_worker_grace=0.2)))
    ro = rollout()
    await open_tree(r, "par1", "par1")
    contents, _ = await service.run(ro, [RlmTask(prompt="a")], TreePosition("par1", max_depth=2), remaining=30)
    assert contents[0].startswith("[error] child rollout not run: no live worker serves queue rlmq.sub.m+rlm2")
    assert "--repl-slots" in contents[0]
    assert ro.trajectory[0]["results"][0]["error_kind"] == "no_worker"


async def sub_worker(r: Any, seen: list[str], n: int) -> None:
    """A stand-in sub-LLM worker: answers ``n`` sub-call jobs with their prompt's length."""
    for _ in range(n):
        got = await r.blpop([K.rq_queue(QUEUE)], timeout=5)
        assert got is not None
        jid = got[1].decode()
        _, args, _ = decode_job_data(await r.hget(K.rq_job(jid), "data"))
        seen.append(args[0]["prompt"])
        res = SubLLMResult(
            rollout_id="par1", batch_id=args[0]["batch_id"], index=args[0]["index"], job_id=jid, status="ok",
            content=f"len {len(args[0]['prompt'])}",
        )  # fmt: skip
        reply = (await r.hget(K.rq_job(jid), "rlmq_reply")).decode()
        await r.xadd(reply, {K.REPLY_FIELD: res.model_dump_json()})


async def test_at_the_depth_limit_tasks_are_plain_sub_llm_calls() -> None:
    r = fakeredis.aioredis.FakeRedis()
    await r.zadd(K.serving(QUEUE), {"w": 1e12})
    service = RlmBatchService(LlmBatchService(Dispatcher(r)))
    ro = rollout()
    seen: list[str] = []
    worker = asyncio.create_task(sub_worker(r, seen, 2))
    tasks = [RlmTask(prompt="a"), RlmTask(prompt="b", context="ctx")]
    contents, summary = await service.run(ro, tasks, TreePosition("par1"), remaining=30)
    await worker
    assert sorted(seen) == ["a", "b\n\nContext:\nctx"] and contents == ["len 1", "len 15"]
    assert "as plain sub-LLM calls (depth 1 is the deepest, max_depth=1)" in summary
    (event,) = ro.trajectory  # one rlm_batch event, no llm_batch event
    assert (event["type"], event["batch_id"], event["tasks"]) == ("rlm_batch", "b1", ["a", "b"])
    m = ro.stats.metrics()
    assert m["sub_llm_call_count"] == 2 and m["sub_llm_batch_count"] == 1
    assert tree_metrics(ro.trajectory, m)["rlm_call_count"] == 2


# --------------------------------------------------------------------------- the interception route


@pytest.fixture
async def server() -> AsyncIterator[InterceptionServer]:
    s = InterceptionServer(max_batch_prompts=3, max_batch_bytes=4096)
    await s.start()
    yield s
    await s.stop()


async def post(url: str, token: str | None, body: object | bytes) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s:
        kw: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
        resp = await s.post(url.replace("/llm_batch", "/rlm_batch"), headers=headers, **kw)
        return resp.status, await resp.json()


async def no_batch(prompts: list[str]) -> tuple[list[str], str]:
    raise AssertionError("llm_batch handler called")


@pytest.mark.parametrize(
    ("token", "body", "status", "needle"),
    [
        (None, {"tasks": [{"prompt": "x"}]}, 401, "token"),
        ("OK", b"{not json", 400, "not JSON"),
        ("OK", {"tasks": "x"}, 400, "tasks"),
        ("OK", {"tasks": ["x"]}, 400, "tasks"),  # the REPL sends objects, never bare strings
        ("OK", {"tasks": [{"context": "c"}]}, 400, "tasks"),
        ("OK", {"tasks": [{"prompt": "x", "context": 5}]}, 400, "tasks"),
        ("OK", {"tasks": [{"prompt": "x", "extra": 1}]}, 400, "tasks"),
        ("OK", {"tasks": []}, 400, "empty"),
        ("OK", {"tasks": [{"prompt": "x"}] * 4}, 413, "limit"),
        ("OK", {"tasks": [{"prompt": "x", "context": "c" * 5000}]}, 413, "bytes"),
        ("OK", b'{"tasks": [{"prompt": "\\ud800"}]}', 400, "Unicode"),
        ("OK", b'{"tasks": [{"prompt": "x", "context": ["\\udc00"]}]}', 400, "Unicode"),
        ("OK", b'{"tasks": [{"prompt": "x", "context": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}", 413, "bytes"),
    ],
)
async def test_bad_rlm_batch_bodies_are_refused_at_once(
    server: InterceptionServer, token: str | None, body: object, status: int, needle: str
) -> None:
    calls: list[list[RlmTask]] = []

    async def handle(tasks: list[RlmTask]) -> tuple[list[str], str]:
        calls.append(tasks)
        return [t.prompt.upper() for t in tasks], "summary"

    good = server.register(no_batch, None, handle)
    got, payload = await post(server.url, good if token == "OK" else token, body)
    assert (got, calls) == (status, [])
    assert needle.lower() in str(payload["error"]).lower()
    ok, answer = await post(server.url, good, {"tasks": [{"prompt": "up", "context": {"a": 1}}]})
    assert (ok, answer) == (200, {"results": ["UP"], "summary": "summary"})
    assert calls == [[RlmTask(prompt="up", context={"a": 1})]]


async def test_a_rollout_without_an_rlm_handler_gets_404(server: InterceptionServer) -> None:
    token = server.register(no_batch)
    status, payload = await post(server.url, token, {"tasks": [{"prompt": "x"}]})
    assert status == 404 and "rlm_batch" in payload["error"]


# --------------------------------------------------------------------------- the REPL global


@pytest.fixture
async def rlm_repl() -> AsyncIterator[tuple[Repl, list[dict[str, Any]]]]:
    """A REPL whose endpoint is a real interception server with a recording rlm_batch handler."""
    server = InterceptionServer(max_batch_prompts=4, max_batch_bytes=2048)
    await server.start()
    bodies: list[dict[str, Any]] = []
    repl: Repl | None = None

    async def handle(tasks: list[RlmTask]) -> tuple[list[str], str]:
        bodies.append({"tasks": [t.model_dump() for t in tasks]})
        assert repl is not None
        async with repl.serving():
            return [f"[{t.prompt}|{json.dumps(t.context)}]" for t in tasks], "rlm_batch: summary line"

    token = server.register(no_batch, None, handle)
    repl = Repl(
        context="c", endpoint_url=server.url, unix_socket=server.unix_path_of(token), token=token,
        max_batch_bytes=2048, max_batch_prompts=4,
    )  # fmt: skip
    async with repl:
        yield repl, bodies
    await server.stop()


async def test_rlm_batch_in_the_repl(rlm_repl: tuple[Repl, list[dict[str, Any]]]) -> None:
    repl, bodies = rlm_repl
    out = (await repl.execute("print(rlm_batch(['a', {'prompt': 'b', 'context': {'k': [1]}}]))")).output
    assert out == "rlm_batch: summary line\n['[a|null]', '[b|{\"k\": [1]}]']\n"
    assert bodies == [{"tasks": [{"prompt": "a", "context": None}, {"prompt": "b", "context": {"k": [1]}}]}]
    assert (await repl.execute("rlm_batch([])")).output == "[]\n"


@pytest.mark.parametrize(
    ("code", "needle"),
    [
        ("rlm_batch('a')", "TypeError: rlm_batch(tasks) expects a list, got str"),
        ("rlm_batch([1])", "TypeError: rlm_batch(tasks): tasks[0] is int"),
        ("rlm_batch([{'prompt': 1}])", 'TypeError: rlm_batch(tasks): tasks[0]["prompt"] must be a str'),
        ("rlm_batch([{'prompt': 'a', 'ctx': 1}])", "TypeError: rlm_batch(tasks): tasks[0] has unknown key(s) ctx"),
        ("rlm_batch([{'prompt': 'a', 'context': 3}])", 'tasks[0]["context"] must be a str, list or dict, not int'),
        ("rlm_batch([{'prompt': 'a', 'context': [object()]}])", "TypeError: rlm_batch(tasks): a context is not a JSON"),
        ("rlm_batch(['a'] * 5)", "ValueError: rlm_batch got 5 tasks; at most 4 per call"),
        ("rlm_batch([{'prompt': 'a', 'context': 'x' * 3000}])", "ValueError: rlm_batch tasks take"),
        ("rlm_batch(['\\ud800'])", "ValueError: rlm_batch: a prompt or context is not valid Unicode"),
    ],
)
async def test_rlm_batch_validation_in_the_repl(
    rlm_repl: tuple[Repl, list[dict[str, Any]]], code: str, needle: str
) -> None:
    repl, bodies = rlm_repl
    out = (await repl.execute(code)).output
    assert needle in out and bodies == []


# --------------------------------------------------------------------------- the engine's handler


class RecordingRlm:
    """An rlm_batch service that records what the engine hands it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[RlmTask], TreePosition, float]] = []
        self.running = 0
        self.most = 0

    async def run(
        self, rollout: Rollout, tasks: list[RlmTask], tree: TreePosition, remaining: float
    ) -> tuple[list[str], str]:
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(0.05)
        self.running -= 1
        self.calls.append((rollout.id, tasks, tree, remaining))
        return ["done"], "summary"


@pytest.mark.parametrize("tree", [None, TreePosition("top", depth=2, max_depth=3, nodes=("top",), parent_id="top")])
async def test_the_engine_serves_rlm_batch_with_the_rollouts_tree(tree: TreePosition | None) -> None:
    r = fakeredis.aioredis.FakeRedis()
    repls: list[FakeRepl] = []
    interception = FakeInterception()
    host = RolloutHost.build(r, FakeRoot(code_turn("answer:x")), interception)
    host.make_repl = fake_repl_factory(repls)
    recording = RecordingRlm()
    host.rlm = recording  # type: ignore[assignment]
    outs: list[Any] = []

    async def first_turn(kwargs: dict[str, Any]) -> Any:
        (handler,) = interception.rlm_handlers.values()
        outs.extend(await asyncio.gather(handler([RlmTask(prompt="a")]), handler([RlmTask(prompt="b")])))
        return code_turn("answer:x")

    host.root = FakeRoot(first_turn)
    options = RolloutOptions(max_depth=3, rollout_timeout=50)
    if tree is not None:  # a child's tree: its top's liveness-only ledger and node (a child opens neither)
        ledger = BudgetLedger(r)
        await ledger.open_unlimited("top")
        await ledger.open_node("top", "top")
    res = await run_rollout(host, DatasetRow(id="r", question="q", context="c"), options, model="m", queue="q1",
                            rollout_id="rid9", tree=tree)  # fmt: skip
    assert res.row.stop_reason == "answer_ready" and outs == [(["done"], "summary")] * 2
    assert recording.most == 1  # one rlm_batch of a rollout at a time
    want = tree or TreePosition("rid9", depth=1, max_depth=3)
    assert [c[2] for c in recording.calls] == [want, want] and all(40 < c[3] <= 50 for c in recording.calls)
    assert interception.rlm_handlers == {}  # withdrawn with the rollout
    system = res.messages[0]["content"]
    assert f"depth {want.depth} of 3" in system


async def test_a_context_nested_past_what_a_job_can_carry_is_refused(server: InterceptionServer) -> None:
    async def handle(tasks: list[RlmTask]) -> tuple[list[str], str]:
        raise AssertionError("a context nested 300 deep reached the handler")

    token = server.register(no_batch, None, handle)
    body = b'{"tasks": [{"prompt": "x", "context": ' + b"[" * 300 + b"]" * 300 + b"}]}"
    status, payload = await post(server.url, token, body)
    assert status == 400 and payload["error"] == "tasks[0].context is not valid Unicode text or is nested too deeply"


async def test_a_lost_budget_ledger_rejects_every_child_before_any_job() -> None:
    r = fakeredis.aioredis.FakeRedis()
    service = RlmBatchService(LlmBatchService(Dispatcher(r)))
    ro = rollout(sub_llm_max_completion_tokens=100)
    ro.ledger = RolloutBudget(r, ro.ledger_id, ro.options)  # never opened: as if Redis lost it
    contents, summary = await service.run(
        ro, [RlmTask(prompt="a"), RlmTask(prompt="b")], TreePosition("par1", max_depth=2), 30
    )
    assert contents == [LEDGER_LOST] * 2 and "0 ok, 2 rejected, 0 error" in summary
    assert await r.llen(K.rq_queue(K.child_queue(QUEUE, 2))) == 0
    assert tree_metrics(ro.trajectory, ro.stats.metrics())["rlm_call_failed_count"] == 2


async def test_redis_gone_while_children_are_dispatched_gives_error_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    r = fakeredis.aioredis.FakeRedis()
    dispatcher = Dispatcher(r)

    async def gone(spec: Any, prompts: list[str]) -> list[SubLLMResult]:
        raise RedisConnectionError("connection refused")

    monkeypatch.setattr(dispatcher, "run_batch", gone)
    service = RlmBatchService(LlmBatchService(dispatcher))
    ro = rollout()
    await open_tree(r, "par1", "par1")
    contents, _ = await service.run(ro, [RlmTask(prompt="a")], TreePosition("par1", max_depth=2), 30)
    assert contents == ["[error] child rollout failed: Redis unavailable (connection refused)"]
    assert ro.trajectory[0]["results"][0]["error_kind"] == "redis"


async def test_a_closed_tree_starts_no_children() -> None:
    """A child that calls rlm_batch after its top rollout ended (or its parent's attempt died):
    every task is refused at once, and no job is enqueued (no REPL started to be refused later)."""
    r = fakeredis.aioredis.FakeRedis()
    service = RlmBatchService(LlmBatchService(Dispatcher(r)))
    ro = rollout(max_depth=3)
    tree = TreePosition(ledger_id="top", depth=2, max_depth=3, nodes=("top",), parent_id="top")
    await open_tree(r, "top", "par1")  # the top's node is gone: its tree has ended
    t0 = time.monotonic()
    contents, summary = await service.run(ro, [RlmTask(prompt="a"), RlmTask(prompt="b")], tree, remaining=100.0)
    assert time.monotonic() - t0 < 2
    assert contents == [TREE_CLOSED] * 2 and "0 ok, 2 rejected" in summary
    assert await r.llen(K.rq_queue(K.child_queue(QUEUE, 3))) == 0
    await open_tree(r, "top", "top")  # the control: open, the children are enqueued
    host = asyncio.create_task(child_host(r, K.child_queue(QUEUE, 3), [], 1))
    await r.zadd(K.serving(K.child_queue(QUEUE, 3)), {"host": 1e12})
    contents, _ = await service.run(ro, [RlmTask(prompt="c")], tree, remaining=100.0)
    await host
    assert contents == ["child says c / null"]
