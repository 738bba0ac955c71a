"""Tests of the REPL sandbox (producer/repl/ and producer/repl_child/).

Each test starts real child interpreters; none needs the network (the interception
server is a tiny aiohttp app on 127.0.0.1 started here, in the test's own loop,
which also proves that a running cell never blocks the event loop).
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import zipfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from rlmq.common.errors import ReplError, ReplStartupError
from rlmq.producer.repl import Repl, truncate_output

TOKEN = "tok-123"
UNUSED_URL = "http://127.0.0.1:9/unused"


def make_repl(**kwargs: Any) -> Repl:
    options: dict[str, Any] = {"context": "ctx", "endpoint_url": UNUSED_URL, "token": TOKEN}
    options.update(kwargs)
    return Repl(**options)


@pytest.fixture
async def repl() -> AsyncIterator[Repl]:
    async with make_repl(context="the context") as r:
        yield r


# --------------------------------------------------------------------------- a fake interception server


@dataclass
class FakeServer:
    url: str
    requests: list[dict[str, Any]] = field(default_factory=list)
    delay: float = 0.0  # seconds the server takes to answer (a slow sub-LLM batch)
    repl: Repl | None = None  # whose timeout the serving pauses (as RLMEnv's batch handler does)


@pytest.fixture
async def server() -> AsyncIterator[FakeServer]:
    fake = FakeServer(url="")

    async def handle(request: web.Request) -> web.Response:
        body = await request.json()
        fake.requests.append({"authorization": request.headers.get("Authorization"), "body": body})
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"error": "invalid bearer token"}, status=401)
        prompts = body["prompts"]
        if "bad" in prompts:
            return web.Response(text="prompt 'bad' refused by policy", status=400)
        if "spent" in prompts:
            return web.json_response({"error": "sub-LLM token budget spent: 100/100"}, status=429)
        if fake.delay:
            if fake.repl is not None:
                async with fake.repl.serving():
                    await asyncio.sleep(fake.delay)  # a slow sub-LLM batch, served by the parent
            else:
                await asyncio.sleep(fake.delay)
        return web.json_response(
            {
                "results": [p.upper() for p in prompts],
                "summary": f"[batch of {len(prompts)}: ok]\n[3/100 sub-LLM completion tokens used]",
            }
        )

    app = web.Application()
    app.router.add_post("/rollouts/r1/llm_batch", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    fake.url = f"http://127.0.0.1:{port}/rollouts/r1/llm_batch"
    try:
        yield fake
    finally:
        await runner.cleanup()


# --------------------------------------------------------------------------- truncate_output


def test_truncate_output_keeps_head_and_adds_marker() -> None:
    assert truncate_output("abc", 3) == "abc"
    assert truncate_output("abcdef", 2) == "ab...\n[output truncated: 4 more characters]"
    assert truncate_output("", 0) == ""
    with pytest.raises(ValueError):
        truncate_output("x", -1)


def test_sweep_refuses_a_uid_that_is_not_a_repls_own() -> None:
    from rlmq.producer.repl.sweep import sweep_uid

    for uid in (0, os.getuid(), 65534, 99_999):
        with pytest.raises(ValueError, match="not a REPL's own"):
            sweep_uid(uid)


# --------------------------------------------------------------------------- cells


async def test_globals_persist_across_cells(repl: Repl) -> None:
    await repl.execute("x = 41\nimport math")
    result = await repl.execute("x += 1\nmath.sqrt(x * x)")
    assert result.output == "42.0\n"
    assert not result.restarted and not result.timed_out
    assert result.seconds >= 0


@pytest.mark.parametrize(
    "context",
    [
        "a long document\nwith lines ü",
        ["a", 1, None, {"k": [2]}],
        {"doc": "text", "n": 3, "nested": {"x": []}},
    ],
)
async def test_context_of_each_type(context: Any) -> None:
    async with make_repl(context=context) as r:
        result = await r.execute("import json; print(json.dumps(context, sort_keys=True))")
    assert json.loads(result.output) == context


async def test_context_of_a_few_megabytes() -> None:
    big = "0123456789" * 300_000
    async with make_repl(context=big) as r:
        result = await r.execute("len(context), context[-3:]")
    assert result.output == "(3000000, '789')\n"


def test_context_must_be_json() -> None:
    with pytest.raises(TypeError):
        make_repl(context={"x": object()})


async def test_last_expression_repr(repl: Repl) -> None:
    assert (await repl.execute("1 + 1")).output == "2\n"
    assert (await repl.execute("'s'")).output == "'s'\n"
    assert (await repl.execute("None")).output == ""
    assert (await repl.execute("print('p')")).output == "p\n"  # print returns None: no "None"
    assert (await repl.execute("y = 3")).output == ""
    assert (await repl.execute("y = 3\ny * 2  # comment")).output == "6\n"


async def test_stdout_stderr_and_traceback_are_captured(repl: Repl) -> None:
    code = (
        "import sys\n"
        "print('to stdout')\n"
        "print('to stderr', file=sys.stderr)\n"
        "def f():\n"
        "    raise ValueError('boom')\n"
        "f()\n"
    )
    output = (await repl.execute(code)).output
    assert output.index("to stdout") < output.index("to stderr") < output.index("Traceback")
    assert 'File "<cell-1>", line 6, in <module>' in output
    assert 'File "<cell-1>", line 5, in f' in output
    assert "raise ValueError('boom')" in output
    assert output.rstrip().endswith("ValueError: boom")
    assert "repl_child" not in output  # no internal frames


async def test_syntax_error_is_reported(repl: Repl) -> None:
    output = (await repl.execute("x = (")).output
    assert "SyntaxError" in output
    assert "repl_child" not in output and "ast.py" not in output


async def test_output_of_subprocesses_is_captured(repl: Repl) -> None:
    code = "import subprocess; _ = subprocess.run(['echo', 'from a subprocess'])"
    output = (await repl.execute(code)).output
    assert output == "from a subprocess\n"


async def test_system_exit_is_output_not_death(repl: Repl) -> None:
    await repl.execute("kept = 'yes'")
    result = await repl.execute("import sys; sys.exit(2)")
    assert "SystemExit: 2" in result.output
    assert not result.restarted
    assert (await repl.execute("kept")).output == "'yes'\n"


async def test_output_is_truncated_with_marker() -> None:
    async with make_repl(max_output_length=100) as r:
        result = await r.execute("print('a' * 250)")
        assert result.output == "a" * 100 + "...\n[output truncated: 151 more characters]"
        # the limit is per cell: the next cell starts afresh
        assert (await r.execute("print('b')")).output == "b\n"


async def test_answer_state_is_reported(repl: Repl) -> None:
    result = await repl.execute("answer['content'] = 'draft'")
    assert (result.answer_ready, result.answer_content) == (False, "draft")
    result = await repl.execute("answer['content'] = 42\nanswer['ready'] = 1")
    assert (result.answer_ready, result.answer_content) == (True, "42")
    result = await repl.execute("answer = 'not a dict'")
    assert (result.answer_ready, result.answer_content) == (False, "")


# --------------------------------------------------------------------------- restarts


async def test_timeout_restarts_with_state_reset() -> None:
    async with make_repl(context={"k": "v"}, code_execution_timeout=1.0) as r:
        await r.execute("x = 1\nanswer['content'] = 'half'")
        pid = r.pid
        result = await r.execute("print('started')\nwhile True: pass")
        assert result.timed_out and result.restarted
        assert result.output.startswith("started\n")
        assert "timed out after 1 s" in result.output and "restarted" in result.output
        assert (result.answer_ready, result.answer_content) == (False, "")
        assert 1.0 <= result.seconds < 10
        assert r.pid != pid and r.restarts == 1
        after = await r.execute("print('x' in globals(), context, answer)")
        assert after.output == "False {'k': 'v'} {'content': '', 'ready': False}\n"
        assert not after.restarted


async def test_os_exit_restarts(repl: Repl) -> None:
    await repl.execute("x = 1")
    result = await repl.execute("import os\nprint('before', end='')\nos._exit(3)")
    assert result.restarted and not result.timed_out
    assert result.output.startswith("before\n")
    assert "died (exit code 3)" in result.output
    after = await repl.execute("'x' in globals(), context")
    assert after.output == "(False, 'the context')\n"


async def test_killed_by_signal_restarts(repl: Repl) -> None:
    result = await repl.execute("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert result.restarted
    assert "SIGSEGV" in result.output
    assert (await repl.execute("1")).output == "1\n"


async def test_cpu_limit_kills_and_restarts() -> None:
    async with make_repl(cpu_seconds=1, code_execution_timeout=30.0) as r:
        result = await r.execute("while True: pass")
        assert result.restarted and not result.timed_out
        assert "SIGXCPU" in result.output and "CPU time limit of 1 s" in result.output
        assert (await r.execute("context")).output == "'ctx'\n"


async def test_memory_hog_gets_memory_error_and_repl_survives() -> None:
    async with make_repl(memory_bytes=512 * 1024**2) as r:
        await r.execute("kept = 7")
        result = await r.execute("x = bytearray(4 * 1024**3)")
        assert "MemoryError" in result.output
        assert not result.restarted
        assert (await r.execute("kept * 6")).output == "42\n"


async def test_cancelled_cell_kills_the_child_and_next_cell_works(repl: Repl) -> None:
    await repl.execute("x = 1")
    pid = repl.pid
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(repl.execute("import time\ntime.sleep(60)"), 0.5)
    result = await repl.execute("'x' in globals()")
    assert result.output == "False\n"
    assert repl.pid != pid


# --------------------------------------------------------------------------- isolation


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "no-namespaces"])
async def test_environment_has_no_secret_and_cwd_is_the_work_dir(
    monkeypatch: pytest.MonkeyPatch, namespaces: bool, tmp_path: Path
) -> None:
    monkeypatch.setenv("RLMQ_TEST_SECRET", "s3cret")
    monkeypatch.setenv("REDIS_URL", "redis://secret-host:6379/0")
    socket_dir = tmp_path / "ipc"
    socket_dir.mkdir()
    os.chmod(tmp_path, 0o755)
    r = make_repl(namespaces=namespaces, unix_socket=str(socket_dir / "llm_batch.sock"))
    async with r:
        workdir = r.workdir
        assert workdir is not None and os.path.isdir(workdir)
        assert os.path.basename(workdir).startswith("rlmq-repl-")
        code = (
            "import os, tempfile\n"
            "cmdline = open('/proc/self/cmdline', 'rb').read().decode()\n"
            "print(sorted(os.environ))\n"
            "print(os.getcwd(), os.environ['HOME'], tempfile.gettempdir())\n"
            "print('RLMQ_TEST_SECRET' in os.environ, 's3cret' in repr(dict(os.environ)))\n"
            f"print({TOKEN!r} in cmdline, 'REDIS_URL' in os.environ)\n"
        )
        lines = (await r.execute(code)).output.splitlines()
    allowed = {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED"}
    assert set(eval(lines[0])) == allowed  # noqa: S307 - our own repr of a list of str
    if namespaces:  # a private tmpfs: HOME and cwd in it, the host's /tmp hidden
        assert r.containment is not None and r.containment.private_fs, r.containment
        assert lines[1] == "/tmp/home /tmp/home /tmp"
    else:
        assert r.containment is not None and not r.containment.private_fs
        assert lines[1] == f"{workdir}/home {workdir}/home {workdir}/home"
    assert lines[2] == "False False"
    assert lines[3] == "False False"  # the token is not on the command line either
    assert not os.path.exists(workdir)
    assert r.closed and r.workdir is None
    await r.close()  # idempotent
    with pytest.raises(ReplError):
        await r.execute("1")


async def test_whole_process_group_is_killed_on_close() -> None:
    if not hasattr(os, "pidfd_open"):
        pytest.skip("needs os.pidfd_open")
    r = make_repl()
    await r.start()
    result = await r.execute("import subprocess\np = subprocess.Popen(['sleep', '300'])\np.pid")
    try:
        pidfd = os.pidfd_open(int(result.output))
    except OSError as exc:  # pragma: no cover - kernel without pidfd
        await r.close()
        pytest.skip(f"pidfd_open unavailable: {exc}")
    try:
        await r.close()
        # a pidfd becomes readable when its process exits: the grandchild died with the group
        readable, _, _ = select.select([pidfd], [], [], 10.0)
        assert readable == [pidfd]
    finally:
        os.close(pidfd)


async def test_startup_error_when_not_ready_in_time() -> None:
    r = make_repl(max_startup_wait_seconds=1e-4)
    with pytest.raises(ReplStartupError):
        await r.start()
    await r.close()


# --------------------------------------------------------------------------- llm_batch


async def test_llm_batch_posts_prompts_and_prints_summary(server: FakeServer) -> None:
    async with make_repl(endpoint_url=server.url) as r:
        result = await r.execute("out = llm_batch(['hello', 'wörld'])\nprint(out)")
    assert result.output == ("[batch of 2: ok]\n[3/100 sub-LLM completion tokens used]\n['HELLO', 'WÖRLD']\n")
    assert server.requests == [{"authorization": f"Bearer {TOKEN}", "body": {"prompts": ["hello", "wörld"]}}]


async def test_llm_batch_from_threads(server: FakeServer) -> None:
    code = (
        "from concurrent.futures import ThreadPoolExecutor\n"
        "with ThreadPoolExecutor(4) as pool:\n"
        "    outs = list(pool.map(lambda i: llm_batch([f'p{i}']), range(8)))\n"
        "outs"
    )
    async with make_repl(endpoint_url=server.url) as r:
        result = await r.execute(code)
    assert result.output.splitlines()[-1] == repr([[f"P{i}"] for i in range(8)])
    assert len(server.requests) == 8


async def test_llm_batch_errors_raise_runtime_error(server: FakeServer) -> None:
    async with make_repl(endpoint_url=server.url, token="wrong") as r:
        output = (await r.execute("llm_batch(['a'])")).output
    assert "RuntimeError" in output and "HTTP 401" in output and "invalid bearer token" in output
    assert "repl_child" not in output

    async with make_repl(endpoint_url=server.url) as r:
        output = (await r.execute("llm_batch(['bad'])")).output
        assert "RuntimeError: llm_batch failed (HTTP 400): prompt 'bad' refused by policy" in output
        code = "try:\n    llm_batch(['spent'])\nexcept RuntimeError as e:\n    print('caught:', e)"
        assert (await r.execute(code)).output == (
            "caught: llm_batch failed (HTTP 429): sub-LLM token budget spent: 100/100\n"
        )


async def test_llm_batch_type_errors(server: FakeServer) -> None:
    async with make_repl(endpoint_url=server.url) as r:
        output = (await r.execute("llm_batch('not a list')")).output
        assert "TypeError" in output and "list of str" in output
        assert (await r.execute("llm_batch([])")).output == "[]\n"
        assert server.requests == []
        # a prompt that is not a str is answered with an error; the others run (verifiers 0.1.14)
        output = (await r.execute("print(llm_batch(['ok', 1])[1])")).output
        assert "llm_batch prompt at index 1 must be a string, not int" in output
    assert len(server.requests) == 1


async def test_llm_batch_unreachable_server(repl: Repl) -> None:
    output = (await repl.execute("llm_batch(['a'])")).output
    assert "RuntimeError: llm_batch could not reach the sub-LLM service" in output


async def test_llm_batch_time_does_not_count_toward_timeout(server: FakeServer) -> None:
    """The parent pauses a cell's timeout while it serves that REPL's llm_batch (its own account)."""
    server.delay = 0.8
    async with make_repl(endpoint_url=server.url, code_execution_timeout=0.5) as r:
        server.repl = r
        result = await r.execute("llm_batch(['slow'])")
        assert result.output.endswith("['SLOW']\n") and not result.timed_out
        # a serving that is not the parent's (nobody wraps it in serving()) pauses nothing
        server.repl = None
        result = await r.execute("llm_batch(['slow'])")
        assert result.timed_out and result.restarted
    async with make_repl(
        endpoint_url=server.url, code_execution_timeout=0.5, pause_timeout_during_llm_batch=False
    ) as r:
        server.repl = r
        result = await r.execute("llm_batch(['slow'])")
        assert result.timed_out and result.restarted


# --------------------------------------------------------------------------- pip_install_packages


def _make_wheel(directory: Path) -> Path:
    """A minimal pure-Python wheel, installable offline."""
    path = directory / "rlmqdemo-0.1-py3-none-any.whl"
    info = "rlmqdemo-0.1.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("rlmqdemo/__init__.py", "VALUE = 42\n")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: rlmqdemo\nVersion: 0.1\n")
        z.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(
            f"{info}/RECORD",
            f"rlmqdemo/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n",
        )
    return path


async def test_pip_install_packages_from_a_local_wheel(tmp_path: Path) -> None:
    wheel = _make_wheel(tmp_path)
    async with make_repl(pip_install_packages=[str(wheel)]) as r:
        code = "import os, rlmqdemo\nrlmqdemo.VALUE, os.environ['PYTHONPATH'].endswith('/site-packages')"
        result = await r.execute(code)
        assert result.output == "(42, True)\n"
        # still importable after a restart
        await r.execute("import os; os._exit(1)")
        assert (await r.execute("import rlmqdemo; rlmqdemo.VALUE")).output == "42\n"


async def test_pip_install_failure_is_a_startup_error(tmp_path: Path) -> None:
    r = make_repl(pip_install_packages=[str(tmp_path / "missing-0.1-py3-none-any.whl")])
    with pytest.raises(ReplStartupError, match="pip install"):
        await r.start()
    await r.close()
