"""Hostile cells in the REPL, written as the model would write them, judged from the parent.

Every attack runs twice: with namespaces (this machine runs the tests as root) and with
``namespaces=False``, the fallback of a host without them; one more test runs a REPL in a
process where the kernel itself refuses every new namespace (``max_*_namespaces`` = 0 in a
user namespace of its own). What each asserts:

* timeouts: a cell that forges the child's old "llm_batch in flight" message, or sleeps,
  still times out on the parent's clock; a rollout whose cell keeps the parent serving
  batches ends at its own wall-clock deadline (``rollout_timeout``);
* output: a 700 MB answer, written normally or forged straight into the reply pipe, does not
  raise the producer's resident memory by more than a small bound (sampled from the producer
  process with psutil); an oversized ``llm_batch`` or ``rlm_batch`` is refused in the child
  and, forged, by the interception server;
* files: 1 GiB files in ``/tmp``, ``/dev/shm`` and ``/var/tmp`` stop at the scratch size, and
  with namespaces nothing is left on the host after the REPL closes (without, what is left is
  reported as not contained);
* Unix sockets: listening sockets the test makes under ``/run``, ``/tmp`` and ``/var/lib``,
  and MariaDB's and PostgreSQL's under ``/run`` when present, cannot be reached with
  namespaces; TCP to a Redis on 127.0.0.1 neither;
* processes: other uids' processes hidden (namespaces, root); a cell cannot become root of
  a user namespace of its own (seccomp); one process holds at most ``max_open_files``
  connections to the interception socket, and when the cell has used up the producer's
  descriptors closing the REPL still kills all of it; ``kill -9`` of the producer leaves no
  process of the REPL alive, not even one that left its process group;
* the producer's own folder: a symlink planted for ``context.json`` is never written through;
* what held before: fork bombs, memory hogs, ``os._exit``, no secrets, no writes outside,
  the producer's environment unreadable.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psutil
import pytest

from rlmq.common.redis_server import EmbeddedRedis
from rlmq.common.schemas import RlmTask
from rlmq.producer.interception import InterceptionServer
from rlmq.producer.repl import Repl, containment
from rlmq.producer.repl import cgroup as cgroup_module
from tests.faults.conftest import process_gone, wait_until

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
async def sandbox(
    namespaces: bool, icpt: InterceptionServer, batch_seconds: float = 0.0, **kw: Any
) -> AsyncIterator[Repl]:
    """A started REPL whose ``llm_batch`` the interception server serves (taking
    ``batch_seconds``), wrapped in the REPL's own :meth:`Repl.serving` as ``RLMEnv`` does."""
    holder: list[Repl] = []

    async def handle(prompts: list[str]) -> tuple[list[str], str]:
        async with holder[0].serving():
            if batch_seconds:
                await asyncio.sleep(batch_seconds)  # a slow sub-LLM batch
            return [p.upper() for p in prompts], f"[{len(prompts)} ok]"

    async def handle_rlm(tasks: list[RlmTask]) -> tuple[list[str], str]:
        async with holder[0].serving():
            if batch_seconds:
                await asyncio.sleep(batch_seconds)  # slow child rollouts
            return [t.prompt.upper() for t in tasks], f"[{len(tasks)} children ok]"

    token = icpt.register(handle, None, handle_rlm)
    options: dict[str, Any] = {
        "code_execution_timeout": 3,
        "memory_bytes": 512 * MiB,
        "max_processes": 32,
        "scratch_bytes": 64 * MiB,
    }
    options.update(kw)
    socket_path = icpt.unix_path_of(token)
    repl = Repl(
        context="ctx", endpoint_url=icpt.url, unix_socket=socket_path, token=token, namespaces=namespaces, **options
    )
    holder.append(repl)
    try:
        await repl.start()
        yield repl
    finally:
        await repl.close()
        icpt.unregister(token)


@pytest.fixture
async def repl(namespaces: bool, icpt: InterceptionServer) -> AsyncIterator[Repl]:
    async with sandbox(namespaces, icpt) as r:
        yield r


async def alive(repl: Repl) -> None:
    res = await repl.execute("x_alive = 41 + 1\nx_alive")
    assert res.output.strip() == "42", res.output


# --------------------------------------------------------------------------- timeouts


FORGE_INFLIGHT = """
import gc, time
channels = [o for o in gc.get_objects() if type(o).__name__ == "_Channel"]
print("channels found:", len(channels), flush=True)
t0 = time.time()
while time.time() - t0 < 25:
    for c in channels:
        c.send({"type": "llm_batch", "inflight": 1})
    time.sleep(0.05)
print("ran 25 s")
"""


async def test_forged_llm_batch_messages_cannot_pause_the_timeout(repl: Repl) -> None:
    res = await repl.execute(FORGE_INFLIGHT)
    assert "channels found: 1" in res.output, res.output
    assert res.timed_out and res.restarted, res.output
    assert "ran 25 s" not in res.output
    assert res.seconds < 3 + 5, res.seconds  # the 3 s timeout, plus slack for a loaded machine
    await alive(repl)


async def test_sleeping_cell_times_out(repl: Repl) -> None:
    res = await repl.execute("import time\ntime.sleep(600)")
    assert res.timed_out and res.seconds < 3 + 5
    await alive(repl)


async def test_llm_batch_served_by_the_parent_pauses_the_timeout(namespaces: bool, icpt: InterceptionServer) -> None:
    """The legitimate pause still works: two 2.5 s batches the parent serves in a 3 s cell."""
    async with sandbox(namespaces, icpt, batch_seconds=2.5) as repl:
        res = await repl.execute("for i in range(2):\n    out = llm_batch(['a'])\nout")
        assert "['A']" in res.output and not res.timed_out, res.output
        assert res.seconds >= 5


async def test_rlm_batch_served_by_the_parent_pauses_the_timeout(namespaces: bool, icpt: InterceptionServer) -> None:
    """Child rollouts the parent serves pause the cell's clock as a batch does."""
    async with sandbox(namespaces, icpt, batch_seconds=2.5) as repl:
        res = await repl.execute("for i in range(2):\n    out = rlm_batch(['a', {'prompt': 'b', 'context': [1]}])\nout")
        assert "['A', 'B']" in res.output and not res.timed_out, res.output
        assert res.seconds >= 5


async def test_a_batch_left_in_flight_by_an_earlier_cell_does_not_pause_a_later_one(
    namespaces: bool, icpt: InterceptionServer
) -> None:
    async with sandbox(namespaces, icpt, batch_seconds=8) as repl:
        # the batch reaches the parent while this cell still runs (it waits 2.5 s), and stays in flight
        res = await repl.execute(
            "import threading, time\nthreading.Thread(target=llm_batch, args=(['slow'],)).start()\ntime.sleep(2.5)"
        )
        assert not res.timed_out, res
        res = await repl.execute("import time\ntime.sleep(30)")
        assert res.timed_out and res.seconds < 3 + 2.5, res.seconds  # not 8 s of someone else's batch + 3


async def test_infinite_loop_times_out_and_restarts(repl: Repl) -> None:
    res = await repl.execute("while True:\n    pass")
    assert res.timed_out and res.restarted
    assert "timed out after 3 s" in res.output
    await alive(repl)


# --------------------------------------------------------------------------- output into the producer


@contextlib.contextmanager
def peak_rss() -> Iterator[dict[str, int]]:
    """Sample this (the producer's) process's resident memory every 5 ms; ``peak - base`` in bytes."""
    proc = psutil.Process()
    seen = {"base": proc.memory_info().rss, "peak": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen["peak"] = max(seen["peak"], proc.memory_info().rss)
            stop.wait(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(5)
        seen["peak"] = max(seen["peak"], proc.memory_info().rss)
        seen["grew"] = seen["peak"] - seen["base"]


RSS_BOUND = 64 * MiB  # a 700 MB answer reaching the producer would be 700 MB or more


async def test_huge_answer_is_cut_and_producer_memory_stays_bounded(namespaces: bool, icpt: InterceptionServer) -> None:
    async with sandbox(namespaces, icpt, memory_bytes=1600 * MiB, code_execution_timeout=60) as repl:
        await alive(repl)
        with peak_rss() as rss:
            res = await repl.execute("answer['content'] = 'y' * 700_000_000\nanswer['ready'] = True")
        assert not res.restarted, res.output
        assert res.answer_ready
        assert res.answer_content == "y" * repl.max_answer_length
        assert f"has 700000000 characters; only the first {repl.max_answer_length}" in res.output
        print("producer RSS grew", rss)
        assert rss["grew"] < RSS_BOUND, rss


@pytest.mark.parametrize(
    "char", ["\\U0001f600", "\\x00", "\\ud800", "\\\\"], ids=["emoji", "nul", "surrogate", "backslash"]
)
async def test_an_answer_of_the_longest_kind_at_the_limit_is_kept_whole(icpt: InterceptionServer, char: str) -> None:
    """The parent's line limit admits a full-length answer of the costliest characters."""
    async with sandbox(True, icpt, max_answer_length=200_000) as repl:
        res = await repl.execute(f"answer['content'] = '{char}' * 200_000")
        assert not res.restarted, res.output
        assert len(res.answer_content) == 200_000 and res.output == ""


FORGE_RESULT = """
import gc
ch = [o for o in gc.get_objects() if type(o).__name__ == "_Channel"][0]
f = ch._file
f.write(b'{"type": "result", "answer_ready": true, "answer_content": "')
chunk = b"y" * 1_000_000
for _ in range(700):
    f.write(chunk)
f.write(b'"}\\n')
f.flush()
"""


async def test_forged_huge_reply_kills_the_child_and_producer_memory_stays_bounded(
    namespaces: bool, icpt: InterceptionServer
) -> None:
    async with sandbox(namespaces, icpt, code_execution_timeout=60) as repl:
        await alive(repl)
        with peak_rss() as rss:
            res = await repl.execute(FORGE_RESULT)
        assert res.restarted and not res.answer_ready and res.answer_content == ""
        assert "sent the producer a message of more than" in res.output, res.output
        print("producer RSS grew", rss)
        assert rss["grew"] < RSS_BOUND, rss
        await alive(repl)


async def test_oversized_llm_batch_is_refused_in_the_child_and_by_the_server(
    namespaces: bool, icpt: InterceptionServer
) -> None:
    async with sandbox(namespaces, icpt, max_batch_bytes=icpt.max_batch_bytes) as repl:
        res = await repl.execute("llm_batch(['x' * 5_000_000])")
        assert "ValueError: llm_batch prompts take" in res.output and "at most 4194304" in res.output, res.output
        # forged: the same body sent by hand, past the child's check, is refused by the parent
        forged = textwrap.dedent(
            """
            import gc, http.client, json, socket
            cells = [c.cell_contents for c in llm_batch.__closure__]
            token = next(c for c in cells if isinstance(c, str) and len(c) > 30)
            path = next(o for o in gc.get_objects() if type(o).__name__ == "_UnixHandler")._path
            s = socket.socket(socket.AF_UNIX); s.connect(path)
            conn = http.client.HTTPConnection("localhost"); conn.sock = s
            conn.request("POST", "/llm_batch", json.dumps({"prompts": ["x" * 5_000_000]}),
                         {"Authorization": "Bearer " + token, "Content-Type": "application/json"})
            print("STATUS", conn.getresponse().status)
            """
        )
        res = await repl.execute(forged)
        assert "STATUS 413" in res.output, res.output
        await alive(repl)


async def test_oversized_rlm_batch_is_refused_in_the_child_and_by_the_server(
    namespaces: bool, icpt: InterceptionServer
) -> None:
    async with sandbox(namespaces, icpt, max_batch_bytes=icpt.max_batch_bytes) as repl:
        res = await repl.execute("rlm_batch([{'prompt': 'p', 'context': ['x' * 5_000_000]}])")
        assert "ValueError: rlm_batch tasks take" in res.output and "at most 4194304" in res.output, res.output
        forged = textwrap.dedent(
            """
            import gc, http.client, json, socket
            cells = [c.cell_contents for c in rlm_batch.__closure__]
            token = next(c for c in cells if isinstance(c, str) and len(c) > 30 and "/" not in c)
            path = next(o for o in gc.get_objects() if type(o).__name__ == "_UnixHandler")._path
            def send(body):
                s = socket.socket(socket.AF_UNIX); s.connect(path)
                conn = http.client.HTTPConnection("localhost"); conn.sock = s
                conn.request("POST", "/rlm_batch", body,
                             {"Authorization": "Bearer " + token, "Content-Type": "application/json"})
                return conn.getresponse().status
            print("BIG", send(json.dumps({"tasks": [{"prompt": "p", "context": "x" * 5_000_000}]})))
            print("DEEP", send('{"tasks": [{"prompt": "p", "context": ' + "[" * 200_000 + "]" * 200_000 + "}]}"))
            print("BAD", send(json.dumps({"tasks": [{"prompt": "p", "context": 3}]})))
            """
        )
        res = await repl.execute(forged)
        assert "BIG 413" in res.output and "DEEP 400" in res.output and "BAD 400" in res.output, res.output
        await alive(repl)


# --------------------------------------------------------------------------- files


WRITE_GIB = """
import os
sizes = {}
for d in ("/tmp", "/dev/shm", "/var/tmp"):
    p = os.path.join(d, TAG)
    try:
        with open(p, "wb") as f:
            for _ in range(1024):
                f.write(b"\\0" * (1 << 20))
        sizes[d] = "WROTE 1 GiB"
    except OSError as exc:
        sizes[d] = (exc.errno, os.path.getsize(p) if os.path.exists(p) else None)
os.makedirs(f"/tmp/{TAG}-d/a/b")
open(f"/tmp/{TAG}-d/a/b/f", "w").write("x")
try:  # in a world-writable folder of another user (the host's: hidden with namespaces)
    open(f"/tmp/{TAG}-shared/f", "w").write("x")
except FileNotFoundError:
    pass
print(sizes)
"""


async def test_files_stop_at_the_scratch_size_and_do_not_outlive_the_repl(
    namespaces: bool, icpt: InterceptionServer
) -> None:
    tag = f"rlmq-hostile-{uuid.uuid4().hex}"
    paths = [os.path.join(d, tag) for d in ("/tmp", "/dev/shm", "/var/tmp")]
    shared = f"/tmp/{tag}-shared"  # noqa: S108 - the test's own, root's, world-writable
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    paths += [f"/tmp/{tag}-d", f"{shared}/f"]  # noqa: S108
    try:
        async with sandbox(namespaces, icpt, code_execution_timeout=60) as repl:
            res = await repl.execute(f"TAG = {tag!r}\n" + WRITE_GIB)
            assert "WROTE 1 GiB" not in res.output, res.output
            sizes = eval(res.output.strip().splitlines()[-1])  # noqa: S307 - our own repr of a dict
            for d, (errno, size) in sizes.items():
                assert errno in (27, 28), (d, errno)  # EFBIG (RLIMIT_FSIZE) or ENOSPC (the tmpfs)
                assert size is None or size <= 64 * MiB, (d, size)
            assert repl.containment is not None
            fs_private = repl.containment.private_fs
            not_contained = " ".join(repl.containment.not_contained)
        left = [p for p in paths if os.path.exists(p)]
        # with namespaces they were in its private tmpfs; without, the producer swept its uid's files
        assert left == [], f"files outlived the REPL: {left}"
        assert fs_private == namespaces
        if not namespaces:  # what is then not contained is said
            assert "disk use is limited per file, not in total" in not_contained, not_contained
        assert os.path.isdir(shared)  # root's folder stays
    finally:
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
        shutil.rmtree(shared, ignore_errors=True)


async def test_writes_outside_are_refused_and_no_secret_is_seen(repl: Repl) -> None:
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
    if os.path.exists(target):
        os.unlink(target)
        pytest.fail("the REPL wrote outside its folder")
    if not (ROOT and uid != "0"):
        pytest.fail(f"the REPL did not drop privileges (uid {uid}); environ: {res.output!r}")
    assert int(uid) >= 100_000
    # hidden (namespaces: its own /proc with hidepid) or refused (another uid's entry)
    assert "REFUSED FileNotFoundError" in res.output or "REFUSED PermissionError" in res.output, res.output
    assert "REFUSED" in res2.output and "WROTE" not in res2.output, res2.output
    own = await repl.execute("open('mine.txt', 'w').write('ok')\nopen('mine.txt').read()")
    assert own.output.strip() == "'ok'"


SYSV_SHM = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
shmid = libc.shmget(KEY, 1 << 20, 0o1666)  # IPC_CREAT | 0666: persists until removed
print("SHMID", shmid, ctypes.get_errno())
"""


def _host_shm_keys() -> set[int]:
    with open("/proc/sysvipc/shm") as f:
        next(f)
        return {int(line.split()[0]) for line in f if line.strip()}


async def test_system_v_shared_memory_does_not_outlive_the_repl(namespaces: bool, icpt: InterceptionServer) -> None:
    import ctypes

    key = 0x7A000000 + int(uuid.uuid4().hex[:6], 16)
    async with sandbox(namespaces, icpt) as repl:
        res = await repl.execute(f"KEY = {key}\n" + SYSV_SHM)
        shmid = int(res.output.split()[1])
        assert shmid >= 0, res.output
    left = key in _host_shm_keys()
    if left:  # remove it from the host before failing
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmctl(shmid, 0, None)  # IPC_RMID
    # namespaces: its own IPC namespace died with it; without: the producer swept its uid's objects
    assert not left, "a System V segment outlived the REPL"


CONTAIN_AS_NOBODY = """
import os, socket, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
from repl_child.containment import contain
work = sys.argv[2]
report = contain({"workdir": work, "context_path": work + "/context.json", "unix_socket": None,
                  "isolate_network": True, "scratch_bytes": 1 << 20})
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[3])), timeout=2)
    reached = "CONNECTED"
except OSError as exc:
    reached = "REFUSED"
print(report["net_isolated"], report["fs_private"], os.getuid(), reached, sorted(os.listdir("/run")), os.getcwd())
"""


def test_without_root_the_child_contains_itself_in_a_user_namespace() -> None:
    """An unprivileged REPL child (``nobody``, the system Python: the child is stdlib-only)
    gets its network and mount namespaces through a user namespace: the host's Redis on
    127.0.0.1 is unreachable, the host's /run is hidden, HOME is its private tmpfs."""
    import pwd

    if not ROOT:
        pytest.fail("this test switches to the user 'nobody' and needs root to do so")
    runuser = shutil.which("runuser")
    py = shutil.which("python3.11", path="/usr/bin:/usr/local/bin") or shutil.which("python3", path="/usr/bin")
    assert runuser and py, "needs runuser and a system python3"
    here = os.path.dirname(os.path.abspath(__import__("rlmq.producer.repl_child").producer.repl_child.__file__))
    nobody = pwd.getpwnam("nobody").pw_uid
    work = subprocess.run([runuser, "-u", "nobody", "--", "mktemp", "-d"], capture_output=True, text=True, check=True)
    workdir = work.stdout.strip()
    try:
        with EmbeddedRedis() as server:
            proc = subprocess.run(
                [runuser, "-u", "nobody", "--", py, "-I", "-c", CONTAIN_AS_NOBODY, here, workdir, str(server.port)],
                capture_output=True, text=True, timeout=30, cwd="/",
            )  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr
    net, fs, uid, reached, run, cwd = proc.stdout.split(" ", 5)
    assert (net, fs, reached) == ("True", "True", "REFUSED"), proc.stdout
    assert int(uid) == nobody
    assert run == "[]" and cwd.strip() == "/tmp/home", proc.stdout


PLANT_SYMLINK = """
import os
for p in ("/tmp/.rlmq/work/context.json", os.path.join(os.path.dirname(os.getcwd()), "context.json")):
    try:
        os.remove(p)
        os.symlink(VICTIM, p)
        print("PLANTED", p)
    except OSError as exc:
        print("REFUSED", p, type(exc).__name__)
os._exit(1)
"""


async def test_a_planted_symlink_does_not_make_the_producer_write_through_it(
    namespaces: bool, icpt: InterceptionServer
) -> None:
    """The producer rewrites ``context.json`` when it restarts the REPL: a cell that swaps it
    for a symlink to a root-only file, then dies, must not get that file overwritten."""
    victim = f"/tmp/rlmq-victim-{uuid.uuid4().hex}"  # noqa: S108
    with open(victim, "w") as f:
        f.write("root's own\n")
    os.chmod(victim, 0o600)
    try:
        async with sandbox(namespaces, icpt) as repl:
            res = await repl.execute(f"VICTIM = {victim!r}\n" + PLANT_SYMLINK)
            assert res.restarted and "PLANTED" not in res.output, res.output
            await alive(repl)
            assert (await repl.execute("context")).output == "'ctx'\n"
        with open(victim) as f:
            assert f.read() == "root's own\n"
    finally:
        os.unlink(victim)


# --------------------------------------------------------------------------- sockets


def _listen(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    os.chmod(path, 0o666)
    s.listen(8)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.connect(path)  # the host reaches it
    probe.close()
    return s


CONNECT = """
import socket
seen = {}
for p in PATHS:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(p)
        seen[p] = "CONNECTED"
    except OSError as exc:
        seen[p] = "REFUSED " + type(exc).__name__
    s.close()
print(seen)
"""


async def test_host_unix_sockets_are_unreachable(namespaces: bool, icpt: InterceptionServer) -> None:
    tag = uuid.uuid4().hex[:12]
    var_dir = f"/var/lib/rlmq-hostile-{tag}"
    os.mkdir(var_dir, 0o755)
    ours = [f"/run/rlmq-hostile-{tag}.sock", f"/tmp/rlmq-hostile-{tag}.sock", f"{var_dir}/s.sock"]  # noqa: S108
    host = [p for p in ("/run/mysqld/mysqld.sock", "/var/run/postgresql/.s.PGSQL.5432") if os.path.exists(p)]
    servers = [_listen(p) for p in ours]
    try:
        async with sandbox(namespaces, icpt) as repl:
            res = await repl.execute(f"PATHS = {ours + host!r}\n" + CONNECT)
            seen = eval(res.output.strip().splitlines()[-1])  # noqa: S307 - our own repr of a dict
            batch = await repl.execute("llm_batch(['own socket'])")
            assert "['OWN SOCKET']" in batch.output, batch.output  # its own interception socket works
            assert repl.containment is not None
            if namespaces:
                assert all(v.startswith("REFUSED") for v in seen.values()), seen
                assert repl.containment.hidden_sockets >= 1  # the one under /var/lib, at least
            else:  # the fallback reaches them, and says so
                assert seen[ours[1]] == "CONNECTED", seen
                assert any("host Unix sockets" in m for m in repl.containment.not_contained)
    finally:
        for s in servers:
            s.close()
        for p in ours:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        os.rmdir(var_dir)


async def test_abstract_unix_sockets_of_the_host_are_unreachable(repl: Repl, namespaces: bool) -> None:
    name = f"\0rlmq-hostile-{uuid.uuid4().hex[:12]}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(name)
    server.listen(4)
    try:
        res = await repl.execute(f"PATHS = [{name!r}]\n" + CONNECT)
    finally:
        server.close()
    seen = eval(res.output.strip().splitlines()[-1])  # noqa: S307 - our own repr of a dict
    if namespaces:  # abstract names live in the network namespace
        assert seen[name].startswith("REFUSED"), seen
    else:
        assert seen[name] == "CONNECTED", seen
        assert any("abstract" in m for m in repl.containment.not_contained)  # type: ignore[union-attr]


async def test_tcp_to_a_local_redis_is_refused(repl: Repl, namespaces: bool) -> None:
    with EmbeddedRedis() as server:
        res = await repl.execute(
            "import socket\ntry:\n"
            f"    s = socket.create_connection(('127.0.0.1', {server.port}), timeout=2)\n"
            "    s.sendall(b'PING\\r\\n'); print('CONNECTED', s.recv(10))\nexcept OSError as e:\n"
            "    print('REFUSED', e)"
        )
    if namespaces:
        assert repl.network_isolated is True
        assert "REFUSED" in res.output and "CONNECTED" not in res.output, res.output
    else:
        assert repl.network_isolated is False and "PONG" in res.output
        assert any(m.startswith("network:") for m in repl.containment.not_contained)  # type: ignore[union-attr]
    await alive(repl)


async def test_host_processes_are_hidden(repl: Repl, namespaces: bool) -> None:
    res = await repl.execute(
        textwrap.dedent(
            f"""
            import os
            try:
                cmd = open("/proc/{os.getpid()}/cmdline", "rb").read()
                print("SEEN", len(cmd), len([p for p in os.listdir("/proc") if p.isdigit()]))
            except OSError as exc:
                print("HIDDEN", type(exc).__name__, len([p for p in os.listdir("/proc") if p.isdigit()]))
            """
        )
    )
    assert repl.containment is not None
    if namespaces:
        assert res.output.startswith("HIDDEN FileNotFoundError"), res.output
        assert int(res.output.split()[2]) < 40  # its own processes only (the host runs hundreds)
        assert repl.containment.hidden_processes
    else:
        assert res.output.startswith("SEEN"), res.output
        assert any(m.startswith("processes:") for m in repl.containment.not_contained)


ESCAPE = """
import ctypes, subprocess
script = "umount /tmp; mount -t tmpfs none /tmp; mount -o remount,rw /; touch /var/lib/rlmq-pwned && echo WROTE-HOST"
out = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                     capture_output=True, text=True)
print("UNSHARE", out.returncode, out.stdout.split(), out.stderr.strip())
libc = ctypes.CDLL(None, use_errno=True)
print("CLONE3", libc.syscall(435, 0, 0), ctypes.get_errno())
print("RAW", libc.unshare(0x10000000 | 0x00020000), ctypes.get_errno())
"""


async def test_a_cell_cannot_become_root_of_a_user_namespace_of_its_own(repl: Repl) -> None:
    """Root of its own user namespace, the cell could mount a tmpfs (memory no limit of the
    REPL counts) and more: ``unshare``, ``clone`` with CLONE_NEWUSER and ``clone3`` are refused."""
    assert shutil.which("unshare"), "needs util-linux unshare"
    res = await repl.execute(ESCAPE)
    assert "WROTE-HOST" not in res.output and not os.path.exists("/var/lib/rlmq-pwned"), res.output
    assert "UNSHARE 1 [] unshare: unshare failed: Operation not permitted" in res.output, res.output
    assert "CLONE3 -1 38" in res.output and "RAW -1 1" in res.output, res.output  # ENOSYS, EPERM
    assert repl.containment is not None and repl.containment.no_user_namespaces
    await alive(repl)


IO_URING = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
print("IO_URING", libc.syscall(425, 8, params), ctypes.get_errno())
"""


async def test_a_cell_cannot_set_up_io_uring(repl: Repl) -> None:
    """io_uring's operations bypass seccomp's view of system calls: ``io_uring_setup`` is refused
    (EPERM), with namespaces and without."""
    res = await repl.execute(IO_URING)
    assert "IO_URING -1 1" in res.output, res.output
    await alive(repl)


FLOOD = """
import gc, os, socket, time
path = next(o for o in gc.get_objects() if type(o).__name__ == "_UnixHandler")._path
held = []
def flood():
    while True:
        try:
            s = socket.socket(socket.AF_UNIX)
        except OSError as exc:
            return exc.errno
        try:
            s.connect(path)
        except OSError as exc:
            s.close()
            return exc.errno
        held.append(s)
errno = flood()
print("HELD", len(held), errno)
"""

FORK_FLOOD = """
for _ in range(FORKS):
    if os.fork() == 0:
        flood()
        time.sleep(600)
        os._exit(0)
print("FORKED")
"""


async def test_a_connection_flood_is_bounded_per_process_and_the_repl_still_dies(
    namespaces: bool, icpt: InterceptionServer
) -> None:
    """Each connection to the interception socket costs the producer a descriptor. One process
    of the cell holds at most ``max_open_files`` (RLIMIT_NOFILE); and when a cell's processes
    have used up all the producer's descriptors, closing the REPL still kills every one."""
    import resource

    me = psutil.Process()
    async with sandbox(namespaces, icpt, max_open_files=64) as repl:
        base = me.num_fds()
        res = await repl.execute(FLOOD)
        assert res.output.startswith("HELD"), res.output
        held, errno = (int(x) for x in res.output.split()[1:3])
        assert 40 <= held <= 64 and errno == 24, res.output  # EMFILE in the cell, not in the producer
        await asyncio.sleep(0.2)  # let the server accept what is queued (a bound, not a sync point)
        assert me.num_fds() - base <= 64 + 8, (me.num_fds(), base)
        pgid, uid = repl.pid, repl._child.uid if repl._child else None  # noqa: SLF001
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (me.num_fds() + 16, hard))  # the producer near its limit
        try:
            res = await asyncio.wait_for(repl.execute("FORKS = 4\n" + FORK_FLOOD), 60)
            assert "FORKED" in res.output, res.output
            await repl.close()  # with the producer's descriptors used up
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert pgid is not None and uid is not None

    def gone() -> bool:
        for p in psutil.process_iter(["uids"]):
            with contextlib.suppress(psutil.Error):
                if p.info["uids"] and p.info["uids"].real == uid:
                    return False
        return True

    wait_until(gone, 20, f"every process of the REPL's uid {uid} to be gone")


# --------------------------------------------------------------------------- what held before


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


PRODUCER = """
import asyncio, json, sys
from rlmq.producer.repl import Repl

async def main():
    async with Repl(context="c", endpoint_url="http://127.0.0.1:9/x", token="t", code_execution_timeout=600,
                    namespaces=sys.argv[1] == "1") as r:
        await r.execute("import os")
        print(json.dumps({"pid": r.pid, "uid": r._child.uid}), flush=True)
        await r.execute(sys.argv[2])

asyncio.run(main())
"""

ESCAPEE = """
import os, time
if os.fork() == 0:
    os.setsid()  # out of the REPL's process group
    time.sleep(600)
    os._exit(0)
time.sleep(600)
"""


def test_when_the_producer_is_killed_no_process_of_the_repl_lives_on(namespaces: bool) -> None:
    """``kill -9`` of the producer while a cell sleeps and a process it started left the
    REPL's process group: both go (the REPL watches its command pipe for the hang-up), and the
    REPL's cgroup it left is removed when the next one is made."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, "1" if namespaces else "0", ESCAPEE],
        stdout=subprocess.PIPE, cwd=repo, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        uid = info["uid"]
        assert isinstance(uid, int), info

        def of_uid() -> list[int]:
            found = []
            for p in psutil.process_iter(["uids"]):
                with contextlib.suppress(psutil.Error):
                    if p.info["uids"] and p.info["uids"].real == uid:
                        found.append(p.pid)
            return found

        wait_until(lambda: len(of_uid()) >= 2, 20, "the cell's escaped process to start")
        # Its cgroup, read while the REPL lives (later, another test's REPL made meanwhile on this
        # host, under pytest-xdist, may already have removed it, as the next REPL made does).
        left = glob.glob(f"/sys/fs/cgroup/*/**/rlmq-repl-{proc.pid}-*", recursive=True)
        assert left, "the producer's REPL has no cgroup"
        proc.kill()  # the producer dies of SIGKILL: no close(), no cleanup of its own
        proc.wait(10)
        wait_until(lambda: of_uid() == [], 20, f"every process of the REPL's uid {uid} to be gone")
        # its cgroup (empty now) is left, and the next REPL cgroup made on this host removes it
        fresh, why = cgroup_module.create(64 * MiB, 8)
        assert fresh is not None, why
        assert fresh.remove()
        assert not [p for p in left if os.path.exists(p)], left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


async def test_a_private_file_system_that_cannot_be_set_up_falls_back_and_says_why() -> None:
    """The interception socket's folder is gone when the REPL starts: no private file system,
    the REPL works in its host folder, and the reason is in what is not contained."""
    async with Repl(
        context="c", endpoint_url="http://127.0.0.1:9/x", token="t", unix_socket="/nonexistent-rlmq/x.sock"
    ) as repl:
        assert repl.containment is not None and not repl.containment.private_fs
        assert any(m.startswith("the private file system failed") for m in repl.containment.not_contained)
        res = await repl.execute("import os\nopen('f', 'w').write('ok')\nos.getcwd()")
        assert res.output.strip() == repr(f"{repl.workdir}/home"), res.output


# --------------------------------------------------------------------------- saying what is not contained


async def test_startup_says_once_what_is_not_contained_and_meta_json_has_it(
    icpt: InterceptionServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Any
) -> None:
    from rlmq.cli.report import write_run

    monkeypatch.setattr(containment, "_SEEN", containment._Seen())
    caplog.set_level(logging.WARNING, logger="rlmq.repl")
    async with sandbox(True, icpt) as full:
        assert full.containment is not None and full.containment.not_contained == [], full.containment
    assert [r for r in caplog.records if r.name == "rlmq.repl"] == []
    for _ in range(2):
        async with sandbox(False, icpt):
            pass
    warnings = [r.getMessage() for r in caplog.records if r.name == "rlmq.repl"]
    assert len(warnings) == 1, warnings
    assert "NOT contained" in warnings[0] and "network" in warnings[0] and "/run" in warnings[0]
    folder = write_run(tmp_path / "run", [], {"command": "test"})
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["repl_containment"]["private_fs"] is False
    assert meta["repl_containment"]["not_contained"], meta


KERNEL_SAYS_NO = """
import asyncio, json, logging, os, sys, tempfile
for name in ("user", "mnt", "net", "ipc", "pid", "uts", "cgroup"):
    with open(f"/proc/sys/user/max_{name}_namespaces", "w") as f:
        f.write("0")
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("rlmq.repl").addHandler(Keep())
from rlmq.producer.repl import Repl
socket_dir = tempfile.mkdtemp()

async def main():
    out = {}
    for i in range(2):
        async with Repl(context="c", endpoint_url="http://127.0.0.1:9/x", token="t", run_as=None,
                        unix_socket=os.path.join(socket_dir, "s.sock"), code_execution_timeout=3,
                        max_answer_length=1000) as r:
            out["containment"] = r.containment.as_dict()
            res = await r.execute(sys.argv[1])
            out["forged_timed_out"] = res.timed_out
            out["forged_seconds"] = res.seconds
            res = await r.execute("answer['content'] = 'y' * 50_000_000")
            out["answer_len"] = len(res.answer_content)
    out["warnings"] = records
    print(json.dumps(out))

asyncio.run(main())
"""


def test_where_the_kernel_refuses_namespaces_the_rest_holds_and_it_says_so() -> None:
    """A real host without namespaces: a user namespace of its own whose ``max_*_namespaces``
    are 0, so every ``unshare`` of the REPL child fails with ENOSPC, as on a kernel without
    unprivileged user namespaces."""
    unshare = shutil.which("unshare")
    assert unshare, "needs util-linux unshare"
    if not ROOT:
        pytest.fail("this test maps root into a user namespace of its own and needs root")
    proc = subprocess.run(
        [unshare, "--user", "--map-root-user", sys.executable, "-c", KERNEL_SAYS_NO, FORGE_INFLIGHT],
        capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    c = out["containment"]
    assert c["network"] is False and c["private_fs"] is False, c
    assert any(m.startswith("network:") for m in c["not_contained"]) and len(c["not_contained"]) >= 2
    assert out["forged_timed_out"] is True and out["forged_seconds"] < 3 + 5
    assert out["answer_len"] == 1000
    assert len(out["warnings"]) == 1 and "NOT contained" in out["warnings"][0], out["warnings"]


# --------------------------------------------------------------------------- the rollout's own deadline


PUMP = """
import threading, time
def pump():
    while True:
        llm_batch(["ping [[mock:sleep:0.5]]"])
threading.Thread(target=pump, daemon=True).start()
time.sleep(10_000)
"""


ROLLOUT_DEADLINE = 20.0
"""Seconds of the pumping rollout: its REPL start, root turn and cell start must fit in it with
room for batches on a loaded machine (at 8 s, a load of 10 on two cores left no batch served)."""


async def test_rollout_deadline_ends_a_cell_that_keeps_the_parent_serving(fault_fleet: Any) -> None:
    """A cell keeps real sub-LLM batches in flight from a thread (so the parent, serving them,
    rightly pauses its timeout) and sleeps: the rollout's own deadline ends it, never the cell's
    timeout (no cell of it timed out, though it ran far past 3 s)."""
    from rlmq.common.schemas import DatasetRow
    from rlmq.common.settings import load_settings
    from rlmq.producer.env import RLMEnv
    from rlmq.scripted.server import root_code_directive
    from tests.faults.conftest import start_named_worker

    proc, _ = start_named_worker(fault_fleet, "repl-deadline")
    try:
        settings = load_settings(
            redis_url=fault_fleet.redis_url,
            base_url=fault_fleet.base_url,
            model=fault_fleet.model,
            rollout_timeout=ROLLOUT_DEADLINE,
        )
        row = DatasetRow(id="pump", question="Pump. " + root_code_directive(PUMP), context="c")
        started = time.monotonic()
        async with RLMEnv(settings=settings, code_execution_timeout=3) as env:
            result = await asyncio.wait_for(env.rollout(row, model=fault_fleet.model), 120)
        seconds = time.monotonic() - started
        assert result.row.stop_reason == "error", result.row
        assert result.row.error is not None and "RolloutTimeout" in result.row.error, result.row.error
        assert ROLLOUT_DEADLINE <= seconds < ROLLOUT_DEADLINE + 30, seconds
        assert result.row.metrics["sub_llm_batch_count"] >= 2  # the batches were real and served
        cells = [e for e in result.trajectory if e.get("type") == "cell"]
        assert not any(c["timed_out"] for c in cells), cells  # the serving paused the cell's timeout
    finally:
        proc.kill()
        proc.wait(10)
