"""rlmq inside verifiers: ``vf-eval rlmq`` as a subprocess, on real worker processes and a real Redis.

The model server is rlmq's scripted model (a test double) behind a recording HTTP proxy in
this process, so the test sees every request that reaches "the model server": the root calls
(relayed by verifiers' interception server, which stamps ``X-Session-ID`` with the trace id)
and the sub-calls (sent by the ``rlmq worker`` processes). These tests need the
``verifiers`` extra (part of ``rlmq[test]``); they fail, never skip, without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, ClientTimeout, web

from rlmq.cli.demo import needle_rows
from rlmq.cli.local import LocalFleet, ProcessGroup, child_env, start_mock_llm
from rlmq.scripted.server import root_code_directive

pytestmark = pytest.mark.e2e

VF_EVAL = Path(sys.executable).with_name("vf-eval")
FAIL_ROOT = "[[proxy:fail-root]]"
"""A question carrying this gets HTTP 400 from the proxy on its root calls (a provider error)."""

DESIGN_METRICS = (
    "sub_llm_call_count", "sub_llm_total_turns", "sub_llm_prompt_tokens", "sub_llm_completion_tokens",
    "sub_llm_total_tool_calls", "sub_llm_batch_count", "sub_llm_max_batch_size", "sub_llm_mean_batch_size",
    "main_rlm_turns", "main_rlm_prompt_tokens", "main_rlm_completion_tokens", "repl_call_count",
    "repl_total_time_seconds", "repl_mean_time_seconds", "sub_llm_rejected_count", "sub_llm_error_count",
    "sub_llm_queue_wait_seconds_mean",
)  # fmt: skip


@dataclass
class Seen:
    """One request that reached the model server through the proxy."""

    root: bool
    session_id: str | None
    user: str | None
    model: str
    question: str
    completion_tokens: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    """The request's fields besides ``messages`` and ``tools`` (sampling arguments, ...)."""


@dataclass
class RecordingProxy:
    """An HTTP proxy in a thread of its own, in front of the scripted model: records, relays."""

    upstream: str
    seen: list[Seen] = field(default_factory=list)
    url: str = ""
    _loop: asyncio.AbstractEventLoop | None = None
    _runner: web.AppRunner | None = None
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> RecordingProxy:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the recording proxy did not start within 30 s")
        return self

    def _run(self, ready: threading.Event) -> None:
        loop = self._loop = asyncio.new_event_loop()
        loop.run_until_complete(self._serve())
        ready.set()
        loop.run_forever()
        loop.run_until_complete(self._close())
        loop.close()

    async def _serve(self) -> None:
        self._session = ClientSession(timeout=ClientTimeout(total=120))
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._relay)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/v1"

    async def _close(self) -> None:
        await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _relay(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw)
        tools = [t.get("function", {}).get("name") for t in body.get("tools") or []]
        first_user = next((m.get("content") for m in body["messages"] if m.get("role") == "user"), "")
        seen = Seen(
            root="call_python_repl" in tools or "call_bash_repl" in tools,
            session_id=request.headers.get("X-Session-ID"),
            user=body.get("user"),
            model=body.get("model", ""),
            question=str(first_user),
            params={k: v for k, v in body.items() if k not in ("messages", "tools")},
        )
        with self._lock:
            self.seen.append(seen)
        if seen.root and FAIL_ROOT in seen.question:
            error = {"error": {"message": "proxy: injected failure", "type": "invalid_request_error"}}
            return web.json_response(error, status=400)
        async with self._session.post(
            self.upstream + "/chat/completions", data=raw, headers={"Content-Type": "application/json"}
        ) as resp:
            data = await resp.read()
            status = resp.status
        if status == 200:
            seen.completion_tokens = int((json.loads(data).get("usage") or {}).get("completion_tokens", 0))
        return web.Response(body=data, status=status, content_type="application/json")

    def requests(self) -> list[Seen]:
        with self._lock:
            return list(self.seen)

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(30)


@dataclass
class Setup:
    fleet: LocalFleet
    proxy: RecordingProxy
    redis_url: str


@contextlib.contextmanager
def proxied_fleet(redis_url: str, logs: Path, model: str, **fleet: Any) -> Iterator[Setup]:
    """The scripted model (a process of its own), the recording proxy in front of it, and two
    workers (32 calls each, ``fleet``: more :class:`LocalFleet` arguments) calling the proxy;
    everything stopped on exit."""
    group = ProcessGroup(str(logs))
    try:
        proxy = RecordingProxy(start_mock_llm(group)).start()
        try:
            with LocalFleet(
                redis_url=redis_url, model=model, base_url=proxy.url, workers=2, worker_concurrency=32,
                log_dir=str(logs), **fleet,
            ) as local:  # fmt: skip
                yield Setup(fleet=local, proxy=proxy, redis_url=redis_url)
        finally:
            proxy.stop()
    finally:
        group.stop()


@pytest.fixture(scope="module")
def setup(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """The scripted model, the recording proxy in front of it, two workers calling the proxy."""
    logs = tmp_path_factory.mktemp("vf-fleet-logs")
    with proxied_fleet(redis_url, logs, f"vf-sub-{uuid.uuid4().hex[:6]}") as made:
        yield made


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def vf_eval(
    tmp: Path, rows: Path, args: list[str], env: dict[str, str], *, name_harness: bool = True, timeout: float = 300
) -> list[dict[str, Any]]:
    """Run ``vf-eval rlmq`` on ``rows`` (with ``--env.agent.harness.id rlmq`` when
    ``name_harness``); return the traces of ``traces.jsonl`` (one per episode here)."""
    assert VF_EVAL.exists(), f"{VF_EVAL} missing: install the extra, pip install -e '.[test]'"
    argv = [
        str(VF_EVAL), "rlmq", "--env.taskset.path", str(rows),
        *(["--env.agent.harness.id", "rlmq"] if name_harness else []),
        "--no-push", "--no-rich", "-o", str(tmp / "out"), "--run.name", "run", *args,
    ]  # fmt: skip
    proc = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"vf-eval exited {proc.returncode}\n{proc.stderr[-4000:]}"
    lines = (tmp / "out" / "run" / "traces.jsonl").read_text().splitlines()
    episodes = [json.loads(line) for line in lines if line.strip()]
    traces = [t for ep in episodes for t in ep["traces"]]
    assert len(traces) == len(episodes)
    return traces


def _by_row(traces: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {t["task"]["data"]["id"]: t for t in traces}


def test_vf_eval_scores_rlmq_rollouts_with_root_calls_through_verifiers_and_sub_calls_on_the_fleet(
    setup: Setup, tmp_path: Path
) -> None:
    needles = needle_rows(3, min_chars=20_000, seed=7)
    needles[2]["answer"] = "not-the-passphrase"  # the rollout answers; the reward must be 0
    rows = [
        *needles,
        {"id": "plain", "question": "Say hi. [[mock:no-tool]]", "context": "nothing here", "answer": "hi"},
    ]
    path = _write_rows(tmp_path / "rows.jsonl", rows)
    before = len(setup.proxy.requests())
    env = child_env({"REDIS_URL": setup.redis_url})
    traces = vf_eval(
        tmp_path, path, ["--model", setup.fleet.model, "--client.base-url", setup.proxy.url, "-c", "4"], env
    )
    seen = setup.proxy.requests()[before:]
    by_row = _by_row(traces)
    assert sorted(by_row) == sorted(r["id"] for r in rows)

    # every rollout scored, with the exact-match reward
    scores = {rid: t["rewards"]["exact_match"]["score"] for rid, t in by_row.items()}
    assert scores == {needles[0]["id"]: 1.0, needles[1]["id"]: 1.0, needles[2]["id"]: 0.0, "plain": 0.0}
    for rid in (needles[0]["id"], needles[1]["id"]):
        assert by_row[rid]["root_reply"] == next(r["answer"] for r in needles if r["id"] == rid)
    assert all(t["ok"] for t in traces), [t.get("errors") for t in traces]

    # stop reasons map to the trace's
    assert {rid: t["stop_condition"] for rid, t in by_row.items()} == {
        needles[0]["id"]: "agent_completed",
        needles[1]["id"]: "agent_completed",
        needles[2]["id"]: "agent_completed",
        "plain": "no_tool_call",
    }
    assert {t["info"]["rlmq"]["stop_reason"] for t in traces} == {"answer_ready", "no_tool_call"}

    for t in traces:
        metrics = t["metrics"]
        missing = [m for m in DESIGN_METRICS if m not in metrics]
        assert not missing, f"metrics missing from the trace: {missing}"
        roots = [s for s in seen if s.root and s.session_id == t["id"]]
        subs = [s for s in seen if not s.root and s.session_id == t["id"]]
        # root calls: relayed by verifiers' interception (it stamps X-Session-ID = trace id),
        # recorded in the trace, one per rlmq root turn
        assert len(roots) == len(t["calls"]) == metrics["main_rlm_turns"] >= 1
        # sub-calls: sent by the workers with the rollout's session id, one per sub-call counted
        assert len(subs) == metrics["sub_llm_call_count"]
        assert all(s.user == t["id"] and s.model == setup.fleet.model for s in subs)
        batches = [e for e in t["info"]["rlmq"]["trajectory"] if e["type"] == "llm_batch"]
        served = [r for b in batches for r in b["results"]]
        assert len(served) == metrics["sub_llm_call_count"]
        assert all(r["status"] == "ok" and r["worker"] for r in served)
        prompts = [p for b in batches for p in b["prompts"]]
        assert all(len(p) <= 500 or p[500:].startswith("[... ") for p in prompts)
    needle_traces = [by_row[r["id"]] for r in needles]
    assert all(t["metrics"]["sub_llm_call_count"] >= 1 for t in needle_traces)
    cut = [e for t in needle_traces for e in t["info"]["rlmq"]["trajectory"] if e["type"] == "llm_batch"]
    assert any("characters in all]" in p for e in cut for p in e["prompts"])  # 20K-character chunks, cut
    assert by_row["plain"]["metrics"]["sub_llm_call_count"] == 0
    assert sum(1 for s in seen if not s.root) == sum(t["metrics"]["sub_llm_call_count"] for t in traces)


def test_vf_eval_harness_config_sets_redis_sub_model_and_a_hard_budget(setup: Setup, tmp_path: Path) -> None:
    """The Redis URL (kept out of what the run writes), the sub-model and the budget come from
    ``--env.agent.harness.*`` (no
    REDIS_URL in the environment; no ``--env.agent.harness.id`` either: the ``rlmq`` taskset's
    env defaults its seat to the ``rlmq`` harness); sub-LLMs that spend every token they are
    granted stay within the budget, counted by the model server itself."""
    rows = needle_rows(2, min_chars=100_000, seed=11)  # the scripted root asks one sub-call per 20K characters
    for r in rows:
        r["question"] += " [[mock:spend-all]]"
    path = _write_rows(tmp_path / "rows.jsonl", rows)
    budget = 3
    before = len(setup.proxy.requests())
    args = [
        "--model", "root-model", "--client.base-url", setup.proxy.url,
        "--env.agent.harness.redis-url", setup.redis_url,
        "--env.agent.harness.sub-model", setup.fleet.model,
        "--env.agent.harness.sub-llm-max-completion-tokens", str(budget),
        "--env.agent.harness.max-sub-llm-parallelism", "2",
        "--env.agent.harness.sub-sampling-args", '{"top_p": 0.3, "extra_body": {"min_p": 0.05}}',
        "--sampling.temperature", "0.6",
    ]  # fmt: skip
    traces = vf_eval(tmp_path, path, args, child_env(), name_harness=False)
    seen = setup.proxy.requests()[before:]
    for written in (tmp_path / "out" / "run").rglob("*.json*"):  # the saved config, the traces
        assert setup.redis_url not in written.read_text(), f"{written} holds the Redis URL"
    assert len(traces) == 2
    for t in traces:
        m = t["metrics"]
        assert t["rewards"]["exact_match"] is not None
        assert m["sub_llm_budget_limit"] == budget
        served = sum(s.completion_tokens for s in seen if not s.root and s.session_id == t["id"])
        assert 0 < served <= budget
        assert m["sub_llm_budget_charged"] == served
        # >= 5 sub-calls, each served one spending >= 1 token: at most 3 ran, the rest rejected
        # (sub_llm_call_count counts the calls that ran, as the reference's does)
        ran, rejected = m["sub_llm_call_count"], m["sub_llm_rejected_count"]
        assert ran + rejected >= 5 and 1 <= ran <= budget
        assert all(s.model == "root-model" for s in seen if s.root and s.session_id == t["id"])
        assert all(s.model == setup.fleet.model for s in seen if not s.root and s.session_id == t["id"])
        # sampling arguments: the sub-LLMs' from the harness, the root's from verifiers' own --sampling.*
        assert all((s.params["top_p"], s.params["min_p"]) == (0.3, 0.05) for s in seen if not s.root)
        # ...over the rollout's own (verifiers' --sampling.*), which sub-calls inherit otherwise
        assert all(s.params.get("temperature") == 0.6 and s.params.get("max_tokens") for s in seen if not s.root)
        assert all(s.params.get("temperature") == 0.6 for s in seen if s.root and s.session_id == t["id"])


BUDGET_VAR = "RLMQ_SUB_LLM_MAX_COMPLETION_TOKENS"


@pytest.mark.parametrize(
    ("variables", "knobs"),
    [
        ({BUDGET_VAR: "3"}, []),  # the harness passed None, the budget was off
        ({BUDGET_VAR: "1000"}, ["--env.agent.harness.sub-llm-max-completion-tokens", "3"]),  # the knob beats it
    ],
    ids=["budget-from-the-environment", "knob-beats-the-environment"],
)
def test_the_budget_holds_under_vf_eval_set_by_the_environment_or_by_the_knob(
    setup: Setup, tmp_path: Path, variables: dict[str, str], knobs: list[str]
) -> None:
    """Sub-LLMs that spend every token they are granted, budget 3: the model server itself
    serves at most 3 completion tokens per rollout, whether the budget comes from
    ``RLMQ_SUB_LLM_MAX_COMPLETION_TOKENS`` or from the harness knob (which beats the variable)."""
    rows = needle_rows(2, min_chars=100_000, seed=13)
    for r in rows:
        r["question"] += " [[mock:spend-all]]"
    path = _write_rows(tmp_path / "rows.jsonl", rows)
    before = len(setup.proxy.requests())
    args = [
        "--model", "root-model", "--client.base-url", setup.proxy.url,
        "--env.agent.harness.sub-model", setup.fleet.model, *knobs,
    ]  # fmt: skip
    traces = vf_eval(tmp_path, path, args, child_env({"REDIS_URL": setup.redis_url, **variables}))
    seen = setup.proxy.requests()[before:]
    assert len(traces) == 2
    for t in traces:
        m = t["metrics"]
        served = sum(s.completion_tokens for s in seen if not s.root and s.session_id == t["id"])
        assert m["sub_llm_budget_limit"] == 3, m
        assert 0 < served <= 3, served
        ran, rejected = m["sub_llm_call_count"], m["sub_llm_rejected_count"]  # ran: the calls that ran
        assert ran + rejected >= 5 and 1 <= ran <= 3


def test_vf_eval_eight_answers_of_1500_under_a_budget_of_20000_are_all_whole(setup: Setup, tmp_path: Path) -> None:
    """Case (a) through the harness: one row whose root code sends 8 prompts of 1,500-token answers
    in one ``llm_batch`` under ``sub-llm-max-completion-tokens 20000``: the model server serves 8
    whole answers (12,000 tokens) to the rollout, none cut, none refused."""
    prompts = [f"Summarise part {i}. [[mock:tokens:1500]] [[mock:tps:1500]]" for i in range(8)]
    code = f'out = llm_batch({prompts!r})\nanswer["content"] = "done"\nanswer["ready"] = True\n'
    row = {"id": "vf-a", "question": "Q. " + root_code_directive(code), "context": "x", "answer": "done"}
    path = _write_rows(tmp_path / "rows.jsonl", [row])
    before = len(setup.proxy.requests())
    args = [
        "--model", "root-model", "--client.base-url", setup.proxy.url,
        "--env.agent.harness.sub-model", setup.fleet.model,
        "--env.agent.harness.sub-llm-max-completion-tokens", "20000",
        "--env.agent.harness.max-sub-llm-parallelism", "8",
    ]  # fmt: skip
    (t,) = vf_eval(tmp_path, path, args, child_env({"REDIS_URL": setup.redis_url}))
    subs = [s for s in setup.proxy.requests()[before:] if not s.root and s.session_id == t["id"]]
    assert t["info"]["rlmq"]["stop_reason"] == "answer_ready", t.get("errors")
    assert sorted(s.completion_tokens for s in subs) == [1500] * 8, [(s.completion_tokens, s.params) for s in subs]
    m = t["metrics"]
    assert m["sub_llm_budget_limit"] == 20000 and m["sub_llm_budget_charged"] == 12_000
    assert (m["sub_llm_call_count"], m["sub_llm_rejected_count"], m["sub_llm_truncated_count"]) == (8, 0, 0)
    (batch,) = [e for e in t["info"]["rlmq"]["trajectory"] if e["type"] == "llm_batch"]
    assert all(r["status"] == "ok" and not r["truncated"] for r in batch["results"])
    assert batch["seconds"] < 4.0  # in parallel: about one call's second, not eight


@pytest.mark.parametrize(
    ("variables", "knobs", "named"),
    [
        ({}, ["--env.agent.harness.sub-llm-max-completion-tokens", "0"], "sub-llm-max-completion-tokens"),
        ({BUDGET_VAR: "0"}, [], BUDGET_VAR),
        ({"RLMQ_MAX_TURNS": "many"}, [], "RLMQ_MAX_TURNS"),
    ],
    ids=["zero-budget-knob", "zero-budget-variable", "bad-variable"],
)
def test_vf_eval_refuses_a_bad_setting_at_configuration_before_any_rollout(
    setup: Setup, tmp_path: Path, variables: dict[str, str], knobs: list[str], named: str
) -> None:
    """A budget of 0 (knob or variable) or any bad ``RLMQ_*`` value stops ``vf-eval`` before
    a rollout starts, naming the knob or the variable; no model call is made."""
    path = _write_rows(tmp_path / "rows.jsonl", needle_rows(1, min_chars=20_000, seed=17))
    before = len(setup.proxy.requests())
    argv = [
        str(VF_EVAL), "rlmq", "--env.taskset.path", str(path), "--env.agent.harness.id", "rlmq",
        "--no-push", "--no-rich", "-o", str(tmp_path / "out"), "--run.name", "run",
        "--model", setup.fleet.model, "--client.base-url", setup.proxy.url, *knobs,
    ]  # fmt: skip
    env = child_env({"REDIS_URL": setup.redis_url, **variables})
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = " ".join(re.sub(r"[│╭╮╰╯─]", " ", proc.stdout + proc.stderr).split())  # verifiers boxes its errors
    assert proc.returncode != 0, output[-3000:]
    assert f"invalid setting(s): {'--env.agent.harness.' if knobs else ''}{named}" in output, output[-3000:]
    assert setup.proxy.requests()[before:] == []


def test_vf_eval_records_a_failed_root_call_as_the_rollouts_error(setup: Setup, tmp_path: Path) -> None:
    """A provider error on the root call ends that rollout as an error in its trace; the
    other rollouts of the run are scored."""
    good = needle_rows(1, min_chars=20_000, seed=3)[0]
    bad = {"id": "bad", "question": f"Anything? {FAIL_ROOT}", "context": "x", "answer": "y"}
    path = _write_rows(tmp_path / "rows.jsonl", [good, bad])
    env = child_env({"REDIS_URL": setup.redis_url})
    traces = vf_eval(tmp_path, path, ["--model", setup.fleet.model, "--client.base-url", setup.proxy.url], env)
    by_row = _by_row(traces)
    assert by_row[good["id"]]["ok"] and by_row[good["id"]]["rewards"]["exact_match"]["score"] == 1.0
    failed = by_row["bad"]
    assert not failed["ok"]
    assert failed["stop_condition"] == "provider_error", failed["stop_condition"]
    assert "injected failure" in json.dumps(failed["errors"])


def test_an_agent_timeout_ends_the_rollout_while_its_sub_calls_are_still_running(setup: Setup, tmp_path: Path) -> None:
    """verifiers cancels the harness at ``--env.agent.timeout.rollout``; the rlmq rollout must
    end then, not when its batch's sub-calls (20 s each here) come back."""
    row = needle_rows(1, min_chars=20_000, seed=5)[0]
    row["question"] += " [[mock:sleep:20]]"
    path = _write_rows(tmp_path / "rows.jsonl", [row])
    env = child_env({"REDIS_URL": setup.redis_url})
    args = ["--model", setup.fleet.model, "--client.base-url", setup.proxy.url, "--env.agent.timeout.rollout", "3"]
    (trace,) = vf_eval(tmp_path, path, args, env)
    assert trace["stop_condition"] == "agent_timeout"
    agent = trace["timing"]["agent"]
    assert agent["end"] - agent["start"] < 12.0, agent


def test_import_rlmq_does_not_import_verifiers() -> None:
    code = (
        "import sys, rlmq, rlmq.producer.env, rlmq.workers.worker, rlmq.cli.main; "
        "assert 'verifiers' not in sys.modules, sorted(m for m in sys.modules if m.startswith('verifiers')); "
        "from rlmq import RlmqHarness; assert 'verifiers' in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=child_env())
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_loader_resolves_the_id_rlmq_to_the_plugin() -> None:
    from verifiers.v1.utils import loaders

    import rlmq

    assert loaders.harness_class("rlmq") is rlmq.RlmqHarness
    assert loaders.taskset_class("rlmq") is rlmq.RlmqTaskset
    assert loaders.default_harness_id("rlmq") == "rlmq"
    assert loaders.environment_class("rlmq") is rlmq.RlmqEnv


def test_the_harness_takes_any_text_task_with_an_empty_context() -> None:
    import verifiers.v1 as vf

    from rlmq.verifiers_plugin.harness import dataset_row
    from rlmq.verifiers_plugin.taskset import RlmqTaskData

    plain = dataset_row(vf.TaskData(idx=3, prompt="What is 2 + 2?"), "What is 2 + 2?")
    assert (plain.id, plain.question, plain.context, plain.answer) == ("3", "What is 2 + 2?", "", None)
    data = RlmqTaskData(id="r1", prompt="Q", context={"a": [1, 2]}, answer="A", info={"k": 1})
    row = dataset_row(data, "Q")
    assert (row.id, row.context, row.answer, row.info) == ("r1", {"a": [1, 2]}, "A", {"k": 1})


def test_a_trace_id_that_is_no_rollout_id_gets_a_fresh_one() -> None:
    from rlmq.verifiers_plugin.adapter import rollout_id_for

    assert rollout_id_for("0123abcd" * 4) == "0123abcd" * 4
    for bad in ("a/b", "x" * 65, "", "id with space"):
        fresh = rollout_id_for(bad)
        assert fresh != bad and len(fresh) == 32 and fresh.isalnum()


def test_the_harness_config_gives_rlmenv_tools_and_the_system_prompt() -> None:
    from rlmq.verifiers_plugin.adapter import rollout_env
    from rlmq.verifiers_plugin.harness import RlmqHarnessConfig

    config = RlmqHarnessConfig(
        redis_url="redis://unused:1/0",
        tools=["rlmq.workers.tools:count_words"],
        root_tools=["json:dumps"],
        system_prompt="Be terse.",
        system_prompt_mode="replace",
        sub_llm_final_answer_turn=False,
        pip_install_packages=["six"],
    )
    env = rollout_env(config.knobs(), model="root", base_url="http://root:1/v1", api_key="sk")
    assert env.toolbox.names == ["count_words", "dumps"]
    s = env.settings
    assert (s.system_prompt, s.system_prompt_mode, s.sub_llm_final_answer_turn) == ("Be terse.", "replace", False)
    assert s.pip_install_packages == ["six"] and s.tools == ["rlmq.workers.tools:count_words"]
