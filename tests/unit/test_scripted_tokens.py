"""The scripted model's early-stopping answers: ``[[mock:tokens:N]]`` and ``[[mock:tokens:A-B]]``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from rlmq.scripted.server import ScriptedModelServer, answer_tokens


@pytest.fixture
async def server() -> AsyncIterator[ScriptedModelServer]:
    async with ScriptedModelServer() as srv:
        yield srv


async def completion(server: ScriptedModelServer, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], **extra}
    async with aiohttp.ClientSession() as session, session.post(f"{server.url}/chat/completions", json=body) as r:
        assert r.status == 200
        out: dict[str, Any] = await r.json()
        return out


async def test_a_fixed_length_answer_stops_early_or_is_cut_by_max_tokens(server: ScriptedModelServer) -> None:
    prompt = "What is the code of vault ORCHID?\nThe code of vault ORCHID is 48213. [[mock:tokens:250]]"
    body = await completion(server, prompt, max_tokens=4096)
    choice = body["choices"][0]
    assert (body["usage"]["completion_tokens"], choice["finish_reason"]) == (250, "stop")
    assert choice["message"]["content"].split()[0] == "48213"  # the real answer first, then filler
    cut = await completion(server, prompt, max_tokens=100)
    assert (cut["usage"]["completion_tokens"], cut["choices"][0]["finish_reason"]) == (100, "length")


async def test_random_lengths_are_drawn_per_prompt_in_range(server: ScriptedModelServer) -> None:
    prompts = [f"Item {i}. [[mock:tokens:1-400]]" for i in range(40)]
    lengths = [answer_tokens(p) for p in prompts]
    assert all(n is not None and 1 <= n <= 400 for n in lengths)
    assert len(set(lengths)) > 20  # they vary
    assert answer_tokens(prompts[0]) == lengths[0]  # and the same prompt always gets the same one
    for p, n in list(zip(prompts, lengths, strict=True))[:5]:
        body = await completion(server, p, max_tokens=1000)
        assert body["usage"]["completion_tokens"] == n
    assert answer_tokens("no directive") is None


async def test_stats_count_the_requests_in_flight_at_once_and_when_the_last_arrived(
    server: ScriptedModelServer,
) -> None:
    import asyncio
    import time

    assert (server.stats["in_flight_peak"], server.stats["last_request_at"]) == (0, None)
    before = time.time()
    await asyncio.gather(*(completion(server, f"slow {i} [[mock:sleep:0.3]]") for i in range(7)))
    stats = server.stats
    assert (stats["in_flight"], stats["in_flight_peak"]) == (0, 7)
    assert before <= stats["last_request_at"] <= stats["last_answered_at"] <= time.time()
    await completion(server, "one alone")
    assert server.stats["in_flight_peak"] == 7  # a high-water mark
    server.reset_stats()
    assert (server.stats["in_flight_peak"], server.stats["last_request_at"]) == (0, None)


async def test_a_paced_answer_takes_its_decoding_time_and_is_counted_under_its_tag(server: ScriptedModelServer) -> None:
    import time

    t0 = time.monotonic()
    body = await completion(server, "Item 1. [[mock:tokens:60]] [[mock:tps:200]] [[mock:tag:tree-a]]", max_tokens=100)
    took = time.monotonic() - t0
    assert body["usage"]["completion_tokens"] == 60 and 0.3 <= took < 5  # 60 tokens at 200 tokens/s
    await completion(server, "Item 2. [[mock:tokens:5]] [[mock:tag:tree-b]]", max_tokens=100)
    cut = await completion(server, "Item 3. [[mock:tokens:50]] [[mock:tag:tree-a]]", max_tokens=20)
    assert cut["usage"]["completion_tokens"] == 20
    per_tag = server.stats["per_tag"]
    assert {k: (v["requests"], v["completion_tokens"]) for k, v in per_tag.items()} == {
        "tree-a": (2, 80),
        "tree-b": (1, 5),
    }
