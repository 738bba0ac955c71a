"""The bash REPL (``repl_language="bash"``, producer/repl_child/bash.py): the reference's meanings and
the same containment as the Python REPL.

Meanings (verifiers RLMEnv 0.1.14's bash worker): every cell a fresh bash in the directory the
last one ended in; ``ANSWER_CONTENT`` / ``ANSWER_READY`` carried from cell to cell, ready for
``1``/``true``/``yes``/``y``/``on``; other shell variables not carried; ``llm_batch``,
``rlm_batch`` and root tools as commands printing JSON; the context files in the working
directory. Containment, each probe written in bash against a real REPL, with namespaces (this
machine runs the tests as root) and without where the fallback reaches it too: TCP to a local
Redis (``/dev/tcp``), the producer's environment, writes outside, host processes, host Unix
sockets, a user namespace of its own; a runaway cell times out and the REPL comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from rlmq.common.redis_server import EmbeddedRedis
from rlmq.common.schemas import DatasetRow
from rlmq.producer.interception import InterceptionServer
from rlmq.producer.repl import Repl
from rlmq.producer.repl.files import context_files, repl_context

ROOT = os.geteuid() == 0
MiB = 1024**2


@pytest.fixture(params=[True, False], ids=["namespaces", "no-namespaces"])
def namespaces(request: pytest.FixtureRequest) -> bool:
    if request.param and not ROOT:
        pytest.fail("the namespace mode of these tests runs as root (CI's normal machine)")
    return bool(request.param)


@pytest.fixture
async def icpt() -> AsyncIterator[InterceptionServer]:
    server = InterceptionServer(max_batch_bytes=4 * MiB)
    await server.start()
    yield server
    await server.stop()


@contextlib.asynccontextmanager
async def bash_repl(namespaces: bool, icpt: InterceptionServer, row: DatasetRow, **kw: Any) -> AsyncIterator[Repl]:
    holder: list[Repl] = []
    seen: list[list[str]] = []

    async def handle(prompts: list[str]) -> tuple[list[str], str]:
        async with holder[0].serving():
            seen.append(prompts)
            return [p.upper() for p in prompts], f"[{len(prompts)} ok]"

    token = icpt.register(handle)
    repl = Repl(
        context=repl_context(row), files=context_files(row), endpoint_url=icpt.url,
        unix_socket=icpt.unix_path_of(token), token=token, namespaces=namespaces, language="bash",
        code_execution_timeout=kw.pop("code_execution_timeout", 20), memory_bytes=512 * MiB,
        max_processes=32, scratch_bytes=64 * MiB, **kw,
    )  # fmt: skip
    holder.append(repl)
    try:
        await repl.start()
        yield repl
    finally:
        await repl.close()
        icpt.unregister(token)


def row(context: Any = "hay\nneedle 4711\nhay\n") -> DatasetRow:
    return DatasetRow(id="b", question="q", context=context)


async def test_cells_keep_directory_and_answer_but_not_variables(namespaces: bool, icpt: InterceptionServer) -> None:
    async with bash_repl(namespaces, icpt, row()) as repl:
        first = await repl.execute('grep -o "needle [0-9]*" context.txt; mkdir -p work; cd work; X=1; '
                                   'export ANSWER_CONTENT="draft"')  # fmt: skip
        assert first.output == "needle 4711\n" and not first.answer_ready
        assert first.answer_content == "draft"
        second = await repl.execute(
            'echo "pwd=$(basename "$PWD") X=${X-unset} A=$ANSWER_CONTENT"; export ANSWER_READY=0'
        )
        assert second.output == "pwd=work X=unset A=draft\n"
        assert not second.answer_ready  # "0" is not ready
        third = await repl.execute(
            'export ANSWER_CONTENT="$(cat ../context.txt | grep -c hay)"; export ANSWER_READY=True'
        )
        assert third.answer_ready and third.answer_content == "2"


async def test_exit_and_syntax_errors_keep_the_last_state(namespaces: bool, icpt: InterceptionServer) -> None:
    async with bash_repl(namespaces, icpt, row()) as repl:
        await repl.execute('export ANSWER_CONTENT="kept"')
        out = await repl.execute("echo before; exit 3; echo after")
        assert out.output == "before\n" and out.answer_content == "kept" and not out.restarted
        bad = await repl.execute("if then fi")
        assert "syntax error" in bad.output and bad.answer_content == "kept"
        gone = await repl.execute("trap - EXIT; unset __RLMQ_STATE; export ANSWER_CONTENT=forged")
        assert gone.answer_content == "kept" and "without its state" in gone.output


async def test_llm_batch_as_a_command(namespaces: bool, icpt: InterceptionServer) -> None:
    async with bash_repl(namespaces, icpt, row()) as repl:
        args = await repl.execute('llm_batch "first prompt" "second ü"')
        assert args.output.splitlines()[-1] == json.dumps(["FIRST PROMPT", "SECOND Ü"])
        assert "[2 ok]" in args.output  # the summary, on stderr
        piped = await repl.execute(
            'llm_batch --json \'{"prompts": ["a", "b", "c"]}\' 2>/dev/null\n'
            "printf 'x\\ny\\n' | llm_batch --lines 2>/dev/null\n"
            "head -c 30000 context.txt | llm_batch 2>/dev/null | wc -c\n"
            "export ANSWER_CONTENT=\"$(llm_batch 'the answer' 2>/dev/null)\"; export ANSWER_READY=1"
        )
        lines = piped.output.splitlines()
        assert lines[:2] == ['["A", "B", "C"]', '["X", "Y"]'] and int(lines[2]) > 10
        assert piped.answer_ready and piped.answer_content == '["THE ANSWER"]'
        refused = await repl.execute("llm_batch; echo status=$?")
        assert "Error: no prompts" in refused.output and "status=1" in refused.output


async def test_a_runaway_cell_times_out_and_the_repl_comes_back(namespaces: bool, icpt: InterceptionServer) -> None:
    async with bash_repl(namespaces, icpt, row(), code_execution_timeout=2) as repl:
        late = await repl.execute("sleep 60 & sleep 60")
        assert late.timed_out and late.restarted
        back = await repl.execute("cat context.txt | wc -l")
        assert back.output == "3\n"
        quick = await repl.execute("sleep 30 & echo started")  # a background job does not hold the cell up
        assert quick.output == "started\n" and not quick.timed_out


async def test_bash_reaches_no_local_tcp_port(namespaces: bool, icpt: InterceptionServer) -> None:
    with EmbeddedRedis() as server:
        async with bash_repl(namespaces, icpt, row()) as repl:
            res = await repl.execute(
                f"if exec 3<>/dev/tcp/127.0.0.1/{server.port}; then printf 'PING\\r\\n' >&3; "
                "echo CONNECTED; head -c 7 <&3; else echo REFUSED; fi"
            )
    if namespaces:
        assert "REFUSED" in res.output and "CONNECTED" not in res.output, res.output
    else:  # the fallback reaches it, as the Python REPL's does (and says so)
        assert "PONG" in res.output


async def test_bash_sees_no_secret_and_writes_nothing_outside(namespaces: bool, icpt: InterceptionServer) -> None:
    os.environ["RLMQ_TEST_SECRET"] = "s3cret"  # in the producer's environment: must not reach the cell
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    target = os.path.join(repo, "pwned-by-bash")
    try:
        async with bash_repl(namespaces, icpt, row()) as repl:
            res = await repl.execute(
                "env | grep -c s3cret; id -u\n"
                f"cat /proc/{os.getpid()}/environ >/dev/null 2>&1 && echo READ-PRODUCER || echo REFUSED-PRODUCER\n"
                f"echo x > {target} 2>/dev/null && echo WROTE || echo REFUSED-WRITE\n"
                "unshare --user --map-root-user true 2>/dev/null && echo UNSHARED || echo REFUSED-UNSHARE"
            )
    finally:
        del os.environ["RLMQ_TEST_SECRET"]
    if os.path.exists(target):
        os.unlink(target)
        pytest.fail("the bash REPL wrote outside its folder")
    lines = res.output.split()
    assert lines[0] == "0", res.output
    assert ROOT and int(lines[1]) >= 100_000, res.output  # a uid of its own
    assert "REFUSED-PRODUCER" in lines and "REFUSED-WRITE" in lines and "REFUSED-UNSHARE" in lines, res.output


async def test_bash_sees_no_host_process_and_no_host_unix_socket(icpt: InterceptionServer) -> None:
    path = f"/run/rlmq-bash-{uuid.uuid4().hex[:12]}.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    try:
        async with bash_repl(True, icpt, row()) as repl:
            res = await repl.execute(
                f"ls /proc | grep -c '^[0-9]'; test -e /proc/{os.getpid()} && echo SEEN || echo HIDDEN\n"
                f"test -S {path} && echo SOCKET || echo NO-SOCKET"
            )
    finally:
        server.close()
        os.unlink(path)
    count, seen, sock = res.output.split()
    assert int(count) < 40 and seen == "HIDDEN" and sock == "NO-SOCKET", res.output


async def test_a_context_dir_in_bash(namespaces: bool, icpt: InterceptionServer, tmp_path: Any) -> None:
    (tmp_path / "docs").mkdir()
    for i in range(20):
        (tmp_path / "docs" / f"{i:02d}.txt").write_text(("filler " * 300) + (f"key={i * 7}" if i == 13 else ""))
    r = DatasetRow(id="d", question="q", context="", info={"context_dir": str(tmp_path)})
    async with bash_repl(namespaces, icpt, r) as repl:
        res = await repl.execute('export ANSWER_CONTENT="$(grep -rho "key=[0-9]*" docs)"; export ANSWER_READY=yes')
    assert res.answer_ready and res.answer_content == "key=91"


async def test_python_and_bash_repls_run_side_by_side(icpt: InterceptionServer) -> None:
    async with bash_repl(True, icpt, row()) as bash:
        python = Repl(context="ctx", endpoint_url=icpt.url, token="unused")
        async with python:
            both = await asyncio.gather(bash.execute("echo $((6 * 7))"), python.execute("6 * 7"))
    assert [c.output for c in both] == ["42\n", "42\n"]


async def test_a_long_answer_is_carried_and_commands_still_start(icpt: InterceptionServer) -> None:
    async with bash_repl(True, icpt, row()) as repl:
        first = await repl.execute("export ANSWER_CONTENT=\"$(head -c 300000 /dev/zero | tr '\\0' a)\"; echo set")
        assert first.output == "set\n" and len(first.answer_content) == 300_000
        second = await repl.execute(
            'echo ${#ANSWER_CONTENT}; ls context.txt; export ANSWER_READY="$(printf 1%.0s {1..200000})"'
        )
        assert second.output == "300000\ncontext.txt\n", second.output  # `ls` started: no E2BIG
        assert second.answer_content == "a" * 300_000 and not second.answer_ready  # 200,000 ones: not "1"
        third = await repl.execute("echo ok; export ANSWER_READY=1")
        assert third.output == "ok\n" and third.answer_ready and len(third.answer_content) == 300_000
