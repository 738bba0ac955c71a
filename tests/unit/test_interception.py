"""The interception server: tokens per rollout, validated and bounded bodies."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from rlmq.producer.interception import InterceptionServer


@pytest.fixture
async def server() -> AsyncIterator[InterceptionServer]:
    s = InterceptionServer(max_batch_prompts=100, max_batch_bytes=4096)
    await s.start()
    yield s
    await s.stop()


def handler_for(name: str, calls: list[tuple[str, list[str]]]):  # type: ignore[no-untyped-def]
    async def handle(prompts: list[str]) -> tuple[list[str], str]:
        calls.append((name, prompts))
        return [f"{name}:{p}" for p in prompts], f"summary of {len(prompts)}"

    return handle


async def post(url: str, token: str | None, body: object | bytes) -> tuple[int, dict[str, object]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s:
        if isinstance(body, bytes):
            resp = await s.post(url, data=body, headers=headers)
        else:
            resp = await s.post(url, json=body, headers=headers)
        return resp.status, await resp.json()


async def test_routes_by_token(server: InterceptionServer) -> None:
    calls: list[tuple[str, list[str]]] = []
    ta = server.register(handler_for("a", calls))
    tb = server.register(handler_for("b", calls))
    assert server.url.startswith("http://127.0.0.1:") and server.port > 0
    status, body = await post(server.url, ta, {"prompts": ["x", "y"]})
    assert status == 200 and body == {"results": ["a:x", "a:y"], "summary": "summary of 2"}
    status, body = await post(server.url, tb, {"prompts": ["z"]})
    assert body["results"] == ["b:z"]
    assert calls == [("a", ["x", "y"]), ("b", ["z"])]


@pytest.mark.parametrize(
    ("token", "body", "status", "needle"),
    [
        (None, {"prompts": ["x"]}, 401, "token"),
        ("wrong", {"prompts": ["x"]}, 401, "token"),
        ("OK", b"{not json", 400, "not JSON"),
        ("OK", {"prompts": [1, 2]}, 400, "prompts"),
        ("OK", {"prompts": "x"}, 400, "prompts"),
        ("OK", {"prompts": []}, 400, "empty"),
        ("OK", {"prompts": ["x"] * 101}, 413, "limit"),
        ("OK", {"prompts": ["x" * 5000]}, 413, "bytes"),
        ("OK", {"prompts": ["x"], "extra": 1}, 400, "prompts"),
    ],
)
async def test_bad_requests_are_refused_and_nothing_runs(
    server: InterceptionServer, token: str | None, body: object, status: int, needle: str
) -> None:
    calls: list[tuple[str, list[str]]] = []
    good = server.register(handler_for("a", calls))
    got, payload = await post(server.url, good if token == "OK" else token, body)
    assert got == status
    assert needle.lower() in str(payload["error"]).lower()
    assert calls == []
    ok, _ = await post(server.url, good, {"prompts": ["still up"]})
    assert ok == 200


async def test_unregistered_token_is_refused(server: InterceptionServer) -> None:
    calls: list[tuple[str, list[str]]] = []
    token = server.register(handler_for("a", calls))
    server.unregister(token)
    status, _ = await post(server.url, token, {"prompts": ["x"]})
    assert status == 401 and calls == []
