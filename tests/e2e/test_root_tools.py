"""Root tools end to end: an author's callables as REPL globals, run in the producer, with real
workers, a real Redis and the scripted model; and the author's system prompt reaching the model."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import tracemalloc
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from rlmq.cli.local import LocalFleet
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import Settings, load_settings
from rlmq.producer.env import RLMEnv
from rlmq.producer.scaffold import files_text, root_system_prompt
from rlmq.scripted.server import root_code_directive

pytestmark = pytest.mark.e2e

COUNT_WORDS = "rlmq.workers.tools.count_words"


@pytest.fixture(scope="module")
def tool_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    logs = tmp_path_factory.mktemp("root-tool-logs")
    with LocalFleet(
        redis_url=redis_url,
        model=f"root-tools-{uuid.uuid4().hex[:6]}",
        workers=1,
        worker_args=["--allow-tool", COUNT_WORDS],
        log_dir=str(logs),
    ) as fleet:
        yield fleet


def settings_of(fleet: LocalFleet) -> Settings:
    return load_settings(redis_url=fleet.redis_url, base_url=fleet.base_url, model=fleet.model)


def lookup(key: str) -> dict[str, Any]:
    """Look a vault up in the index.

    Args:
        key: the vault's name.
    """
    return {"vault": key, "code": 48213, "pid": os.getpid()}


async def as_set() -> Any:
    """A result that is not JSON."""
    await asyncio.sleep(0)
    return {1, 2}


def broken(query: str) -> str:
    """An index that is not there."""
    raise ValueError(f"no index for {query!r}")


def huge() -> str:
    """100 MB of text."""
    return "x" * 100_000_000


def huge_list() -> list[str]:
    """100 MB of JSON in 100,000 references to one string."""
    return ["y" * 1000] * 100_000


def root_stats(fleet: LocalFleet) -> dict[str, Any]:
    with urllib.request.urlopen(str(fleet.base_url).removesuffix("/v1") + "/stats", timeout=10) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


CELL = """
import json
a = lookup("ORCHID")
b = as_set()
c = count_words("one two three")
out = llm_batch(['Count. [[mock:tool:count_words:{"text": "a b"}]] [[mock:echo-tool-result]]'])
answer["content"] = json.dumps({"a": a, "b": b, "c": c, "sub": out[0], "doc": lookup.__doc__})
answer["ready"] = True
"""


async def test_root_tools_run_in_the_producer_and_are_counted(tool_fleet: LocalFleet) -> None:
    row = DatasetRow(id="tools", question="Tools. " + root_code_directive(CELL), context="x")
    async with RLMEnv(settings=settings_of(tool_fleet), tools=[COUNT_WORDS], root_tools=[lookup, as_set]) as env:
        res = await env.rollout(row, model=tool_fleet.model)
    assert res.row.stop_reason == "answer_ready", (res.row.error, res.trajectory)
    got = json.loads(str(res.row.final_answer))
    assert got["a"] == {"vault": "ORCHID", "code": 48213, "pid": os.getpid()}  # ran here, in the producer
    assert got["b"] == "{1, 2}"  # not JSON: its repr
    assert got["c"] == 3  # a shared tool, in the REPL ...
    assert "tool result: 2" in got["sub"]  # ... and offered to the sub-LLM, run on the worker
    assert got["doc"].startswith("Look a vault up in the index.")
    m = res.row.metrics
    assert m["root_tool_call_count"] == 4 and m["root_tool_error_count"] == 0  # llm_batch counts, as the reference
    assert (m["lookup_root_calls"], m["as_set_root_calls"], m["count_words_root_calls"]) == (1, 1, 1)
    assert m["sub_llm_total_tool_calls"] == 1
    events = [e for e in res.trajectory if e["type"] == "root_tool"]
    assert [e["name"] for e in events] == ["lookup", "as_set", "count_words"] and all(e["ok"] for e in events)
    assert json.loads(events[0]["arguments"]) == {"args": ["ORCHID"], "kwargs": {}}
    system = res.messages[0]["content"]
    assert "`lookup(key: str) -> dict[str, typing.Any]`: Look a vault up in the index." in system
    assert "`count_words(text: str) -> int`" in system


async def test_a_tool_that_raises_gives_the_cell_its_message(tool_fleet: LocalFleet) -> None:
    row = DatasetRow(id="raises", question="Which index? [[mock:root-tool:broken]]", context="x")
    async with RLMEnv(settings=settings_of(tool_fleet), root_tools=[broken]) as env:
        res = await env.rollout(row, model=tool_fleet.model)
    assert res.row.stop_reason == "answer_ready", res.row.error
    assert res.row.final_answer == "[tool failed] broken raised ValueError: no index for 'Which index?'"
    assert res.row.metrics["root_tool_error_count"] == 1 and res.row.metrics["broken_root_calls"] == 1


HANG_CELL = """
import json, time
seen = {}
for tool in (stuck, stuck_async):
    t0 = time.monotonic()
    try:
        tool()
        seen[tool.__name__] = "returned"
    except RuntimeError as exc:
        seen[tool.__name__] = [str(exc), time.monotonic() - t0]
answer["content"] = json.dumps(seen)
answer["ready"] = True
"""


async def test_a_tool_that_hangs_fails_at_its_timeout(tool_fleet: LocalFleet) -> None:
    release = threading.Event()
    forever = asyncio.Event()

    def stuck() -> str:
        release.wait(120)
        return "late"

    async def stuck_async() -> str:
        await forever.wait()
        return "late"

    row = DatasetRow(id="hangs", question="Hang. " + root_code_directive(HANG_CELL), context="x")
    try:
        async with RLMEnv(
            settings=settings_of(tool_fleet), root_tools=[stuck, stuck_async], root_tool_timeout=1.0
        ) as env:
            res = await env.rollout(row, model=tool_fleet.model)
    finally:
        release.set()
    assert res.row.stop_reason == "answer_ready", res.row.error
    seen = json.loads(str(res.row.final_answer))
    for name in ("stuck", "stuck_async"):
        message, seconds = seen[name]
        assert message == f"{name} did not return within its timeout of 1 s"
        assert 0.9 <= seconds < 15, seen
    assert res.row.metrics["root_tool_error_count"] == 2


HUGE_CELL = """
out = []
for tool in (huge, huge_list):
    try:
        out.append(len(tool()))
    except RuntimeError as exc:
        out.append(str(exc))
answer["content"] = " || ".join(map(str, out))
answer["ready"] = True
"""


async def test_a_100_mb_result_is_refused_without_a_copy_in_the_producer(tool_fleet: LocalFleet) -> None:
    row = DatasetRow(id="huge", question="Huge. " + root_code_directive(HUGE_CELL), context="x")
    async with RLMEnv(settings=settings_of(tool_fleet), root_tools=[huge, huge_list]) as env:
        tracemalloc.start()
        try:
            res = await env.rollout(row, model=tool_fleet.model)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert res.row.stop_reason == "answer_ready", res.row.error
    first, second = str(res.row.final_answer).split(" || ")
    limit = "result is over the limit of 1048576 bytes of JSON"
    assert first.startswith("huge: " + limit) and second.startswith("huge_list: " + limit)
    # The tool's own 100 MB string is the only large allocation: no JSON copy, nothing kept.
    print("peak traced memory during the rollout:", peak)
    assert peak < 100_000_000 + 30_000_000, peak
    assert len(json.dumps(res.trajectory)) + len(json.dumps(res.messages)) < 100_000


async def test_the_authors_system_prompt_reaches_the_root_model(tool_fleet: LocalFleet) -> None:
    settings = settings_of(tool_fleet)
    author = f"You are a careful archivist {uuid.uuid4().hex}."
    row = DatasetRow(id="sys", question="What is it? [[mock:no-tool]]", context="some text")
    scaffold = root_system_prompt(
        "some text",
        tools=["`lookup(key: str) -> dict[str, typing.Any]`: Look a vault up in the index."],
        files=files_text("context.txt"),
    )
    expected = {
        "prepend": f"{author}\n\n{scaffold}",
        "append": f"{scaffold}\n\n{author}",
        "replace": author,
    }
    for mode, text in expected.items():
        async with RLMEnv(settings=settings, system_prompt=author, system_prompt_mode=mode, root_tools=[lookup]) as env:
            res = await env.rollout(row, model=tool_fleet.model)
        assert res.row.stop_reason == "no_tool_call", res.row.error
        received = root_stats(tool_fleet)["root_system_prompts"]
        assert received[-1] == text, (mode, received[-1])


HOG_CELL = """
import json
seen = []
for _ in range(10):
    try:
        seen.append(stuck())
    except RuntimeError as exc:
        seen.append(str(exc))
answer["content"] = json.dumps(seen)
answer["ready"] = True
"""

FAIR_CELL = """
try:
    answer["content"] = str(fine())
except RuntimeError as exc:
    answer["content"] = str(exc)
answer["ready"] = True
"""


async def test_a_rollout_whose_tool_hangs_does_not_take_the_other_rollouts_tools(tool_fleet: LocalFleet) -> None:
    release = threading.Event()

    def stuck() -> str:
        release.wait(120)
        return "late"

    def fine() -> str:
        return "served"

    hog = DatasetRow(id="hog", question="Hog. " + root_code_directive(HOG_CELL), context="x")
    fair = DatasetRow(id="fair", question="Fair. " + root_code_directive(FAIR_CELL), context="x")
    try:
        async with RLMEnv(settings=settings_of(tool_fleet), root_tools=[stuck, fine], root_tool_timeout=0.5) as env:
            hogged = await env.rollout(hog, model=tool_fleet.model)
            served = await env.rollout(fair, model=tool_fleet.model)
    finally:
        release.set()
    assert served.row.stop_reason == "answer_ready", served.row.error
    assert served.row.final_answer == "served"  # the hog held one thread, not all of them
    assert hogged.row.stop_reason == "answer_ready", hogged.row.error
    seen = json.loads(str(hogged.row.final_answer))
    assert seen[0] == "stuck did not return within its timeout of 0.5 s", seen
    assert all("previous call of stuck is still running past its timeout" in s for s in seen[1:]), seen


async def test_a_call_in_flight_when_the_rollout_ends_is_recorded_as_ended_and_not_after(
    tool_fleet: LocalFleet,
) -> None:
    started, release = threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        release.wait(60)
        return "late"

    row = DatasetRow(id="late", question="Late. " + root_code_directive("slow()"), context="x")
    try:
        settings = settings_of(tool_fleet).with_overrides(rollout_timeout=8)
        async with RLMEnv(settings=settings, root_tools=[slow], root_tool_timeout=30) as env:
            res = await env.rollout(row, model=tool_fleet.model)  # ends at its deadline, the call in flight
            assert started.is_set(), "the cell never reached the tool: the REPL took the whole deadline"
            recorded = json.dumps(res.trajectory)
            release.set()
            deadline = asyncio.get_running_loop().time() + 20
            while env.toolbox._threads.count or env.toolbox._held:  # the tool's thread returns once released
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
            for _ in range(10):  # let the call's late completion (if any) run on the loop
                await asyncio.sleep(0)
    finally:
        release.set()
    assert res.row.stop_reason == "error" and "RolloutTimeout" in str(res.row.error)
    events = [e for e in res.trajectory if e["type"] == "root_tool"]
    assert [(e["name"], e["ok"], e["error"]) for e in events] == [
        ("slow", False, "slow: the rollout ended before it returned")
    ]
    assert res.row.metrics["root_tool_call_count"] == 1 and res.row.metrics["root_tool_error_count"] == 1
    assert json.dumps(res.trajectory) == recorded  # nothing was appended once the result was returned


DEEP_CELL = """
import json
refused, answered = [], 0
for depth in range(900, 1000, 3):
    value = []
    for _ in range(depth):
        value = [value]
    try:
        echo(value)
        answered += 1
    except RecursionError:  # the stub's own encoding, in the REPL (a RuntimeError too: first)
        pass
    except RuntimeError as exc:
        if "HTTP 400" not in str(exc):  # "nested too deeply": refused before it runs, fine
            refused.append([depth, str(exc)[:120]])
answer["content"] = json.dumps({"refused": refused, "answered": answered})
answer["ready"] = True
"""


def echo(value: Any) -> Any:
    """Give the value back."""
    return value


async def test_arguments_nested_just_under_the_parsers_limit_are_run_and_recorded(tool_fleet: LocalFleet) -> None:
    row = DatasetRow(id="deep", question="Deep. " + root_code_directive(DEEP_CELL), context="x")
    async with RLMEnv(settings=settings_of(tool_fleet), root_tools=[echo]) as env:
        res = await env.rollout(row, model=tool_fleet.model)
    assert res.row.stop_reason == "answer_ready", res.row.error
    got = json.loads(str(res.row.final_answer))
    assert got["refused"] == [] and got["answered"] > 0, got  # no HTTP 500 at any depth
    events = [e for e in res.trajectory if e["type"] == "root_tool"]
    assert len(events) == res.row.metrics["root_tool_call_count"] == res.row.metrics["echo_root_calls"]


def search(flags: str) -> str:
    """Search the index with command-line flags (``--k 3``)."""
    parser = argparse.ArgumentParser(prog="search")
    parser.add_argument("--k", type=int)
    return str(parser.parse_args(flags.split()).k)


QUIT_CELL = """
out = []
for flags in ("--k many", "--k 3"):
    try:
        out.append(search(flags))
    except RuntimeError as exc:
        out.append(str(exc))
answer["content"] = " || ".join(out)
answer["ready"] = True
"""


async def test_a_tool_that_calls_sys_exit_fails_the_call_not_the_producer(tool_fleet: LocalFleet) -> None:
    # argparse given flags it refuses calls sys.exit(2): a model can choose such arguments.
    row = DatasetRow(id="quit", question="Quit. " + root_code_directive(QUIT_CELL), context="x")
    async with RLMEnv(settings=settings_of(tool_fleet), root_tools=[search]) as env:
        res = await env.rollout(row, model=tool_fleet.model)
    assert res.row.stop_reason == "answer_ready", res.row.error
    assert res.row.final_answer == "search raised SystemExit: 2 || 3"
    assert res.row.metrics["root_tool_error_count"] == 1 and res.row.metrics["search_root_calls"] == 2
