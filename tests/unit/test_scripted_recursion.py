"""The scripted model's recursive needle search (rlmq/scripted/recursion.py) and the needle dataset."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.needle import main as needle_main
from bench.needle import needle_rows, question_for
from rlmq.scripted.recursion import (
    NO_NEEDLE,
    needle_answer,
    recursion_of,
    rlm_format_reply,
    scaffold_line,
    split_parts,
    split_root_code,
)
from rlmq.scripted.server import ScriptedModelServer

ROOT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "call_python_repl",
            "description": "Run Python code.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    }
]


def test_scaffold_line_round_trips_and_tolerates_wording() -> None:
    assert scaffold_line(1, 3) == "rlm_batch: recursive (depth 1 of 3)"
    assert scaffold_line(3, 3) == "rlm_batch: plain sub-LLM calls (depth 3 of 3)"
    for depth in (1, 2, 3):
        got = recursion_of(f"You are a root.\n{scaffold_line(depth, 3)}\nMore text.")
        assert (got.recurses, got.depth, got.max_depth) == (depth < 3, depth, 3)
    assert recursion_of("RLM_BATCH:  Recursive ( depth 2  of 4 )").recurses
    assert not recursion_of("rlm_batch(tasks) starts child rollouts").recurses  # no marker line: no recursion
    assert recursion_of("") == recursion_of("rlm_batch: plain sub-LLM calls")
    # without the line: prose about rlm_batch that says the depth
    prose = recursion_of("`rlm_batch(tasks)` ... child RLM ... You are at depth 2 of 3, so your children ...")
    assert (prose.recurses, prose.depth, prose.max_depth) == (True, 2, 3)
    assert not recursion_of("rlm_batch ... You are at the deepest level (3 of 3): plain sub-LLM calls").recurses
    assert not recursion_of("You are at depth 1 of 3.").recurses  # no rlm_batch in it: not about recursion


def test_needle_answer_and_split_directive() -> None:
    assert needle_answer("Find it.\nLine 7: the secret code is amber-4821 and nobody knows.") == "amber-4821"
    assert needle_answer("what is the secret code hidden in the context? [[mock:rlm-split:4]]") == NO_NEEDLE
    assert needle_answer("[[mock:needle]] The Secret Code is X_1.") == "X_1"
    assert split_parts("q [[mock:rlm-split:7]]") == 7
    assert split_parts("q [[mock:rlm-split:0]]") == 1
    assert split_parts("q [[mock:rlm-split:99999]]") == 1000
    assert split_parts("no directive") is None
    # one K per depth, the last one for the deeper levels
    assert [split_parts("q [[mock:rlm-split:4,5,60]]", d) for d in (None, 1, 2, 3, 4)] == [4, 4, 5, 60, 60]
    assert split_parts("q [[mock:rlm-split:3]]", 3) == 3


def run_code(code: str, context: Any, **functions: Callable[..., list[str]]) -> dict[str, Any]:
    answer: dict[str, Any] = {"content": "", "ready": False}
    namespace: dict[str, Any] = {"context": context, "answer": answer, **functions}
    exec(compile(code, "<root>", "exec"), namespace)  # the code a root turn would run in its REPL
    return answer


def leaf_llm_batch(prompts: list[str]) -> list[str]:
    return [needle_answer(p) for p in prompts]


def tree(question: str, context: Any, depth: int, max_depth: int, counts: dict[str, int]) -> str:
    """One rollout of the tree in process: the root code at ``depth``, its rlm_batch running children."""
    counts[f"rollouts_depth_{depth}"] = counts.get(f"rollouts_depth_{depth}", 0) + 1

    def rlm_batch(tasks: list[dict[str, Any]]) -> list[str]:
        assert all(t["prompt"] == question for t in tasks)
        return [tree(t["prompt"], t["context"], depth + 1, max_depth, counts) for t in tasks]

    def llm_batch(prompts: list[str]) -> list[str]:
        counts["leaves"] = counts.get("leaves", 0) + len(prompts)
        return leaf_llm_batch(prompts)

    system = scaffold_line(depth, max_depth)
    code = split_root_code(question, split_parts(question, depth) or 1, recurse=recursion_of(system).recurses)
    answer = run_code(code, context, rlm_batch=rlm_batch, llm_batch=llm_batch)
    assert answer["ready"] is True
    return str(answer["content"])


def test_one_split_per_depth_shapes_the_tree() -> None:
    row = needle_rows(1, 400, parts=1, seed=3)[0]
    question = str(row["question"]).replace("[[mock:rlm-split:1]]", "[[mock:rlm-split:2,3,7]]")
    counts: dict[str, int] = {}
    assert tree(question, row["context"], 1, 3, counts) == row["answer"]
    assert (counts["rollouts_depth_2"], counts["rollouts_depth_3"], counts["leaves"]) == (2, 6, 42)


@pytest.mark.parametrize("max_depth", [1, 2, 3])
def test_the_tree_finds_the_needle_at_every_depth(max_depth: int) -> None:
    row = needle_rows(1, 200, parts=3, seed=5)[0]
    counts: dict[str, int] = {}
    assert tree(row["question"], row["context"], 1, max_depth, counts) == row["answer"]
    assert counts["leaves"] == 3**max_depth
    for depth in range(1, max_depth + 1):
        assert counts[f"rollouts_depth_{depth}"] == 3 ** (depth - 1)


def test_split_code_parts_cover_the_context_and_skip_errors() -> None:
    seen: list[dict[str, Any]] = []

    def rlm_batch(tasks: list[dict[str, Any]]) -> list[str]:
        seen.extend(tasks)
        return ["[error] child failed", "none", "walnut-1234 tok tok", "NOT FOUND", ""]

    lines = [f"line {i}" for i in range(10)]
    answer = run_code(split_root_code("q [[mock:rlm-split:5]]", 5, recurse=True), "\n".join(lines), rlm_batch=rlm_batch)
    assert answer == {"content": "walnut-1234", "ready": True}
    assert [t["context"].splitlines() for t in seen] == [lines[i : i + 2] for i in range(0, 10, 2)]
    # a list context splits by items; fewer items than K: one part per item
    seen.clear()
    answer = run_code(split_root_code("q", 5, recurse=True), ["a", "b"], rlm_batch=rlm_batch)
    assert [t["context"] for t in seen] == [["a"], ["b"]]
    # recurse=True but no rlm_batch in the REPL: the leaf path
    answer = run_code(split_root_code("q", 2, recurse=True), "x\nthe secret code is k-1", llm_batch=leaf_llm_batch)
    assert answer["content"] == "k-1"


def test_the_rlm_format_root_code_runs_the_same_tree() -> None:
    row = needle_rows(1, 90, parts=3, seed=2)[0]
    leaves: list[str] = []

    def rlm_query_batched(prompts: list[str]) -> list[str]:
        leaves.extend(prompts)
        return [needle_answer(p) for p in prompts]

    block = rlm_format_reply(1)
    assert block.startswith("```repl\n") and block.endswith("```")
    code = block.removeprefix("```repl\n").removesuffix("```")
    answer = run_code(code, row["question"] + "\n" + row["context"], rlm_query_batched=rlm_query_batched)
    assert answer == {"content": row["answer"], "ready": True}
    assert len(leaves) == 3 and all(p.startswith(row["question"] + "\n") for p in leaves)
    assert 'answer["ready"] = True' in rlm_format_reply(2)


def test_needle_rows_are_deterministic(tmp_path: Path) -> None:
    rows = needle_rows(3, 50, parts=4, seed=7, leaf="tokens:2-9")
    assert rows == needle_rows(3, 50, parts=4, seed=7, leaf="tokens:2-9")
    for row in rows:
        lines = row["context"].splitlines()
        assert len(lines) == 50 and needle_answer(row["context"]) == row["answer"]
        assert sum("secret code" in line for line in lines) == 1
        assert row["question"] == question_for(4, "tokens:2-9") and "[[mock:tokens:2-9]]" in row["question"]
    out = tmp_path / "d.jsonl"
    assert needle_main(["--rows", "2", "--lines", "30", "--out", str(out), "--seed", "3"]) == 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == needle_rows(2, 30, seed=3)


# ------------------------------------------------------------------------------- the server


@pytest.fixture
async def server() -> AsyncIterator[ScriptedModelServer]:
    async with ScriptedModelServer() as srv:
        yield srv


async def chat(server: ScriptedModelServer, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{server.url}/chat/completions", json={"model": "m", "messages": messages, **extra}) as resp,
    ):
        assert resp.status == 200, await resp.text()
        body: dict[str, Any] = await resp.json()
        return body


def root_messages(system: str, question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def test_the_server_decides_recursion_from_the_scaffold_line(server: ScriptedModelServer) -> None:
    question = question_for(4)
    for depth, recurses in ((1, True), (2, True), (3, False)):
        body = await chat(server, root_messages(f"Scaffold.\n{scaffold_line(depth, 3)}", question), tools=ROOT_TOOLS)
        call = body["choices"][0]["message"]["tool_calls"][0]["function"]
        code = json.loads(call["arguments"])["code"]
        assert f"RECURSE = {recurses}" in code and "PARTS = 4" in code and repr(question) in code
        assert body["usage"]["completion_tokens"] == len(call["arguments"].split())
    later = root_messages(scaffold_line(1, 3), question) + [{"role": "assistant", "content": "x"}]
    body = await chat(server, later, tools=ROOT_TOOLS)
    assert "tool_calls" not in body["choices"][0]["message"]
    stats = server.stats
    assert stats["per_role"]["root"]["completions"] == 4 and stats["per_role"]["sub"]["completions"] == 0
    assert stats["root_requests_by_depth"] == {"1": 2, "2": 1, "3": 1}


async def test_leaf_needle_spend_all_and_early_stop(server: ScriptedModelServer) -> None:
    leaf = "Find it. [[mock:needle]]\n<text>\nthe secret code is garnet-5150\n</text>"
    body = await chat(server, [{"role": "user", "content": leaf}], max_tokens=50)
    assert body["choices"][0]["message"]["content"] == "garnet-5150"
    body = await chat(server, [{"role": "user", "content": leaf + " [[mock:tokens:6]]"}], max_tokens=50)
    assert body["choices"][0]["message"]["content"].split() == ["garnet-5150"] + ["tok"] * 5
    assert body["choices"][0]["finish_reason"] == "stop"
    body = await chat(server, [{"role": "user", "content": leaf + " [[mock:spend-all]]"}], max_tokens=37)
    assert body["usage"]["completion_tokens"] == 37 and body["choices"][0]["finish_reason"] == "length"
    body = await chat(server, [{"role": "user", "content": question_for(2) + "\nno code here"}])
    assert body["choices"][0]["message"]["content"] == NO_NEEDLE
    sub = server.stats["per_role"]["sub"]
    assert sub["completions"] == 4 and sub["completion_tokens"] == 1 + 6 + 37 + 1


async def test_an_rlm_format_root_gets_a_repl_block(server: ScriptedModelServer) -> None:
    messages = [
        {"role": "system", "content": "Write code in ```repl``` blocks."},
        {"role": "user", "content": "Answer the following."},
    ]
    body = await chat(server, messages)
    assert body["choices"][0]["message"]["content"] == rlm_format_reply(1)
    assert server.stats["per_role"]["root"]["completions"] == 1


# ------------------------------------------------------- a root without directives recurses when it can


async def test_a_plain_root_recurses_whenever_rlm_batch_starts_children(server: ScriptedModelServer) -> None:
    """No ``[[mock:...]]`` directive (the demo's rows): below max_depth the scripted root calls
    ``rlm_batch``; at max_depth, or without the scaffold line, it asks ``llm_batch`` per chunk."""
    from rlmq.cli.demo import needle_rows as demo_rows
    from rlmq.scripted.server import answer_from_chunk

    row = demo_rows(1, min_chars=30_000, seed=4)[0]
    question, context = str(row["question"]), str(row["context"])
    codes: dict[int, str] = {}
    for depth in (1, 2, 3):
        body = await chat(server, root_messages(f"Scaffold.\n{scaffold_line(depth, 3)}", question), tools=ROOT_TOOLS)
        codes[depth] = json.loads(body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])["code"]
    body = await chat(server, root_messages("A depth-1 scaffold that says nothing of children.", question),
                      tools=ROOT_TOOLS)  # fmt: skip
    flat = json.loads(body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])["code"]
    assert "rlm_batch(" in codes[1] and "rlm_batch(" in codes[2]
    assert "rlm_batch(" not in codes[3] and "llm_batch(" in codes[3] and "rlm_batch(" not in flat

    counts: dict[int, int] = {}

    def run(depth: int, prompt: str, ctx: Any) -> str:
        """One rollout of the tree, in process: depth's code with rlm_batch running children."""
        counts[depth] = counts.get(depth, 0) + 1

        def rlm_batch(tasks: list[dict[str, Any]]) -> list[str]:
            assert all(t["prompt"] == prompt for t in tasks)  # the question reaches every child verbatim
            return [run(depth + 1, t["prompt"], t["context"]) for t in tasks]

        def llm_batch(prompts: list[str]) -> list[str]:
            return [answer_from_chunk(p) for p in prompts]

        return str(run_code(codes[depth], ctx, rlm_batch=rlm_batch, llm_batch=llm_batch)["content"])

    assert run(1, question, context) == row["answer"]
    assert counts == {1: 1, 2: 2, 3: 4}  # two children per rollout above the deepest level
