"""Failing as users fail: the real ``rlmq`` command, one clear line, a documented exit code.

Exit codes (README, ``rlmq.cli.exits``): 0 ok, 1 rollouts ended in error, 2 a mistake in the
command or its input, 3 Redis unavailable, 4 anything else, 5 a model server or the queue's
workers missing (``test_preflight.py``), 6 sub-calls failed, 128+N a stop signal N.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlmq.cli.demo import needle_rows
from rlmq.cli.local import LocalFleet, ProcessGroup, child_env, rlmq_command, start_mock_llm
from rlmq.common.redis_server import EmbeddedRedis, _free_port
from rlmq.scripted.server import root_code_directive

pytestmark = pytest.mark.e2e

EARLIER = '{"id": "earlier", "final_answer": "kept"}\n'


def rlmq(
    *args: str, cwd: Path, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        rlmq_command(*args), cwd=cwd, env=child_env(env), capture_output=True, text=True, timeout=timeout
    )


def one_line(res: subprocess.CompletedProcess[str]) -> str:
    """The command's stderr, checked to be one ``rlmq:`` line and no traceback."""
    assert "Traceback" not in res.stderr + res.stdout, res.stderr
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("rlmq: "), res.stderr
    return lines[0]


@pytest.fixture
def ds(tmp_path: Path) -> Path:
    path = tmp_path / "ds.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in needle_rows(2, min_chars=5_000)))
    return path


@pytest.mark.parametrize(
    ("case", "expect"),
    [
        ("missing-dataset", "cannot read the dataset"),
        ("empty-dataset", "has no rows"),
        ("duplicate-ids", "twice"),
        ("bad-row", "not a dataset row"),
        ("missing-output-folder", "does not exist"),
        ("tool-not-importable", "tool 'no_such_module_xyz:f': cannot import it"),
        ("tool-named-like-a-builtin", "tool name 'print' is private or a Python builtin"),
        ("tool-module-syntax-error", "tool 'rlmq_t_syntax:f': cannot import it (SyntaxError: invalid syntax"),
        ("tool-module-raises", "tool 'rlmq_t_raises:f': cannot import it (RuntimeError: no index configured)"),
        ("tool-module-exits", "tool 'rlmq_t_exits:f': cannot import it (SystemExit: 0)"),
    ],
)
def test_a_mistake_gets_one_line_and_exit_2_before_anything_starts(
    case: str, expect: str, tmp_path: Path, ds: Path
) -> None:
    rows = ds.read_text().splitlines()
    dataset, output = "ds.jsonl", "rows.jsonl"
    if case == "missing-dataset":
        dataset = "nope.jsonl"
    elif case == "empty-dataset":
        ds.write_text("\n\n")
    elif case == "duplicate-ids":
        ds.write_text(rows[0] + "\n" + rows[0] + "\n")
    elif case == "bad-row":
        ds.write_text(rows[0] + '\n{"id": "x"}\n')
    elif case == "missing-output-folder":
        output = "no-such-folder/rows.jsonl"
    # An operator's tool module that does not import: broken, failing, or exiting on import.
    (tmp_path / "rlmq_t_syntax.py").write_text("def f(:\n    pass\n")
    (tmp_path / "rlmq_t_raises.py").write_text("raise RuntimeError('no index configured')\n")
    (tmp_path / "rlmq_t_exits.py").write_text("import sys\nsys.exit(0)\n")
    extra = {
        "tool-not-importable": ["--tool", "no_such_module_xyz:f"],
        "tool-named-like-a-builtin": ["--root-tool", "builtins:print"],
        "tool-module-syntax-error": ["--root-tool", "rlmq_t_syntax:f"],
        "tool-module-raises": ["--tool", "rlmq_t_raises:f"],
        "tool-module-exits": ["--root-tool", "rlmq_t_exits:f"],
    }
    (tmp_path / "rows.jsonl").write_text(EARLIER)
    args = ["run", dataset, "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--output", output, "--quiet"]
    args += extra.get(case, [])
    env = {"PYTHONPATH": str(tmp_path)}
    res = rlmq(*args, cwd=tmp_path, env=env)
    assert res.returncode == 2, res.stderr
    assert expect in one_line(res)
    assert "redis" not in res.stdout  # nothing was started: no embedded Redis, no worker
    assert (tmp_path / "rows.jsonl").read_text() == EARLIER
    verbose = rlmq(*args, "--verbose", cwd=tmp_path, env=env)
    assert verbose.returncode == 2 and "Traceback (most recent call last)" in verbose.stderr


def test_unreachable_redis_exit_3_names_it_and_keeps_earlier_output(tmp_path: Path, ds: Path) -> None:
    (tmp_path / "rows.jsonl").write_text(EARLIER)
    port = _free_port()
    url = f"redis://:hunter2@127.0.0.1:{port}/0"
    run = rlmq("run", "ds.jsonl", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--redis-url", url,
               "--output", "rows.jsonl", cwd=tmp_path)  # fmt: skip
    assert run.returncode == 3
    line = one_line(run)
    assert f"cannot reach Redis at redis://:***@127.0.0.1:{port}/0" in line and "hunter2" not in line
    assert (tmp_path / "rows.jsonl").read_text() == EARLIER  # a failed start destroys nothing
    status = rlmq("status", "--redis-url", url, cwd=tmp_path)
    assert status.returncode == 3 and f"127.0.0.1:{port}" in one_line(status)
    worker = rlmq("worker", "--redis-url", url, "--model", "m", "--base-url", "http://127.0.0.1:9/v1",
                  "--redis-wait", "1", cwd=tmp_path)  # fmt: skip
    assert worker.returncode == 3
    assert "retrying in" in worker.stderr and "waiting for Redis" in worker.stderr  # it waited, and said so
    assert worker.stderr.strip().splitlines()[-1].startswith("rlmq: cannot reach Redis")
    assert "hunter2" not in worker.stderr


@pytest.fixture
def locked_redis() -> Iterator[str]:
    """A private redis-server with a password; yields its URL without the password."""
    with EmbeddedRedis(password="s3cret-pw") as server:
        yield f"redis://127.0.0.1:{server.port}/0"


def test_password_protected_redis_gets_one_line_and_exit_3(locked_redis: str, tmp_path: Path, ds: Path) -> None:
    wrong = locked_redis.replace("redis://", "redis://:wrong-pw@")
    for url in (locked_redis, wrong):
        run = rlmq("run", "ds.jsonl", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--redis-url", url,
                   cwd=tmp_path)  # fmt: skip
        assert run.returncode == 3 and "refused" in one_line(run)
        status = rlmq("status", "--redis-url", url, cwd=tmp_path)
        assert status.returncode == 3 and "refused" in one_line(status)
        # a refused password is not worth waiting for: the worker exits at once
        worker = rlmq("worker", "--redis-url", url, "--model", "m", "--base-url", "http://127.0.0.1:9/v1",
                      cwd=tmp_path, timeout=60)  # fmt: skip
        assert worker.returncode == 3 and "refused" in worker.stderr and "retrying" not in worker.stderr
        assert "wrong-pw" not in run.stderr + status.stderr + worker.stderr
    right = locked_redis.replace("redis://", "redis://:s3cret-pw@")
    ok = rlmq("status", "--redis-url", right, "--json", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr


def test_every_rollout_failing_exits_1_and_the_error_names_the_server(tmp_path: Path, ds: Path) -> None:
    port = _free_port()  # nothing listens there
    # without the check before the rollouts (tests/e2e/test_preflight.py), each row pays its retries
    res = rlmq("run", "ds.jsonl", "--base-url", f"http://127.0.0.1:{port}/v1", "--model", "m", "--quiet",
               "--output", "rows.jsonl", "--run-dir", "run", "--no-preflight", cwd=tmp_path, timeout=180)  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    assert "rollouts ended in error (exit code 1)" in res.stderr
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["stop_reason"] for r in rows] == ["error", "error"]
    assert all(f"http://127.0.0.1:{port}/v1" in r["error"] for r in rows), rows[0]["error"]


TOOL_CODE = """
out = llm_batch(['Count these. [[mock:tool:count_words:{"text": "one two three four"}]] [[mock:echo-tool-result]]'])
answer["content"] = out[0]
answer["ready"] = True
"""


def test_run_sub_tool_is_offered_and_allowed_on_local_workers(tmp_path: Path) -> None:
    row = {"id": "tools", "question": "Tools. " + root_code_directive(TOOL_CODE), "context": "x"}
    (tmp_path / "ds.jsonl").write_text(json.dumps(row) + "\n")
    group = ProcessGroup()
    try:
        base = start_mock_llm(group)
        res = rlmq("run", "ds.jsonl", "--base-url", base, "--model", "scripted", "--quiet", "--output", "rows.jsonl",
                   "--sub-tool", "rlmq.workers.tools.count_words", cwd=tmp_path, timeout=180)  # fmt: skip
    finally:
        group.stop()
    assert res.returncode == 0, res.stdout + res.stderr
    (out,) = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert "tool result: 4" in out["final_answer"] and out["metrics"]["sub_llm_total_tool_calls"] == 1


class _KeyRecorder(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.seen.append(self.headers.get("Authorization", ""))
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"error": {"message": "recorded"}}).encode()
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("how", ["flag", "env"])
async def test_worker_sends_its_api_key(how: str, redis_url: str, tmp_path: Path) -> None:
    from rlmq.common import keys as K
    from rlmq.common.connection import async_client
    from rlmq.common.schemas import SubCallOptions
    from rlmq.producer.dispatch import BatchSpec, Dispatcher

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeyRecorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _KeyRecorder.seen = []
    model = f"key-{uuid.uuid4().hex[:6]}"
    base = f"http://127.0.0.1:{server.server_address[1]}/v1"
    fleet = LocalFleet(redis_url=redis_url, model=model, base_url=base, workers=0,
                       worker_env={"RLMQ_API_KEY": "sk-from-env"} if how == "env" else None)  # fmt: skip
    try:
        with fleet:
            fleet.start_worker("key-worker", ["--api-key", "sk-from-flag"] if how == "flag" else [])
            fleet.wait_for_workers(1)
            client = async_client(redis_url)
            spec = BatchSpec(
                rollout_id=f"k-{uuid.uuid4().hex[:6]}",
                batch_id="b1",
                queue=K.queue_name_for_model(model),
                sub_call_timeout=30,
                parallelism=1,
                call=SubCallOptions(model=model),
            )
            (result,) = await Dispatcher(client).run_batch(spec, ["Hello."])
            await client.aclose()
    finally:
        server.shutdown()
    assert result.status == "error"  # the recorder answers 400
    assert _KeyRecorder.seen and set(_KeyRecorder.seen) == {f"Bearer sk-from-{how}"}


class DroppingProxy:
    """A TCP proxy to a Redis that closes its first ``drops`` connections as soon as they are made
    (a connection the network dropped: "Connection closed by server"), then passes bytes through."""

    def __init__(self, target_port: int, drops: int) -> None:
        self.target_port, self.drops = target_port, drops
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.server.getsockname()[1])
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            self.accepted += 1
            if self.accepted <= self.drops:
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def test_a_first_redis_connection_dropped_by_the_network_is_retried(tmp_path: Path) -> None:
    """As a later drop is: the command retries with backoff, says so, and goes on (exit 3 only
    once the bounded wait is over); a refused connection (nothing listens) still fails at once."""
    with EmbeddedRedis() as server:
        proxy = DroppingProxy(server.port, drops=2)
        try:
            status = rlmq("status", "--redis-url", f"redis://127.0.0.1:{proxy.port}/0", "--json", cwd=tmp_path)
        finally:
            proxy.server.close()
    assert status.returncode == 0, status.stderr
    assert "retrying in" in status.stderr and "cannot reach Redis" in status.stderr, status.stderr
    assert proxy.accepted >= 3 and "queues" in json.loads(status.stdout)
