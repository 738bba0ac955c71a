"""What a hostile cell can reach of its host and of other rollouts, each attack with
a victim rollout beside it that must see no failure.

Every test runs under uvloop and under asyncio's own loop, with namespaces and without
(``namespaces=False``):

* descriptors: a launcher that leaves an append-mode log file and a connected socket to a
  (private) Redis inheritable when it starts the producer; the cell finds neither;
* memory: ``memfd`` pages, System V and POSIX shared memory and anonymous memory of several
  processes count against one bound per REPL (a memory cgroup where the host gives one, else
  seccomp refuses ``memfd_create`` and ``shmget`` and what is left is bounded per process);
* connections: 30 processes flooding the interception socket neither fail the victim's
  ``llm_batch`` nor raise the producer's descriptors past one rollout's cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import psutil
import pytest
import redis

from rlmq.common.redis_server import EmbeddedRedis
from rlmq.producer.interception import InterceptionServer
from rlmq.producer.repl import Repl
from tests.faults.conftest import wait_until

ROOT = os.geteuid() == 0
MiB = 1024**2
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

Runner = Callable[[Coroutine[Any, Any, Any]], Any]


@pytest.fixture(params=["uvloop", "asyncio"])
def loop_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def run(loop_kind: str) -> Runner:
    """Runs a coroutine to completion on a fresh loop of ``loop_kind``."""

    def runner(coro: Coroutine[Any, Any, Any]) -> Any:
        if loop_kind == "uvloop":
            import uvloop

            factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
        else:
            factory = asyncio.new_event_loop
        with asyncio.Runner(loop_factory=factory) as r:
            return r.run(coro)

    return runner


@pytest.fixture(params=[True, False], ids=["namespaces", "no-namespaces"])
def namespaces(request: pytest.FixtureRequest) -> bool:
    if request.param and not ROOT:
        pytest.fail("the namespace mode of these tests runs as root (CI's normal machine)")
    return bool(request.param)


# --------------------------------------------------------------------------- inherited descriptors

LAUNCHED = r"""
import asyncio, json, sys
from rlmq.producer.interception import InterceptionServer
from rlmq.producer.repl import Repl

loop_kind, namespaces, attack = sys.argv[1], sys.argv[2] == "1", sys.argv[3]

async def rollout(server, code, rounds):
    async def handle(prompts):
        return [p.upper() for p in prompts], ""
    token = server.register(handle)
    try:
        async with Repl(context="ctx", endpoint_url=server.url, unix_socket=server.unix_path_of(token), token=token,
                        namespaces=namespaces, code_execution_timeout=60, memory_bytes=512 << 20) as repl:
            return [(await repl.execute(code)).output for _ in range(rounds)]
    finally:
        server.unregister(token)

async def main():
    server = InterceptionServer()
    await server.start()
    try:
        victim = "print(llm_batch(['a', 'b']))"
        outs = await asyncio.gather(rollout(server, attack, 1), rollout(server, victim, 5))
    finally:
        await server.stop()
    print(json.dumps({"attacker": outs[0][0], "victim": outs[1]}))

if loop_kind == "uvloop":
    import uvloop
    uvloop.run(main())
else:
    asyncio.run(main())
"""

USE_EVERY_DESCRIPTOR = r"""
import os, stat
key = KEY.encode()
seen = []
for fd in range(3, 4096):
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        continue
    kind = "socket" if stat.S_ISSOCK(mode) else "file" if stat.S_ISREG(mode) else "other"
    seen.append(kind)
    try:
        if kind == "socket":
            os.write(fd, b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$5\r\npwned\r\n" % (len(key), key))
        elif kind == "file":
            os.write(fd, b"PWNED BY THE CELL\n")
    except OSError as exc:
        seen.append(type(exc).__name__)
print("SEEN", sorted(seen))
"""


def test_a_launchers_inheritable_descriptors_do_not_reach_the_cell(
    loop_kind: str, namespaces: bool, tmp_path: Any
) -> None:
    """A launcher leaves an append-mode log file and a connected socket to a Redis inheritable
    when it starts the producer (the REPLs' interception server and two rollouts): the
    attacker's cell writes to every descriptor it has; nothing reaches the log or the Redis,
    and the victim rollout's five batches all come back."""
    key = f"rlmq-test-pwned-{uuid.uuid4().hex}"
    log_path = tmp_path / "launcher.log"
    with EmbeddedRedis() as server, open(log_path, "ab") as log:
        client = redis.Redis.from_url(server.url)
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        try:
            os.set_inheritable(log.fileno(), True)
            os.set_inheritable(sock.fileno(), True)
            attack = f"KEY = {key!r}\n" + USE_EVERY_DESCRIPTOR
            proc = subprocess.run(
                [sys.executable, "-c", LAUNCHED, loop_kind, "1" if namespaces else "0", attack],
                cwd=REPO,
                pass_fds=(log.fileno(), sock.fileno()),
                capture_output=True,
                text=True,
                timeout=240,
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            assert client.get(key) is None, result  # no SET reached the Redis
            assert client.ping()
        finally:
            sock.close()
            client.close()
    assert b"PWNED" not in log_path.read_bytes(), result
    attacker = result["attacker"]
    assert attacker.startswith("SEEN"), attacker
    assert "socket" not in attacker and "'file'" not in attacker, attacker  # only its own pipes
    assert result["victim"] == ["['A', 'B']\n"] * 5, result["victim"]


# --------------------------------------------------------------------------- connections


@contextlib.asynccontextmanager
async def rollout(
    server: InterceptionServer, namespaces: bool, served: list[int] | None = None, **kw: Any
) -> AsyncIterator[tuple[Repl, str]]:
    """A started REPL of a rollout of its own on ``server`` (its batches answered in upper
    case, their sizes appended to ``served``); yields (the REPL, its token)."""

    async def handle(prompts: list[str]) -> tuple[list[str], str]:
        if served is not None:
            served.append(len(prompts))
        return [p.upper() for p in prompts], ""

    token = server.register(handle)
    options: dict[str, Any] = {"code_execution_timeout": 60, "memory_bytes": 512 * MiB, "scratch_bytes": 64 * MiB}
    options.update(kw)
    repl = Repl(
        context="ctx",
        endpoint_url=server.url,
        unix_socket=server.unix_path_of(token),
        token=token,
        namespaces=namespaces,
        **options,
    )
    try:
        await repl.start()
        yield repl, token
    finally:
        await repl.close()
        server.unregister(token)


FLOOD = r"""
import gc, os, socket, time
path = next(o for o in gc.get_objects() if type(o).__name__ == "_UnixHandler")._path
r, w = os.pipe()

def flood():
    held, tries = [], 0
    while True:
        tries += 1
        if tries == 250:  # flooding now, whatever the producer makes of it
            os.write(w, b"x")
        if len(held) >= 240:  # drop what the producer closed, then connect again
            alive = []
            for s in held:
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
            if len(held) >= 240:
                time.sleep(0.05)
                continue
        s = socket.socket(socket.AF_UNIX)
        s.setblocking(False)
        try:
            s.connect(path)
        except OSError:
            s.close()
            continue
        held.append(s)

for _ in range(30):
    if os.fork() == 0:
        try:
            flood()
        finally:
            os._exit(0)
got = 0
while got < 30:
    got += len(os.read(r, 30 - got))
print("FLOODING")
"""


def test_a_connection_flood_neither_fails_another_rollouts_batches_nor_the_producer(
    run: Runner, namespaces: bool
) -> None:
    """30 processes of one cell keep ~240 connections each to their rollout's interception
    socket (the issue's attack: 7,400 descriptors in the producer, and EAGAIN in another
    rollout's ``llm_batch``). The victim rollout's 20 batches all come back; the producer holds
    at most the attacker rollout's cap of connections."""
    me = psutil.Process()

    async def main() -> None:
        server = InterceptionServer(max_connections_per_rollout=64)
        await server.start()
        served: list[int] = []
        try:
            async with (
                rollout(server, namespaces) as (attacker, bad),
                rollout(server, namespaces, served) as (victim, _),
            ):
                base = me.num_fds()
                res = await attacker.execute(FLOOD)
                assert "FLOODING" in res.output, res.output
                peak = 0
                for i in range(20):
                    res = await victim.execute(f"print(llm_batch(['a{i}', 'b{i}']))")
                    assert res.output == f"['A{i}', 'B{i}']\n", res.output
                    peak = max(peak, me.num_fds() - base, server.connections_of(bad))
                assert served == [2] * 20
                assert server.connections_of(bad) <= 64
                assert peak <= 64 + 32, peak  # the cap, the victim's own, a few of the loop's
        finally:
            await server.stop()

    run(main())


# --------------------------------------------------------------------------- memory

LIMIT = 128 * MiB

MEMFD_HOG = r"""
import os
held = 0
try:
    fds = []
    while held < 320:  # 2.5 times the REPL's memory, in memfd pages (16 MiB a file: under RLIMIT_FSIZE)
        fd = os.memfd_create("hog")
        for _ in range(16):
            os.write(fd, b"x" * (1 << 20))
            held += 1
        fds.append(fd)
    print("HELD", held, "MiB")
except OSError as exc:
    print("STOPPED", held, type(exc).__name__, exc.errno)
"""

SYSV_HOG = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
held, ids = 0, []
try:
    while held < 320:
        shmid = libc.shmget(0, 16 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
        if shmid < 0:
            raise OSError(ctypes.get_errno(), "shmget")
        ids.append(shmid)
        addr = libc.shmat(shmid, None, 0)
        ctypes.memset(addr, 1, 16 << 20)
        libc.shmdt(ctypes.c_void_p(addr))
        held += 16
    print("HELD", held, "MiB")
except OSError as exc:
    print("STOPPED", held, type(exc).__name__, exc.errno)
finally:
    for shmid in ids:
        libc.shmctl(shmid, 0, None)  # IPC_RMID
"""

FORKED_HOG = r"""
import os, select
r, w = os.pipe()
hold, _keep = os.pipe()
pids = []
for _ in range(8):  # 8 x 24 MiB of anonymous memory: each process well under its RLIMIT_AS
    pid = os.fork()
    pids.append(pid)
    if pid == 0:
        try:
            block = bytearray(24 << 20)
            for i in range(0, len(block), 4096):
                block[i] = 1
            os.write(w, b"x")
            os.read(hold, 1)  # hold it until the REPL ends
        except MemoryError:
            os.write(w, b"e")
        finally:
            os._exit(0)
got = b""
while len(got) < 8 and select.select([r], [], [], 20)[0]:  # a killed process says nothing
    got += os.read(r, 8 - len(got))
alive = sum(1 for pid in pids if os.waitpid(pid, os.WNOHANG) == (0, 0))  # the OOM killer may end some
print("HOLDING", min(alive, got.count(b"x")), "x 24 MiB")
"""


@pytest.fixture(params=[True, False], ids=["cgroup", "no-cgroup"])
def cgroup(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


async def _beside_a_victim(
    server: InterceptionServer, namespaces: bool, cgroup: bool, attack: str
) -> tuple[str, Repl, list[str]]:
    """Run ``attack`` in one rollout while a victim rollout sends 10 batches: (the attack's
    output, the attacker's REPL, the victim's outputs)."""
    async with (
        rollout(server, namespaces, memory_bytes=LIMIT, max_processes=32, cgroup=cgroup) as (attacker, _),
        rollout(server, namespaces, memory_bytes=LIMIT, cgroup=cgroup) as (victim, _),
    ):

        async def victim_batches() -> list[str]:
            return [(await victim.execute(f"print(llm_batch(['v{i}']))")).output for i in range(10)]

        res, outs = await asyncio.gather(attacker.execute(attack), victim_batches())
        if attacker.cgroup is not None:
            peak = attacker.cgroup.peak_bytes()
            assert peak is not None and peak <= LIMIT, peak  # the kernel's own record of the REPL
        await attacker.execute("print('still here')")
        return res.output, attacker, outs


@pytest.mark.parametrize("attack", [MEMFD_HOG, SYSV_HOG], ids=["memfd", "sysv-shm"])
def test_shared_memory_counts_against_the_repls_memory(
    run: Runner, namespaces: bool, cgroup: bool, attack: str
) -> None:
    """320 MiB of memfd pages (the issue's attack: 3 GiB beside a 2 GiB RLIMIT_AS), or of
    System V shared memory, in a REPL of 128 MiB: with a cgroup the REPL never holds more than
    its memory (the kernel's peak) and is killed and restarted; without one, the calls are
    refused. The victim's 10 batches all come back."""

    async def main() -> None:
        server = InterceptionServer()
        await server.start()
        try:
            output, attacker, victim = await _beside_a_victim(server, namespaces, cgroup, attack)
        finally:
            await server.stop()
        assert "HELD 320" not in output, output
        assert victim == [f"['V{i}']\n" for i in range(10)], victim
        assert attacker.containment is not None
        if cgroup:
            assert attacker.containment.memory_cgroup in (1, 2), attacker.containment
            assert "ran out of memory" in output or "STOPPED" in output, output
        else:
            assert output.startswith("STOPPED 0 PermissionError 1"), output  # EPERM at once
            assert attacker.containment.shared_memory_refused
            assert any(m.startswith("memory: bounded per process") for m in attacker.containment.not_contained)

    run(main())


def test_anonymous_memory_of_several_processes_counts_together(run: Runner, namespaces: bool, cgroup: bool) -> None:
    """Eight processes of one cell each touch 24 MiB (each under its own RLIMIT_AS): with a
    cgroup of 128 MiB they cannot all hold it; without one they can, and the containment
    record says memory is bounded per process only."""

    async def main() -> None:
        server = InterceptionServer()
        await server.start()
        try:
            output, attacker, victim = await _beside_a_victim(server, namespaces, cgroup, FORKED_HOG)
        finally:
            await server.stop()
        assert victim == [f"['V{i}']\n" for i in range(10)], victim
        assert attacker.containment is not None
        if cgroup:
            assert "HOLDING 8" not in output, output
        else:
            assert "HOLDING 8 x 24 MiB" in output, output
            assert any(m.startswith("memory: bounded per process") for m in attacker.containment.not_contained)

    run(main())


def test_a_cell_cannot_connect_to_another_rollouts_socket(run: Runner, namespaces: bool) -> None:
    """The attacker connects to every interception socket it can name (the victim's path is
    given to it outright): with namespaces the path does not exist in its file system; without,
    the victim's folder belongs to the victim's uid (the producer runs as root). So it cannot
    take the victim's connections, before or after the victim's REPL starts."""

    async def main() -> None:
        server = InterceptionServer(max_connections_per_rollout=4)
        await server.start()
        try:
            async with rollout(server, namespaces) as (attacker, _):
                waiting = server.register(lambda prompts: asyncio.sleep(0, ([p.upper() for p in prompts], "")))
                for token in (waiting,):  # a rollout registered whose REPL has not started yet
                    path = server.unix_path_of(token)
                    res = await attacker.execute(
                        "import socket\nheld = []\nfor _ in range(8):\n    s = socket.socket(socket.AF_UNIX)\n"
                        f"    try:\n        s.connect({path!r}); held.append(s)\n    except OSError as e:\n"
                        "        print('REFUSED', type(e).__name__); break\nprint('HELD', len(held))"
                    )
                    assert "HELD 0" in res.output, res.output
                    assert server.connections_of(token) == 0
                server.unregister(waiting)
                async with rollout(server, namespaces) as (victim, token):
                    path = server.unix_path_of(token)
                    res = await attacker.execute(
                        "import socket\nheld = []\nfor _ in range(8):\n    s = socket.socket(socket.AF_UNIX)\n"
                        f"    try:\n        s.connect({path!r}); held.append(s)\n    except OSError as e:\n"
                        "        print('REFUSED', type(e).__name__); break\nprint('HELD', len(held))"
                    )
                    assert "HELD 0" in res.output, res.output
                    res = await victim.execute("print(llm_batch(['v']))")
                    assert res.output == "['V']\n", res.output
        finally:
            await server.stop()

    run(main())


# --------------------------------------------------------------------------- a worker host

WORKER_HOST_ATTACK = r"""
import os, socket
found = [k for k, v in os.environ.items() if SECRET in v or PASSWORD in v]
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    for name in ("environ", "cmdline"):
        try:
            data = open(f"/proc/{pid}/{name}", "rb").read()
        except OSError:
            continue
        if SECRET.encode() in data or PASSWORD.encode() in data:
            found.append(f"{pid}/{name}")
command = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$1\r\nx\r\n" % (
    len(PASSWORD), PASSWORD.encode(), len(KEY), KEY.encode())
for family, address in ((socket.AF_UNIX, SOCKET), (socket.AF_INET, ("127.0.0.1", PORT))):
    try:
        s = socket.socket(family)
        s.settimeout(3)
        s.connect(address)
        s.sendall(command)
        found.append(f"redis {family.name}: {s.recv(100)!r}")
    except OSError as exc:
        print("UNREACHABLE", family.name, type(exc).__name__)
print("FOUND", found)
"""


def test_on_a_worker_host_the_cell_reaches_no_redis_and_no_key(
    run: Runner, namespaces: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker host: the producer's environment holds a Redis URL with its password
    and a model key, it holds a connection to that Redis, and the Redis also listens on a Unix
    socket outside ``/tmp`` and ``/run``. The cell (given the password and both addresses)
    finds no secret in its environment nor in any ``/proc`` it can read; with namespaces it
    reaches neither Redis address (without, the network and host sockets are not contained,
    and ``repl_containment`` says so). The victim's batch comes back."""
    from rlmq.common.redis_server import find_redis_server

    password, secret, key = uuid.uuid4().hex, f"sk-{uuid.uuid4().hex}", f"rlmq-test-pwned-{uuid.uuid4().hex}"
    folder = f"/var/lib/rlmq-test-{uuid.uuid4().hex[:8]}"
    os.makedirs(folder)
    sock_path = os.path.join(folder, "redis.sock")
    port = EmbeddedRedis().port  # a free port; never 6379
    server = subprocess.Popen(
        [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--unixsocket", sock_path,
         "--unixsocketperm", "777", "--requirepass", password, "--save", "", "--appendonly", "no",
         "--dir", folder],
        stdout=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    client = redis.Redis(host="127.0.0.1", port=port, password=password)
    try:
        wait_until(lambda: os.path.exists(sock_path) and client.ping(), 15, "the worker host's Redis")
        monkeypatch.setenv("REDIS_URL", f"redis://:{password}@127.0.0.1:{port}/0")
        monkeypatch.setenv("OPENAI_API_KEY", secret)
        attack = (
            f"SECRET, PASSWORD, KEY, SOCKET, PORT = {secret!r}, {password!r}, {key!r}, {sock_path!r}, {port}\n"
            + WORKER_HOST_ATTACK
        )

        async def main() -> tuple[str, Repl, str]:
            icpt = InterceptionServer()
            await icpt.start()
            try:
                async with (
                    rollout(icpt, namespaces) as (attacker, _),
                    rollout(icpt, namespaces) as (victim, _),
                ):
                    res, ok = await asyncio.gather(attacker.execute(attack), victim.execute("print(llm_batch(['v']))"))
                    return res.output, attacker, ok.output
            finally:
                await icpt.stop()

        output, attacker, victim = run(main())
        assert victim == "['V']\n", victim
        assert "FOUND" in output, output
        found = output.split("FOUND", 1)[1]
        assert secret not in output and "environ" not in found and "cmdline" not in found, output
        assert attacker.containment is not None
        if namespaces:
            assert "redis" not in found and client.get(key) is None, output
            assert "UNREACHABLE AF_UNIX" in output and "UNREACHABLE AF_INET" in output, output
        else:
            assert any(m.startswith("network:") for m in attacker.containment.not_contained)
    finally:
        client.close()
        server.terminate()
        server.wait(10)
        shutil.rmtree(folder, ignore_errors=True)
