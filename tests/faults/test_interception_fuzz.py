"""The interception endpoint under random input (hypothesis, bounded: 300 examples), and a
legitimate batch of 10,000 prompts through the real handler with the default limits."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlmq.producer.interception import InterceptionServer


class Served:
    def __init__(self, server: InterceptionServer, token: str, calls: list[list[str]]) -> None:
        self.server = server
        self.token = token
        self.calls = calls


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    loop = asyncio.new_event_loop()
    server = InterceptionServer(max_batch_prompts=50, max_batch_bytes=64 * 1024)
    calls: list[list[str]] = []

    async def handler(prompts: list[str]) -> tuple[list[str], str]:
        calls.append(prompts)
        return [p[::-1] for p in prompts], "ok"

    token = server.register(handler)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    try:
        yield Served(server, token, calls)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def post(s: Served, body: bytes, headers: dict[str, str]) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", s.server.port, timeout=10)
    try:
        conn.request("POST", "/llm_batch", body=body, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw)
    finally:
        conn.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=8), kids, max_size=5),
    max_leaves=20,
)
bodies = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(["prompts", "x", "Prompts"]), json_values, max_size=3).map(
        lambda v: json.dumps(v).encode()
    ),
    st.lists(st.text(max_size=30), max_size=60).map(lambda p: json.dumps({"prompts": p}).encode()),
)
header_text = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=60)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies, token_kind=st.sampled_from(["good", "none", "random", "prefix"]), junk=header_text)
def test_random_requests_get_2xx_or_a_clear_4xx(served: Served, body: bytes, token_kind: str, junk: str) -> None:
    headers = {"Content-Type": "application/json"}
    if token_kind == "good":
        headers["Authorization"] = f"Bearer {served.token}"
    elif token_kind == "random":
        headers["Authorization"] = f"Bearer {junk}"
    elif token_kind == "prefix":
        headers["Authorization"] = junk
    before = len(served.calls)
    status, payload = post(served, body, headers)
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    valid = (
        token_kind == "good"
        and isinstance(parsed, dict)
        and set(parsed) == {"prompts"}
        and isinstance(parsed["prompts"], list)
        and 0 < len(parsed["prompts"]) <= 50
        and all(isinstance(p, str) for p in parsed["prompts"])
    )
    if valid:
        assert status == 200, payload
        assert payload["results"] == [p[::-1] for p in parsed["prompts"]]
        assert len(served.calls) == before + 1
    else:
        assert 400 <= status < 500, (status, payload)
        assert isinstance(payload, dict) and isinstance(payload.get("error"), str) and payload["error"]
        assert len(served.calls) == before  # nothing reached the batch handler (nothing enqueued)


def test_server_survives_and_refuses_oversize(served: Served) -> None:
    status, payload = post(served, b"{" + b" " * (70 * 1024) + b"}", {"Authorization": f"Bearer {served.token}"})
    assert status == 413 and "bytes" in payload["error"]
    status, payload = post(
        served, json.dumps({"prompts": ["ok"]}).encode(), {"Authorization": f"Bearer {served.token}"}
    )
    assert status == 200 and payload["results"] == ["ko"]


async def test_default_limits_admit_10000_prompts() -> None:
    server = InterceptionServer()  # the defaults
    seen: list[int] = []

    async def handler(prompts: list[str]) -> tuple[list[str], str]:
        seen.append(len(prompts))
        return [str(i) for i in range(len(prompts))], f"{len(prompts)} prompts"

    token = server.register(handler)
    await server.start()
    try:
        prompts = [f"Chunk {i}: " + "lorem ipsum dolor sit amet " * 200 for i in range(10_000)]  # ~54 MB
        async with aiohttp.ClientSession() as session:
            async with session.post(
                server.url, json={"prompts": prompts}, headers={"Authorization": f"Bearer {token}"}
            ) as resp:
                assert resp.status == 200, await resp.text()
                body = await resp.json()
        assert seen == [10_000] and len(body["results"]) == 10_000
    finally:
        await server.stop()
