"""Tests of the scripted model server (rlmq/scripted/server.py), a test double of an OpenAI server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from rlmq.scripted.server import (
    MODEL_FINGERPRINT,
    NOT_FOUND,
    ROOT_FOLLOW_UP,
    ScriptedModelServer,
    answer_from_chunk,
    root_code_directive,
    root_code_for,
)

REPO = Path(__file__).resolve().parents[2]
ROOT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "call_python_repl",
            "description": "Run Python code in the REPL.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}},
                "required": ["code"],
            },
        },
    }
]
SUB_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a key up.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
        },
    }
]

QUESTION = "What is the secret passphrase of agent ZEPHYR-42? Reply with the passphrase only."
NEEDLE = "The secret passphrase of agent ZEPHYR-42 is cobalt-lantern-917."


def haystack(n_chars: int) -> str:
    """Deterministic filler text: Python's own documentation strings."""
    parts: list[str] = []
    size = 0
    for obj in (json, asyncio, subprocess, re, os, str, dict, list):
        for name in sorted(dir(obj)):
            doc = getattr(getattr(obj, name, None), "__doc__", None)
            if isinstance(doc, str) and doc.strip():
                parts.append(doc.strip())
                size += len(doc)
                if size >= n_chars:
                    return "\n\n".join(parts)[:n_chars]
    text = "\n\n".join(parts)
    return (text * (n_chars // max(len(text), 1) + 1))[:n_chars]


def insert_at(text: str, position: int, needle: str) -> str:
    return text[:position] + " " + needle + " " + text[position:]


def sub_prompt(question: str, chunk: str) -> str:
    return f"<question>\n{question}\n</question>\n\n<text>\n{chunk}\n</text>"


@pytest.fixture
async def server() -> AsyncIterator[ScriptedModelServer]:
    async with ScriptedModelServer() as srv:
        yield srv


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as sess:
        yield sess


async def chat(
    session: aiohttp.ClientSession, server: ScriptedModelServer, messages: list[dict[str, Any]], **extra: Any
) -> tuple[int, Any]:
    body = {"model": "test-model", "messages": messages, **extra}
    async with session.post(f"{server.url}/chat/completions", json=body) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text)
        except ValueError:
            return resp.status, text


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------------------- sub-LLM rule


@pytest.mark.parametrize(
    ("question", "needle", "expected"),
    [
        (QUESTION, NEEDLE, "cobalt-lantern-917"),
        (
            "What is the access code for the vault named ORCHID?",
            "The access code for the vault named ORCHID is 48213.",
            "48213",
        ),
        (
            "Which city was the treaty of Kelvara signed in?",
            "The treaty of Kelvara was signed in Port Alric, a small harbour town.",
            "Port Alric",
        ),
        (
            "What's ORCHID's vault access code?",
            "The access code for the vault named ORCHID is 48213.",
            "48213",
        ),
        (
            "What is the special magic number for long-context mentioned in the provided text?",
            "One of the special magic numbers for long-context is: 7093514.",
            "7093514",
        ),
        (
            "What is the favourite colour of the old lighthouse keeper?",
            "The favourite colour of the old lighthouse keeper is sea green.",
            "sea green",
        ),
        (
            "What is the passphrase of agent ZEPHYR-42?",
            "cobalt-lantern-917 is the secret passphrase of agent ZEPHYR-42.",
            "cobalt-lantern-917",
        ),
    ],
)
def test_answer_from_chunk_finds_the_needle(question: str, needle: str, expected: str) -> None:
    text = haystack(20_000)
    chunk = insert_at(text, text.find("\n", 9_000), needle)
    assert answer_from_chunk(sub_prompt(question, chunk)) == expected
    assert answer_from_chunk(sub_prompt(question, text)) == NOT_FOUND


def test_answer_from_chunk_prompt_shapes_and_distractors() -> None:
    fact = "The access code for the vault named ORCHID is 48213."
    filler = haystack(3_000)
    # question first line, question last line, labelled
    assert answer_from_chunk(f"What is the access code for vault ORCHID?\n{filler}\n{fact}\n{filler}") == "48213"
    assert answer_from_chunk(f"{filler}\n{fact}\nWhat is the access code for vault ORCHID?") == "48213"
    assert answer_from_chunk(f"Context:\n{filler} {fact}\nQuestion: What is the access code for ORCHID?") == "48213"
    # a fact about another name is not the answer
    other = "The access code for the vault named LOTUS is 11111."
    prompt = sub_prompt("What is the access code for the vault named ORCHID?", f"{filler}\n{other}\n")
    assert answer_from_chunk(prompt) == NOT_FOUND
    both = sub_prompt("What is the access code for the vault named ORCHID?", f"{other}\n{filler}\n{fact}")
    assert answer_from_chunk(both) == "48213"
    # directives are ignored
    assert answer_from_chunk("[[mock:status:500]] " + sub_prompt("Code of ORCHID?", fact)) == "48213"
    assert answer_from_chunk("hello") == NOT_FOUND


# ----------------------------------------------------------------------- root chunk script


def run_root_code(code: str, context: Any) -> tuple[dict[str, Any], list[str]]:
    """exec the root code with a fake REPL: llm_batch answers each prompt with answer_from_chunk."""
    prompts_seen: list[str] = []

    def llm_batch(prompts: list[str]) -> list[str]:
        prompts_seen.extend(prompts)
        return [answer_from_chunk(p) for p in prompts]

    namespace: dict[str, Any] = {
        "context": context,
        "llm_batch": llm_batch,
        "answer": {"content": "", "ready": False},
    }
    exec(compile(code, "<root>", "exec"), namespace)
    return namespace["answer"], prompts_seen


def test_root_code_on_str_list_dict_contexts() -> None:
    code = root_code_for(QUESTION)
    compile(code, "<root>", "exec")
    text = haystack(70_000)
    # the needle straddles the first chunk boundary (20,000): only the overlap keeps it whole
    boundary = insert_at(text, 20_000 - len(NEEDLE) // 2, NEEDLE)
    answer, prompts = run_root_code(code, boundary)
    assert answer == {"content": "cobalt-lantern-917", "ready": True}
    assert len(prompts) == 4 and all(QUESTION in p for p in prompts)

    items = [haystack(3_000 + 100 * i) for i in range(20)]
    items[13] = insert_at(items[13], 1_500, NEEDLE)
    answer, prompts = run_root_code(code, items)
    assert answer == {"content": "cobalt-lantern-917", "ready": True}
    assert 3 <= len(prompts) <= 6

    answer, _ = run_root_code(code, {"doc": text[:30_000], "notes": [NEEDLE]})
    assert answer == {"content": "cobalt-lantern-917", "ready": True}

    answer, _ = run_root_code(code, text)
    assert answer == {"content": "NOT FOUND", "ready": True}
    answer, prompts = run_root_code(code, [])
    assert answer == {"content": "NOT FOUND", "ready": True} and prompts == []


def test_root_code_majority_vote_ignores_errors() -> None:
    code = root_code_for("q")
    replies = ["NOT FOUND", "[error] model failed", "b", "[rejected] budget spent", "a", "b", "a"]
    namespace: dict[str, Any] = {
        "context": "x" * 140_000,  # 8 chunks
        "llm_batch": lambda prompts: replies[: len(prompts)],
        "answer": {"content": "", "ready": False},
    }
    exec(code, namespace)
    assert namespace["answer"] == {"content": "b", "ready": True}  # tie: first seen wins


# -------------------------------------------------------------------------------- server


async def test_usage_and_max_tokens(server: ScriptedModelServer, session: aiohttp.ClientSession) -> None:
    prompt = sub_prompt(
        "Which city was the treaty of Kelvara signed in?", "The treaty of Kelvara was signed in Port Alric."
    )
    status, body = await chat(session, server, [{"role": "system", "content": "be brief"}, *user(prompt)])
    assert status == 200
    assert body["object"] == "chat.completion" and body["model"] == "test-model"
    assert body["system_fingerprint"] == MODEL_FINGERPRINT
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Port Alric"}
    assert choice["finish_reason"] == "stop"
    words = len(prompt.split()) + 2
    assert body["usage"] == {"prompt_tokens": words, "completion_tokens": 2, "total_tokens": words + 2}

    status, body = await chat(session, server, user(prompt), max_tokens=1)
    assert body["choices"][0]["message"]["content"] == "Port"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 1
    status, body = await chat(session, server, user(prompt), max_tokens=5, max_completion_tokens=1)
    assert body["usage"]["completion_tokens"] == 1
    status, body = await chat(session, server, user(prompt), max_completion_tokens=2)
    assert body["choices"][0]["finish_reason"] == "stop"

    for bad in ({"max_tokens": 0}, {"max_completion_tokens": -3}, {"max_tokens": "9"}, {"stream": True}):
        status, body = await chat(session, server, user(prompt), **bad)
        assert status == 400
        assert set(body["error"]) >= {"message", "type"}
    status, body = await chat(session, server, [])
    assert status == 400


async def test_spend_all_directive_and_option(server: ScriptedModelServer, session: aiohttp.ClientSession) -> None:
    status, body = await chat(session, server, user("hi [[mock:spend-all]]"), max_tokens=37)
    assert body["choices"][0]["finish_reason"] == "length"
    assert len(body["choices"][0]["message"]["content"].split()) == 37
    assert body["usage"]["completion_tokens"] == 37

    async with ScriptedModelServer(spend_all=True) as spender:
        status, body = await chat(session, spender, user("What is X?"), max_completion_tokens=12)
        assert body["usage"]["completion_tokens"] == 12
        assert body["choices"][0]["finish_reason"] == "length"
        # the root is not affected: it still calls the REPL
        status, body = await chat(session, spender, user(QUESTION), tools=ROOT_TOOLS, max_tokens=4000)
        assert body["choices"][0]["finish_reason"] == "tool_calls"
        assert spender.stats["completion_tokens"] == 12 + body["usage"]["completion_tokens"]


async def test_root_turns(server: ScriptedModelServer, session: aiohttp.ClientSession) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You have a REPL."}, *user(QUESTION)]
    status, body = await chat(session, server, messages, tools=ROOT_TOOLS)
    assert status == 200
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "call_python_repl"
    code = json.loads(call["function"]["arguments"])["code"]
    assert code == root_code_for(QUESTION)
    assert body["usage"]["completion_tokens"] == len(call["function"]["arguments"].split())
    answer, _ = run_root_code(code, insert_at(haystack(45_000), 30_000, NEEDLE))
    assert answer == {"content": "cobalt-lantern-917", "ready": True}

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "1 chunk(s)"},
    ]
    status, body = await chat(session, server, messages, tools=ROOT_TOOLS)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ROOT_FOLLOW_UP}
    assert body["choices"][0]["finish_reason"] == "stop"

    # a root reply longer than the limit is cut and loses its tool call
    status, body = await chat(session, server, user(QUESTION), tools=ROOT_TOOLS, max_tokens=10)
    assert body["choices"][0]["finish_reason"] == "length"
    assert "tool_calls" not in body["choices"][0]["message"]
    assert body["usage"]["completion_tokens"] == 10


async def test_root_code_directives(server: ScriptedModelServer, session: aiohttp.ClientSession) -> None:
    first = "x = 41\nprint('hello')"
    second = "answer['content'] = str(x + 1)\nanswer['ready'] = True"
    question = f"Anything? {root_code_directive(first)} {root_code_directive(second, turn=2)}"
    messages: list[dict[str, Any]] = user(question)
    codes: list[str] = []
    for _turn in (1, 2):
        status, body = await chat(session, server, messages, tools=ROOT_TOOLS)
        (call,) = body["choices"][0]["message"]["tool_calls"]
        codes.append(json.loads(call["function"]["arguments"])["code"])
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "ok"},
        ]
    assert codes == [first, second]
    status, body = await chat(session, server, messages, tools=ROOT_TOOLS)  # turn 3: no code left
    assert "tool_calls" not in body["choices"][0]["message"]

    status, body = await chat(session, server, user("Q? [[mock:no-tool]]"), tools=ROOT_TOOLS)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert "tool_calls" not in body["choices"][0]["message"]

    status, body = await chat(session, server, user("[[mock:root-code:%%%]]"), tools=ROOT_TOOLS)
    assert status == 200  # not base64 alphabet: no directive, the chunk script runs
    status, body = await chat(session, server, user("[[mock:root-code:/w==]]"), tools=ROOT_TOOLS)
    assert status == 400  # bytes that are not UTF-8


async def test_sub_tool_directive(server: ScriptedModelServer, session: aiohttp.ClientSession) -> None:
    prompt = '[[mock:tool:lookup:{"key": "ORCHID"}]] [[mock:echo-tool-result]] ' + sub_prompt(
        "What is the access code for vault ORCHID?", "The access code for vault ORCHID is 48213."
    )
    messages: list[dict[str, Any]] = user(prompt)
    status, body = await chat(session, server, messages, tools=SUB_TOOLS)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "lookup", "arguments": '{"key": "ORCHID"}'}
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "vault ORCHID: row 7"},
    ]
    status, body = await chat(session, server, messages, tools=SUB_TOOLS)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == "48213\ntool result: vault ORCHID: row 7"
    # without tools offered the directive is ignored
    status, body = await chat(session, server, user(prompt))
    assert body["choices"][0]["message"]["content"] == "48213"


async def test_status_faults_with_fail_times(server: ScriptedModelServer, session: aiohttp.ClientSession) -> None:
    body = {"model": "m", "messages": user("Q? [[mock:status:429:retry-after=1]] [[mock:fail-times:2]]")}
    for _ in range(2):
        async with session.post(f"{server.url}/chat/completions", json=body) as resp:
            assert resp.status == 429
            assert resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["type"] == "rate_limit_error"
    async with session.post(f"{server.url}/chat/completions", json=body) as resp:
        assert resp.status == 200
    for code in (500, 503):
        for _ in range(3):  # no fail-times: always
            status, payload = await chat(session, server, user(f"Q? [[mock:status:{code}]]"))
            assert status == code and "message" in payload["error"]
    assert server.stats["faults"] == 8 and server.stats["completions"] == 1


async def test_malformed_no_usage_reset_sleep(server: ScriptedModelServer, session: aiohttp.ClientSession) -> None:
    status, payload = await chat(session, server, user("Q? [[mock:malformed]]"))
    assert status == 200 and isinstance(payload, str)

    status, payload = await chat(session, server, user("What is X? X is 5. [[mock:no-usage]]"))
    assert status == 200 and "usage" not in payload
    assert payload["choices"][0]["message"]["content"] == "5"
    assert server.stats["completion_tokens"] == 1  # still counted by the server

    for _ in range(2):
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await chat(session, server, user("Q? [[mock:reset]]"))
    prompt = "Q? [[mock:reset]] [[mock:fail-times:1]]"
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await chat(session, server, user(prompt))
    status, _ = await chat(session, server, user(prompt))
    assert status == 200

    # sleep: a client that gives up first sees a timeout; fail-times lets the retry through at once
    prompt = "Q? [[mock:sleep:30]] [[mock:fail-times:1]]"
    started = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(chat(session, server, user(prompt)), timeout=0.2)
    status, _ = await chat(session, server, user(prompt))
    assert status == 200 and time.monotonic() - started < 5


async def test_stats_per_user_and_model(server: ScriptedModelServer, session: aiohttp.ClientSession) -> None:
    prompt = "hi [[mock:spend-all]]"
    for rollout, n in (("rollout-a", 3), ("rollout-b", 1)):
        for _ in range(n):
            await chat(session, server, user(prompt), user=rollout, max_tokens=10)
    await chat(session, server, user("Q? [[mock:status:500]]"), user="rollout-b", max_tokens=10)
    await chat(session, server, user("no user field"), model="other-model", max_tokens=10)
    async with session.get(server.url.removesuffix("/v1") + "/stats") as resp:
        stats = await resp.json()
    assert stats == server.stats
    assert stats["requests"] == 6 and stats["completions"] == 5 and stats["faults"] == 1
    assert stats["per_user"]["rollout-a"] == {
        "requests": 3,
        "repeats": 2,  # the same conversation sent again (the user field is not part of it)
        "completions": 3,
        "faults": 0,
        "prompt_tokens": 6,
        "completion_tokens": 30,
    }
    assert stats["per_user"]["rollout-b"]["completion_tokens"] == 10
    assert stats["per_user"]["rollout-b"]["faults"] == 1
    assert stats["per_user"]["rollout-b"]["repeats"] == 1 and stats["repeats"] == 3
    assert stats["per_user"][""]["requests"] == 1
    assert stats["per_model"]["test-model"]["completion_tokens"] == 40
    assert stats["per_model"]["other-model"]["requests"] == 1
    assert stats["completion_tokens"] == 40 + stats["per_model"]["other-model"]["completion_tokens"]

    async with session.get(f"{server.url}/models") as resp:
        names = [m["id"] for m in (await resp.json())["data"]]
    assert names[0] == MODEL_FINGERPRINT and {"test-model", "other-model"} <= set(names)
    async with session.get(server.url.removesuffix("/v1") + "/health") as resp:
        assert resp.status == 200
    async with session.delete(server.url.removesuffix("/v1") + "/stats") as resp:
        assert (await resp.json())["requests"] == 0
    assert server.stats["per_user"] == {}
    await chat(session, server, user(prompt), user="rollout-a", max_tokens=10)
    assert server.stats["repeats"] == 0  # a reset forgets the conversations too


async def test_latency_option(session: aiohttp.ClientSession) -> None:
    async with ScriptedModelServer(latency=0.3) as slow:
        started = time.monotonic()
        status, _ = await chat(session, slow, user("hi"))
        assert status == 200 and time.monotonic() - started >= 0.3


async def test_openai_client_compatibility(server: ScriptedModelServer) -> None:
    client = openai.AsyncOpenAI(base_url=server.url, api_key="x", max_retries=0)
    try:
        completion = await client.chat.completions.create(
            model="any-name",
            messages=[{"role": "user", "content": QUESTION}],
            tools=ROOT_TOOLS,  # type: ignore[arg-type]
            max_completion_tokens=2000,
            user="rollout-openai",
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "tool_calls"
        assert message.tool_calls is not None
        call = message.tool_calls[0]
        assert call.function.name == "call_python_repl"  # type: ignore[union-attr]
        code = json.loads(call.function.arguments)["code"]  # type: ignore[union-attr]
        compile(code, "<root>", "exec")
        assert completion.usage is not None
        assert server.stats["per_user"]["rollout-openai"]["completion_tokens"] == completion.usage.completion_tokens

        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Q [[mock:status:429:retry-after=1]]"}]
            )
    finally:
        await client.close()


def test_serve_subprocess_port_zero() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "rlmq.scripted.server", "--port", "0"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            pattern = r"rlmq scripted model \(test double\) listening on (http://127\.0\.0\.1:(\d+)/v1)\n"
            match = re.fullmatch(pattern, line)
            assert match, line
            assert int(match.group(2)) > 0

            async def probe(url: str) -> int:
                async with aiohttp.ClientSession() as sess, sess.get(url.removesuffix("/v1") + "/health") as resp:
                    return resp.status

            assert asyncio.run(probe(match.group(1))) == 200
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
