"""Hostile cells in the REPL: each is contained, reported in the cell's output, and the REPL
(and so the rollout) goes on.

What is contained and how (``producer/repl.py``, ``producer/repl_child.py``):

* infinite loop: ``code_execution_timeout``; the REPL is restarted, state reset, and said so;
* fork bomb: RLIMIT_NPROC (``max_processes``, 64) refuses further forks with
  ``BlockingIOError``; a forked process that comes back to the REPL loop exits; everything the
  cell started is killed with the REPL (its process group, and every process of its uid);
* memory hog: RLIMIT_AS gives ``MemoryError``;
* ``os._exit``: the death is reported and the REPL restarted;
* writes outside its folder, reading the producer's environment: refused when the producer
  runs as root, because the child then drops to a uid of its own (``100000 + pid``) before
  any cell runs. As a normal user they are refused only by ordinary file permissions;
* a socket to Redis: refused. The REPL runs in a network namespace of its own (no interface
  up, not even loopback; as root directly, otherwise inside an unprivileged user namespace)
  and reaches the interception server only through its Unix socket; it holds no Redis URL or
  password either (its environment is built from scratch). Given no Unix socket, the REPL keeps
  the host's network (a test documents what then stays reachable).
"""

from __future__ import annotations

import os
import socket
import textwrap
from collections.abc import AsyncIterator

import pytest

from rlmq.common.redis_server import EmbeddedRedis
from rlmq.producer.repl import Repl
from tests.faults.conftest import process_gone, wait_until

ROOT = os.geteuid() == 0


@pytest.fixture
async def repl() -> AsyncIterator[Repl]:
    r = Repl(
        context="ctx",
        endpoint_url="http://127.0.0.1:9/llm_batch",
        token="t",
        code_execution_timeout=3,
        memory_bytes=512 * 1024**2,
        max_processes=32,
    )
    await r.start()
    yield r
    await r.close()


async def alive(repl: Repl) -> None:
    res = await repl.execute("x_alive = 41 + 1\nx_alive")
    assert res.output.strip() == "42", res.output


async def test_infinite_loop_times_out_and_restarts(repl: Repl) -> None:
    res = await repl.execute("while True:\n    pass")
    assert res.timed_out and res.restarted
    assert "timed out after 3 s" in res.output
    await alive(repl)


async def test_fork_bomb_is_refused_and_cleaned_up(repl: Repl) -> None:
    res = await repl.execute(
        textwrap.dedent(
            """
            import os, time
            n = 0
            while True:
                if os.fork() == 0:
                    time.sleep(600)
                    os._exit(0)
                n += 1
            """
        )
    )
    assert "BlockingIOError" in res.output, res.output
    assert not res.restarted
    res = await repl.execute("n")
    assert 0 < int(res.output.strip()) <= 32
    await alive(repl)
    # the classic bomb: every process forks until refused; forked copies never answer
    res = await repl.execute("import os\nwhile True:\n    os.fork()")
    assert "BlockingIOError" in res.output or res.restarted, res.output
    await alive(repl)
    pgid = repl.pid
    assert pgid is not None
    await repl.close()

    def group_gone() -> bool:
        for name in os.listdir("/proc"):
            if name.isdigit() and not process_gone(int(name)):
                try:
                    if os.getpgid(int(name)) == pgid:
                        return False
                except OSError:
                    pass
        return True

    wait_until(group_gone, 10, "the fork bomb's processes to be gone")


async def test_memory_hog_gets_memory_error(repl: Repl) -> None:
    res = await repl.execute("hog = bytearray(2 * 1024**3)")
    assert "MemoryError" in res.output
    assert not res.restarted
    await alive(repl)


async def test_os_exit_is_reported_and_restarted(repl: Repl) -> None:
    res = await repl.execute("import os\nos._exit(7)")
    assert res.restarted and "exit code 7" in res.output
    await alive(repl)


async def test_no_secret_and_no_writes_outside(repl: Repl, tmp_path) -> None:  # type: ignore[no-untyped-def]
    res = await repl.execute("import os\nsorted(k for k in os.environ if 'REDIS' in k or 'KEY' in k or 'RLMQ' in k)")
    assert res.output.strip() == "[]"
    res = await repl.execute(
        textwrap.dedent(
            """
            import os
            try:
                data = open(f"/proc/{os.getppid()}/environ", "rb").read()
                print("READ", len(data))
            except OSError as exc:
                print("REFUSED", type(exc).__name__)
            """
        )
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    target = os.path.join(repo, "pwned-by-repl")
    res2 = await repl.execute(
        f"try:\n    open({target!r}, 'w').write('x')\n    print('WROTE')\nexcept OSError as e:\n"
        f"    print('REFUSED', type(e).__name__)"
    )
    uid = (await repl.execute("import os\nos.getuid()")).output.strip()
    if ROOT and uid != "0":
        assert int(uid) >= 100_000
        assert "REFUSED PermissionError" in res.output, res.output
        assert "REFUSED PermissionError" in res2.output, res2.output
        assert not os.path.exists(target)
        # its own folder stays writable
        own = await repl.execute("open('mine.txt', 'w').write('ok')\nopen('mine.txt').read()")
        assert own.output.strip() == "'ok'"
    else:
        if os.path.exists(target):
            os.unlink(target)
        pytest.fail(f"the REPL did not drop privileges (uid {uid}); environ: {res.output!r}")


async def test_socket_to_redis_is_refused_but_llm_batch_works() -> None:
    """With the interception server's Unix socket, the REPL gets no network at all."""
    from rlmq.producer.interception import InterceptionServer

    server = InterceptionServer()
    await server.start()

    async def handle(prompts: list[str]) -> tuple[list[str], str]:
        return [p.upper() for p in prompts], "2 ok"

    token = server.register(handle)
    assert server.unix_path is not None
    try:
        with EmbeddedRedis() as redis_server:
            async with Repl(context="ctx", endpoint_url=server.url, unix_socket=server.unix_path, token=token) as repl:
                probe = (
                    "import socket\ntry:\n"
                    f"    socket.create_connection(('127.0.0.1', {redis_server.port}), timeout=2)\n"
                    "    print('CONNECTED')\nexcept OSError as e:\n    print('REFUSED', e)"
                )
                res = await repl.execute(probe)
                batch = await repl.execute("print(llm_batch(['a', 'b']))")
                if not ROOT:
                    assert repl.network_isolated is False
                    pytest.fail("the network is isolated only when the producer runs as root: " + res.output)
                assert repl.network_isolated is True
                assert "REFUSED" in res.output and "CONNECTED" not in res.output, res.output
                assert "['A', 'B']" in batch.output, batch.output
                await alive(repl)
    finally:
        await server.stop()


async def test_without_the_unix_socket_tcp_to_localhost_stays_reachable(repl: Repl) -> None:
    """Documents the fallback: a REPL given only a TCP endpoint keeps the host's network."""
    with EmbeddedRedis() as server:
        res = await repl.execute(
            f"import socket\ns = socket.create_connection(('127.0.0.1', {server.port}), timeout=2)\n"
            "s.sendall(b'PING\\r\\n')\nprint(s.recv(10))\ns.close()"
        )
    assert "PONG" in res.output
    assert repl.network_isolated is False
    await alive(repl)
    assert isinstance(socket.gethostname(), str)


PROBE = """
import socket, sys
sys.path.insert(0, sys.argv[1])
import repl_child
isolated = repl_child._isolate_network()
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[2])), timeout=2)
    reached = "CONNECTED"
except OSError as exc:
    reached = f"REFUSED {exc}"
import os
print(isolated, os.getuid(), reached)
"""


def test_network_isolation_without_root_through_a_user_namespace() -> None:
    """An unprivileged REPL child isolates its network in a user namespace of its own.

    Run as ``nobody`` with the system Python (the REPL child is stdlib-only); the host's
    Redis on 127.0.0.1 must be unreachable afterwards, and the uid must read back unchanged.
    """
    import pwd
    import shutil
    import subprocess

    if not ROOT:
        pytest.fail("this test switches to the user 'nobody' and needs root to do so")
    runuser = shutil.which("runuser")
    py = shutil.which("python3.11", path="/usr/bin:/usr/local/bin") or shutil.which("python3", path="/usr/bin")
    assert runuser and py, "needs runuser and a system python3"
    here = os.path.dirname(os.path.abspath(__import__("rlmq.producer.repl_child").producer.repl_child.__file__))
    nobody = pwd.getpwnam("nobody").pw_uid
    with EmbeddedRedis() as server:
        proc = subprocess.run(
            [runuser, "-u", "nobody", "--", py, "-I", "-c", PROBE, here, str(server.port)],
            capture_output=True, text=True, timeout=30, cwd="/",
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    isolated, uid, reached = proc.stdout.split(" ", 2)
    assert isolated == "True", proc.stdout
    assert int(uid) == nobody
    assert reached.startswith("REFUSED"), proc.stdout
