"""The interception endpoint under random input (hypothesis, bounded: 300 examples), malformed
and oversized requests answered with a 4xx at once (a declared ``Content-Length`` far over the
limit, a body that never arrives, a prompt holding a lone surrogate), under uvloop and asyncio's
own loop, and a legitimate batch of 10,000 prompts through the real handler with the default limits.
``/rlm_batch`` gets the same treatment."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlmq.common.schemas import RlmTask
from rlmq.producer.interception import InterceptionServer


class Served:
    def __init__(
        self, server: InterceptionServer, token: str, calls: list[list[str]], rlm_calls: list[list[RlmTask]]
    ) -> None:
        self.server = server
        self.token = token
        self.calls = calls
        self.rlm_calls = rlm_calls


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    loop = uvloop.new_event_loop() if request.param == "uvloop" else asyncio.new_event_loop()
    server = InterceptionServer(max_batch_prompts=50, max_batch_bytes=64 * 1024, body_timeout=2.0)
    calls: list[list[str]] = []

    async def handler(prompts: list[str]) -> tuple[list[str], str]:
        calls.append(prompts)
        return [p[::-1] for p in prompts], "ok"

    rlm_calls: list[list[RlmTask]] = []

    async def rlm_handler(tasks: list[RlmTask]) -> tuple[list[str], str]:
        rlm_calls.append(tasks)
        return [t.prompt[::-1] for t in tasks], "ok"

    token = server.register(handler, None, rlm_handler)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    try:
        yield Served(server, token, calls, rlm_calls)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def post(s: Served, body: bytes, headers: dict[str, str], route: str = "/llm_batch") -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", s.server.port, timeout=10)
    try:
        conn.request("POST", route, body=body, headers=headers)
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
tasks = st.one_of(
    st.text(max_size=20),
    st.fixed_dictionaries({"prompt": st.text(max_size=20)}, optional={"context": json_values}),
    st.dictionaries(st.sampled_from(["prompt", "context", "x"]), json_values, max_size=3),
)
rlm_bodies = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(["tasks", "x"]), json_values, max_size=2).map(lambda v: json.dumps(v).encode()),
    st.lists(tasks, max_size=60).map(lambda t: json.dumps({"tasks": t}).encode()),
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


def valid_task(t: Any) -> bool:
    return (
        isinstance(t, dict)
        and isinstance(t.get("prompt"), str)
        and set(t) <= {"prompt", "context"}
        and (t.get("context") is None or isinstance(t["context"], (str, list, dict)))
    )


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=rlm_bodies, good_token=st.booleans())
def test_random_rlm_batch_requests_get_2xx_or_a_clear_4xx(served: Served, body: bytes, good_token: bool) -> None:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {served.token if good_token else 'x'}"}
    before = len(served.rlm_calls)
    status, payload = post(served, body, headers, "/rlm_batch")
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    valid = (
        good_token
        and isinstance(parsed, dict)
        and set(parsed) == {"tasks"}
        and isinstance(parsed["tasks"], list)
        and 0 < len(parsed["tasks"]) <= 50
        and all(valid_task(t) for t in parsed["tasks"])
    )
    if valid:
        assert status == 200, payload
        assert payload["results"] == [t["prompt"][::-1] for t in parsed["tasks"]]
        assert len(served.rlm_calls) == before + 1
    else:
        assert 400 <= status < 500, (status, payload)
        assert isinstance(payload, dict) and isinstance(payload.get("error"), str) and payload["error"]
        assert len(served.rlm_calls) == before


def test_server_survives_and_refuses_oversize(served: Served) -> None:
    status, payload = post(served, b"{" + b" " * (70 * 1024) + b"}", {"Authorization": f"Bearer {served.token}"})
    assert status == 413 and "bytes" in payload["error"]
    status, payload = post(
        served, json.dumps({"prompts": ["ok"]}).encode(), {"Authorization": f"Bearer {served.token}"}
    )
    assert status == 200 and payload["results"] == ["ko"]


def raw_exchange(s: Served, head: bytes, body: bytes, timeout: float) -> tuple[int, Any, float]:
    """Send ``head`` + ``body`` on a raw TCP connection, then wait (at most ``timeout`` s) for
    the answer: (status, JSON body, seconds until the answer's first byte)."""
    import socket
    import time

    with socket.create_connection(("127.0.0.1", s.server.port), timeout=timeout) as sock:
        sock.sendall(head + body)
        started = time.monotonic()
        first = sock.recv(65536)  # raises TimeoutError when no answer comes within `timeout`
        seconds = time.monotonic() - started
        data = first
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            more = sock.recv(65536)
            if not more:
                break
            data += more
    status = int(data.split(b" ", 2)[1])
    payload = json.loads(data.split(b"\r\n\r\n", 1)[1])
    return status, payload, seconds


@pytest.mark.parametrize("route", ["/llm_batch", "/rlm_batch"])
def test_a_huge_declared_content_length_gets_413_at_once(served: Served, route: str) -> None:
    """``Content-Length: 99999999999`` and one byte: 413 before any more of the body (the old
    server waited for the body until the client gave up)."""
    head = (
        f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {served.token}\r\nContent-Length: 99999999999\r\n\r\n"
    ).encode()
    before = len(served.calls), len(served.rlm_calls)
    status, payload, seconds = raw_exchange(served, head, b"{", timeout=5)
    assert status == 413 and "99999999999" in payload["error"], payload
    assert seconds < 1.5, seconds  # at once, not after the body timeout (2 s here)
    assert (len(served.calls), len(served.rlm_calls)) == before


@pytest.mark.parametrize("route", ["/llm_batch", "/rlm_batch"])
def test_a_body_that_never_arrives_gets_408_at_the_body_timeout(served: Served, route: str) -> None:
    head = (
        f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {served.token}\r\nContent-Length: 100\r\n\r\n"
    ).encode()
    status, payload, seconds = raw_exchange(served, head, b"{", timeout=10)
    assert status == 408 and "2 s" in payload["error"], payload
    assert seconds < 2 + 3, seconds


def test_a_lone_surrogate_gets_400_naming_the_prompt(served: Served) -> None:
    """A prompt holding ``"\\ud800"`` (valid JSON, not valid Unicode text): a 400 naming
    ``prompts[1]``, nothing enqueued; the old server failed the whole batch as a 503."""
    before = len(served.calls)
    body = b'{"prompts": ["fine", "bad \\ud800 here"]}'
    status, payload = post(served, body, {"Authorization": f"Bearer {served.token}"})
    assert status == 400 and "prompts[1]" in payload["error"] and "surrogate" in payload["error"], payload
    assert len(served.calls) == before
    status, payload = post(served, b'{"prompts": ["ok \\ud83d\\ude00"]}', {"Authorization": f"Bearer {served.token}"})
    assert status == 200, payload  # a surrogate pair is one character (an emoji): fine


def test_a_lone_surrogate_in_an_rlm_task_gets_400(served: Served) -> None:
    before = len(served.rlm_calls)
    auth = {"Authorization": f"Bearer {served.token}"}
    body = b'{"tasks": [{"prompt": "fine"}, {"prompt": "bad \\ud800 here"}]}'
    status, payload = post(served, body, auth, "/rlm_batch")
    assert status == 400 and "tasks[1].prompt" in payload["error"] and "surrogate" in payload["error"], payload
    status, payload = post(served, b'{"tasks": [{"prompt": "p", "context": {"k": "\\udfff"}}]}', auth, "/rlm_batch")
    assert status == 400 and "context" in payload["error"], payload
    assert len(served.rlm_calls) == before
    body = b'{"tasks": [{"prompt": "ok", "context": ["\\ud83d\\ude00"]}]}'
    status, payload = post(served, body, auth, "/rlm_batch")
    assert status == 200 and payload["results"] == ["ko"], payload


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


# --------------------------------------------------------------------------- many rollouts' connections

LOW_LIMIT_PRODUCER = r"""
import asyncio, json, os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))  # a host whose hard limit is 1,024
import uvloop
from rlmq.producer.interception import InterceptionServer

async def main():
    server = InterceptionServer()
    await server.start()
    async def handle(prompts):
        return [p.upper() for p in prompts], ""
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        if line.strip() == "new":  # a rollout starts: its socket and token
            token = server.register(handle)
            print(json.dumps({"path": server.unix_path_of(token), "token": token}), flush=True)
            continue
        try:  # can the producer still open a file?
            open(os.devnull).close()
            print(json.dumps({"open": "ok"}), flush=True)
        except OSError as exc:
            print(json.dumps({"open": repr(exc)}), flush=True)

(uvloop.run if sys.argv[1] == "uvloop" else asyncio.run)(main())
"""


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_many_rollouts_flooding_their_sockets_neither_exhaust_the_producer_nor_starve_a_victim(
    loop_kind: str, tmp_path: Any
) -> None:
    """40 rollouts start one after another in a producer whose open-files limit is 1,024, and
    each one's cell at once holds as many connections to its socket as it can (slowloris
    headers): the producer can still open a file and a 41st rollout's batch is answered.
    Before, each rollout kept 64 (40 × 64 = 2,560): the producer hit EMFILE and the victim's
    connection was refused."""
    import os
    import resource
    import socket
    import subprocess
    import sys

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    script = tmp_path / "producer.py"
    script.write_text(LOW_LIMIT_PRODUCER)
    proc = subprocess.Popen(
        [sys.executable, str(script), loop_kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert proc.stdout is not None and proc.stdin is not None
    stdin, stdout = proc.stdin, proc.stdout

    def ask(line: str) -> dict[str, str]:
        stdin.write(line + "\n")
        stdin.flush()
        return dict(json.loads(stdout.readline()))

    held: list[socket.socket] = []
    try:
        for _ in range(40):
            path = ask("new")["path"]
            alive = []
            for s in held:  # drop what the producer closed
                try:
                    gone = s.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:
                    s.close()
                else:
                    alive.append(s)
            held = alive
            for _ in range(64):
                s = socket.socket(socket.AF_UNIX)
                s.settimeout(10)
                try:
                    s.connect(path)
                    s.sendall(b"POST /llm_batch HTTP/1.1\r\nHost: x\r\n")
                except OSError:
                    s.close()
                    continue
                s.setblocking(False)  # a timeout would make the MSG_DONTWAIT peek above wait
                held.append(s)
        assert ask("?") == {"open": "ok"}
        victim = ask("new")
        body = b'{"prompts": ["v"]}'
        conn = socket.socket(socket.AF_UNIX)
        conn.settimeout(30)
        conn.connect(victim["path"])
        conn.sendall(
            b"POST /llm_batch HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
            % (victim["token"].encode(), len(body), body)
        )
        reply = b""
        while b'"results"' not in reply:
            chunk = conn.recv(4096)
            assert chunk, reply
            reply += chunk
        conn.close()
        assert reply.startswith(b"HTTP/1.1 200"), reply
        assert b'["V"]' in reply, reply
        assert ask("?") == {"open": "ok"}
    finally:
        for s in held:
            s.close()
        proc.kill()
        proc.wait(timeout=30)
