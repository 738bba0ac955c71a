"""The root-tool endpoint (``POST /root_tool``) against a hostile cell, judged from the parent.

A real REPL (with namespaces, as root on the CI machine, and without: the fallback) whose
cell forges requests by hand on the interception socket, past the stub's own checks:
oversized bodies (with and without a Content-Length), malformed ones, a tool name the rollout
does not have, a guessed token, the token of a rollout without tools and the token of a
rollout that has ended. Each gets a clear 4xx and no tool runs; the REPL stays usable.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import textwrap
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from rlmq.producer.interception import InterceptionServer
from rlmq.producer.repl import Repl

ROOT = os.geteuid() == 0
LIMIT = 64 * 1024

FORGE = textwrap.dedent(
    """
    import gc, http.client, json, socket
    cells = [c.cell_contents for c in echo.__closure__]
    token = next(c for c in cells if isinstance(c, str) and len(c) > 30)
    path = next(o for o in gc.get_objects() if type(o).__name__ == "_UnixHandler")._path

    def post(body, tok=None, chunked=False):
        s = socket.socket(socket.AF_UNIX); s.connect(path)
        conn = http.client.HTTPConnection("localhost"); conn.sock = s
        headers = {"Authorization": "Bearer " + (tok or token), "Content-Type": "application/json"}
        if chunked:
            conn.request("POST", "/root_tool", iter([body]), headers, encode_chunked=True)
        else:
            conn.request("POST", "/root_tool", body, headers)
        r = conn.getresponse()
        return r.status, r.read().decode()[:200]

    big = json.dumps({"name": "echo", "args": ["x" * 100_000]}).encode()
    seen = {
        "ok": post(json.dumps({"name": "echo", "args": ["hi"]})),
        "oversized": post(big),
        "oversized_chunked": post(big, chunked=True),
        "not_json": post(b"{not json"),
        "args_not_a_list": post(json.dumps({"name": "echo", "args": "hi"})),
        "extra_field": post(json.dumps({"name": "echo", "run": "os.system"})),
        "bad_name": post(json.dumps({"name": "../../etc"})),
        "nested": post(b"[" * 30_000 + b"]" * 30_000),
        "unknown_tool": post(json.dumps({"name": "shell", "args": ["id"]})),
        "guessed_token": post(json.dumps({"name": "echo"}), tok="A" * 43),
        "no_tools_token": post(json.dumps({"name": "echo"}), tok=OTHER),
        "ended_token": post(json.dumps({"name": "echo"}), tok=ENDED),
    }
    try:
        echo("x" * 100_000)
    except ValueError as exc:
        seen["stub_refuses"] = str(exc)
    print("SEEN", json.dumps(seen))
    """
)


@pytest.fixture
async def icpt() -> AsyncIterator[InterceptionServer]:
    server = InterceptionServer(max_tool_bytes=LIMIT)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture(params=[True, False], ids=["namespaces", "no-namespaces"])
def namespaces(request: pytest.FixtureRequest) -> bool:
    if request.param and not ROOT:
        pytest.fail("the namespace mode of these tests runs as root (CI's normal machine)")
    return bool(request.param)


async def test_forged_root_tool_requests_get_a_clear_4xx_and_run_nothing(
    icpt: InterceptionServer, namespaces: bool
) -> None:
    calls: list[tuple[str, list[Any]]] = []

    async def batches(prompts: list[str]) -> tuple[list[str], str]:
        return prompts, ""

    async def tools(name: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[bool, str]:
        if name != "echo":
            raise LookupError(f"no root tool named {name!r}")
        calls.append((name, args))
        return True, json.dumps(args)

    token = icpt.register(batches, tools)
    other = icpt.register(batches)  # a live rollout without root tools
    ended = icpt.register(batches, tools)
    icpt.unregister(ended)  # a rollout that has ended
    repl = Repl(
        context="ctx",
        endpoint_url=icpt.url,
        unix_socket=icpt.unix_path_of(token),
        token=token,
        namespaces=namespaces,
        code_execution_timeout=60,
        tools=[{"name": "echo", "doc": "Echo."}],
        max_tool_bytes=LIMIT,
    )
    try:
        await repl.start()
        res = await repl.execute(f"OTHER = {other!r}\nENDED = {ended!r}\n" + FORGE)
        line = next((x for x in res.output.splitlines() if x.startswith("SEEN ")), None)
        assert line is not None, res.output
        seen = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(line[5:]).items()}
        assert seen["ok"] == (200, '{"result": ["hi"]}')
        for case, status in {
            "oversized": 413,
            "oversized_chunked": 413,
            "not_json": 400,
            "args_not_a_list": 400,
            "extra_field": 400,
            "bad_name": 400,
            "nested": 400,
            "unknown_tool": 404,
            "guessed_token": 401,
            "no_tools_token": 404,
            "ended_token": 401,
        }.items():
            assert seen[case][0] == status, (case, seen[case])
            assert '"error"' in seen[case][1], (case, seen[case])
        assert "at most 65536" in seen["stub_refuses"]
        assert calls == [("echo", ["hi"])]  # only the well-formed call ran
        alive = await repl.execute("echo('still', 1)")
        assert alive.output.strip() == "['still', 1]", alive.output
    finally:
        await repl.close()
        icpt.unregister(token)
        icpt.unregister(other)


async def test_arguments_that_arrive_in_pieces_are_read_whole(icpt: InterceptionServer) -> None:
    """A body split across TCP segments (a loaded REPL, a slow socket) is one request: it was
    read up to what had arrived, and the call refused as "not JSON"."""
    got: list[int] = []

    async def batches(prompts: list[str]) -> tuple[list[str], str]:
        return prompts, ""

    async def tools(name: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[bool, str]:
        got.append(len(args[0]))
        return True, json.dumps(len(args[0]))

    token = icpt.register(batches, tools)
    body = json.dumps({"name": "echo", "args": ["x" * 60_000]}).encode()
    head = (
        f"POST /root_tool HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()

    def post_in_two_pieces() -> str:
        with socket.create_connection(("127.0.0.1", icpt.port), timeout=30) as sock:
            sock.sendall(head + body[:1000])
            time.sleep(0.3)  # the condition, not a wait: the rest arrives later, as a second segment
            sock.sendall(body[1000:])
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        return data.decode()

    try:
        response = await asyncio.get_running_loop().run_in_executor(None, post_in_two_pieces)
    finally:
        icpt.unregister(token)
    assert response.startswith("HTTP/1.1 200"), response[:300]
    assert response.endswith('{"result": 60000}') and got == [60_000]
