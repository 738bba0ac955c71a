"""The main job with recursion under the conditions of a real fleet: trees of depth 3
(top rollouts on the producer, child rollouts on REPL-hosting workers, plain sub-calls at the
deepest level) with the documented ACL users, where a REPL host acts as a producer too.

Tenants: a tenant's child queues stay inside its ACL pattern, and a tenant can neither write
another tenant's tree (node keys, ledger: ``NOPERM``) nor make a REPL host join one for it
(a forged child-rollout job naming another tenant's live tree is refused before it runs)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
import redis

from rlmq.cli.local import LocalFleet
from rlmq.common import keys as K
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.jobs.lua import ENQUEUE_LUA
from rlmq.common.jobs.record import CHILD_ROLLOUT_FUNC, utcnow_str
from rlmq.common.jobs.store import EnqueueShared, JobStore, NewJob
from rlmq.common.redis_server import EmbeddedRedis
from rlmq.common.schemas import ChildRolloutRequest, SubLLMResult
from tests.fleet.harness import log_text, tree_job

pytestmark = pytest.mark.e2e


async def forge_child_job(producer_url: str, queue: str, rid: str, ledger_id: str, nodes: list[str]) -> str:
    """As a (tenant) producer: enqueue one child-rollout job of its own rollout ``rid`` on the
    depth-2 child queue of ``queue``, naming ``ledger_id`` and ``nodes``; its reply stream's key."""
    r = async_client(producer_url)
    try:
        now = time.time()
        req = ChildRolloutRequest(
            rollout_id=rid, batch_id="b1", index=0, child_id="f" + uuid.uuid4().hex[:12], ledger_id=ledger_id,
            nodes=nodes, depth=2, max_depth=2, prompt="forged", model="scripted", enqueued_at=now, deadline=now + 60,
        )  # fmt: skip
        cq = K.child_queue(queue, 2)
        reply = K.RolloutKeys(rid).reply("b1")
        await r.script_load(ENQUEUE_LUA)
        async with r.pipeline(transaction=False) as pipe:
            JobStore(r, cq).add_enqueue(
                pipe,
                [NewJob(K.job_id(rid, "b1", 0), f"[{req.model_dump_json()}]", "forged child", {"rollout_id": rid})],
                EnqueueShared(CHILD_ROLLOUT_FUNC, reply, 120, 120, 120, 120),
                utcnow_str(),
            )
            pipe.sadd(K.RQ_QUEUES, K.rq_queue(cq))
            pipe.publish(K.wake_channel(cq), K.wake_message(cq))
            await pipe.execute()
        return reply
    finally:
        await r.aclose()


def reply_of(client: redis.Redis, key: str, timeout: float) -> SubLLMResult:
    """The first result on reply stream ``key``, within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        entries = client.xrange(key)
        if entries:
            return SubLLMResult.model_validate_json(entries[0][1][K.REPLY_FIELD.encode()])
        assert time.monotonic() < deadline, f"no result on {key}"
        time.sleep(0.1)  # polling a worker's reply, bounded by the deadline


async def test_depth_3_trees_with_acl_users_and_tenants_confined_to_their_own_trees(
    acl_urls: dict[str, str], tmp_path: Any
) -> None:
    model = f"fleet-tree-{uuid.uuid4().hex[:6]}"
    logs = str(tmp_path / "logs")
    with LocalFleet(
        redis_url=acl_urls["worker"], model=model, workers=2, worker_concurrency=16, repl_slots=2, log_dir=logs,
    ) as f:  # fmt: skip
        base = str(f.base_url)
        assert all(uses_uvloop(p.pid) for p in f.group.procs[-2:])  # the REPL hosts run uvloop
        # tenant u's tree runs beside tenant t's: t must not reach it
        u_tree = asyncio.create_task(
            tree_job(acl_urls["producer_u"], base, model, max_depth=3, rollouts=1, tenant="u", label="victim")
        )
        t_out = await tree_job(acl_urls["producer"], base, model, max_depth=3, rollouts=2, tenant="t")
        u_out = await u_tree
        for out in (t_out, u_out):
            assert all(s == "answer_ready" for s in out.stop_reasons), out.summary()
            assert out.correct == len(out.stop_reasons) and set(out.depths) == {3}, out.summary()
        admin = redis.Redis.from_url(acl_urls["worker"])
        t_prod = redis.Redis.from_url(acl_urls["producer"])
        try:
            # the child queues of each tenant are its own (inside its ACL pattern)
            queues = {K.queue_of_key(q) for q in admin.smembers(K.RQ_QUEUES)}
            qbase = K.queue_name_for_model(model)
            for t in "tu":
                assert {K.child_queue(f"{qbase}@{t}", d) for d in (2, 3)} <= queues, queues
            # a forged write into another tenant's tree: refused by Redis
            ul = BudgetLedger(async_client(acl_urls["producer_u"]))
            victim = f"u_live{uuid.uuid4().hex[:6]}"
            await ul.open(victim, 10_000, cap=1000)
            await ul.open_node(victim, victim, ttl=60)
            await ul.aclose()
            lk = K.LedgerKeys(victim)
            for forged in (
                lambda: t_prod.set(lk.node("t_mine-1"), 1),
                lambda: t_prod.hincrby(lk.budget, "limit", 10**6),
                lambda: t_prod.delete(lk.node(victim)),
                lambda: t_prod.hset(K.RolloutKeys(victim).info, "queue", "x"),
            ):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    forged()
            # ... nor through a REPL host: a child job of t's own rollout naming u's live tree
            rid = f"t_forge{uuid.uuid4().hex[:6]}"
            for nodes in ([victim], [victim, rid]):
                reply = await forge_child_job(acl_urls["producer"], f"{qbase}@t", rid, victim, nodes)
                res = reply_of(t_prod, reply, 30)
                assert res.status == "error" and res.error_kind in ("payload", "parent_gone"), res
                t_prod.delete(reply)
                rid += "x"
            assert [k for k in admin.scan_iter(match=f"rlmq:{{{victim}}}:node:*")] == [lk.node(victim).encode()]
            snap = admin.hgetall(lk.budget)
            assert int(snap.get(b"grants", 0)) == 0 and int(snap.get(b"charged", 0)) == 0, snap
            rq_info = subprocess.run(  # rq info as the documented user (the worker's), child queues shown
                [os.path.join(os.path.dirname(sys.executable), "rq"), "info", "--url", acl_urls["worker"]],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert rq_info.returncode == 0 and f"{qbase}+rlm2@t" in rq_info.stdout, rq_info.stderr[-3000:]
            status = subprocess.run(
                [sys.executable, "-m", "rlmq", "status", "--redis-url", acl_urls["dashboard"]],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert status.returncode == 0, status.stderr[-3000:]
        finally:
            admin.close()
            t_prod.close()
    text = log_text(logs)
    assert "NOPERM" not in text, text[-3000:]


LAUNCHER = r"""
import os, socket, sys
host, port, held, ino_out = sys.argv[1:5]
s = socket.create_connection((host, int(port)))  # a launcher's connection to Redis, left inheritable
f = open(held, "a")  # and its log file
for fd in (s.fileno(), f.fileno()):
    os.set_inheritable(fd, True)
with open(ino_out, "w") as out:
    out.write(str(os.fstat(s.fileno()).st_ino))
if sys.argv[5] == "stdlib":  # run the worker in this process on asyncio's own loop
    import runpy
    sys.modules["uvloop"] = None
    sys.argv = ["rlmq", *sys.argv[9:]]  # after: <python> -m rlmq
    runpy.run_module("rlmq", run_name="__main__", alter_sys=True)
else:
    os.execv(sys.argv[6], sys.argv[6:])
"""


def uses_uvloop(pid: int) -> bool:
    """Whether process ``pid`` has uvloop's extension mapped (it imports it only to run its loop)."""
    with open(f"/proc/{pid}/maps") as f:
        return "uvloop" in f.read()


PROBE = r"""
import glob, json, os, socket
secrets = __SECRETS__
found = [f"env:{k}" for k, v in os.environ.items() if any(x in v for x in secrets)]
for path in glob.glob("/proc/*/environ") + glob.glob("/proc/*/cmdline"):
    try:
        data = open(path, "rb").read().decode("latin-1")
    except Exception:
        continue
    if any(x in data for x in secrets):
        found.append(path)
reach = {}
for port in __PORTS__:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        reach[port] = "open"
    except Exception as exc:
        reach[port] = type(exc).__name__
fds = {}
for fd in os.listdir("/proc/self/fd"):
    try:
        fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        pass
answer["content"] = json.dumps({"found": found, "reach": reach, "fds": fds})
answer["ready"] = True
"""


async def test_a_hostile_cell_in_a_child_rollout_reaches_nothing_of_its_worker_host(
    acl_urls: dict[str, str], tmp_path: Any
) -> None:
    """A child rollout's cell on a REPL host (on asyncio's own loop) started by a launcher that
    leaves a Redis connection and a log file open: it reads neither the worker's model API key
    nor its Redis URL (password) from its environment or ``/proc``, finds none of the launcher's
    descriptors, and reaches neither Redis, the model server nor any TCP port the worker listens on."""
    import json
    from urllib.parse import urlparse

    import psutil

    from rlmq.cli.local import child_env, rlmq_command
    from rlmq.common.schemas import DatasetRow
    from rlmq.common.settings import load_settings
    from rlmq.producer.env import RLMEnv
    from rlmq.scripted.server import root_code_directive

    model = f"fleet-probe-{uuid.uuid4().hex[:6]}"
    api_key = "sk-" + uuid.uuid4().hex
    wurl = urlparse(acl_urls["worker"])
    assert wurl.password
    held, ino_out = str(tmp_path / "launcher-held.log"), str(tmp_path / "ino")
    with LocalFleet(redis_url=acl_urls["worker"], model=model, workers=0, log_dir=str(tmp_path / "logs")) as f:
        argv = rlmq_command("worker", "--base-url", str(f.base_url), "--model", model, "--repl-slots", "1")
        env = child_env({"RLMQ_REDIS_URL": acl_urls["worker"], "RLMQ_API_KEY": api_key})
        proc = f.group.spawn(
            [sys.executable, "-c", LAUNCHER, str(wurl.hostname), str(wurl.port), held, ino_out, "stdlib", *argv],
            "launched",
            env,
        )
        f.wait_for_workers(1)
        assert not uses_uvloop(proc.pid)  # the REPL host runs asyncio's own loop (the others: uvloop)
        worker = psutil.Process(proc.pid)
        listening = {c.laddr.port for c in worker.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        ports = sorted({int(wurl.port or 6379), int(urlparse(str(f.base_url)).port or 80), *listening})
        probe = PROBE.replace("__SECRETS__", repr([api_key, wurl.password])).replace("__PORTS__", repr(ports))
        top_code = (
            f"out = rlm_batch([{{'prompt': 'Probe. ' + {root_code_directive(probe)!r}, 'context': 'x'}}])\n"
            "answer['content'] = out[0]\nanswer['ready'] = True"
        )
        row = DatasetRow(id="probe", question="Probe the host. " + root_code_directive(top_code), context="x")
        s = load_settings(
            redis_url=acl_urls["producer"], base_url=str(f.base_url), model=model, tenant="t", max_depth=2
        )
        async with RLMEnv(settings=s) as env_:
            res = await env_.rollout(row, model=model, rollout_id=f"t_probe{uuid.uuid4().hex[:6]}")
        assert res.row.stop_reason == "answer_ready", (res.row.error, res.row.final_answer)
        seen = json.loads(res.row.final_answer or "")
        worker_env = open(f"/proc/{proc.pid}/environ", "rb").read()
        assert api_key.encode() in worker_env and wurl.password.encode() in worker_env  # the worker has both
    assert set(seen["reach"]) == {str(p) for p in ports} and seen["fds"], seen  # the probe ran in the child
    assert seen["found"] == [], seen
    assert all(v != "open" for v in seen["reach"].values()), seen
    ino = open(ino_out).read()
    assert not any(t == f"socket:[{ino}]" or t == held for t in seen["fds"].values()), seen["fds"]


async def test_a_repl_host_whose_clock_runs_15_s_ahead_takes_back_no_live_child(redis_url: str, tmp_path: Any) -> None:
    """Depth-2 trees on three REPL hosts (heartbeat TTL 10 s, the default), one with its wall clock
    15 s ahead: its reaper must not see the others' child leases as lapsed, and every tree answers.
    (With a 4 s TTL the skewed host's own child leases lapsed now and then while it was alive:
    its loop stalls for seconds somewhere while it hosts children under libfaketime; not
    understood yet, see the report of branch i22-fleet.)"""
    from tests.fleet.harness import skewed_env

    model = f"fleet-tskew-{uuid.uuid4().hex[:6]}"
    logs = str(tmp_path / "logs")
    with LocalFleet(
        redis_url=redis_url, model=model, workers=2, worker_concurrency=16, repl_slots=2,
        worker_args=["--heartbeat-ttl", "10"], log_dir=logs,
    ) as f:  # fmt: skip
        f.worker_env = skewed_env(15)
        f.start_worker("skewed")
        f.worker_env = {}
        f.wait_for_workers(3)
        out = await tree_job(redis_url, str(f.base_url), model, max_depth=2, rollouts=3, parts=3, tenant="s")
    text = log_text(logs)
    assert "clock is +15" in text
    assert all(s == "answer_ready" for s in out.stop_reasons) and out.correct == 3, out.summary()
    assert set(out.depths) == {2} and "took back" not in text, (out.summary(), text[-3000:])


async def test_an_evicting_redis_is_refused_by_a_repl_host_and_a_recursive_producer(
    evicting_redis: tuple[str, redis.Redis],
) -> None:
    from rlmq.common.errors import ConfigError
    from rlmq.common.settings import load_settings
    from rlmq.producer.env import RLMEnv

    url, admin = evicting_redis
    proc = subprocess.run(
        [sys.executable, "-m", "rlmq", "worker", "--model", "m", "--base-url", "http://127.0.0.1:9/v1",
         "--redis-url", url, "--repl-slots", "1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0 and admin.scard(K.RQ_WORKERS) == 0
    assert "maxmemory-policy allkeys-lru" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    s = load_settings(redis_url=url, base_url="http://127.0.0.1:9/v1", model="m", max_depth=3)
    with pytest.raises(ConfigError, match="noeviction"):
        async with RLMEnv(settings=s):
            pass


CHILD_SLOW = "out = llm_batch(['Slow leaf A. [[mock:sleep:4]]', 'Slow leaf B. [[mock:sleep:4]]'])\n" + (
    "answer['content'] = '|'.join(out)\nanswer['ready'] = True"
)


async def test_redis_restarted_mid_tree_ends_every_slot_with_an_error_and_nothing_hangs(
    private_redis: EmbeddedRedis, tmp_path: Any
) -> None:
    """A depth-2 tree whose children wait on slow leaf calls when Redis restarts empty: the top's
    ``rlm_batch`` slots end with errors within seconds (not at the 120 s deadline), the REPL host
    survives and registers again."""
    from rlmq.common.schemas import DatasetRow
    from rlmq.common.settings import load_settings
    from rlmq.producer.env import RLMEnv
    from rlmq.scripted.server import root_code_directive

    server = private_redis
    model = f"fleet-trestart-{uuid.uuid4().hex[:6]}"
    with LocalFleet(
        redis_url=server.url, model=model, workers=1, worker_concurrency=8, repl_slots=2,
        worker_args=["--heartbeat-ttl", "2"], log_dir=str(tmp_path / "logs"),
    ) as f:  # fmt: skip
        sync = redis.Redis.from_url(server.url, socket_connect_timeout=0.5, socket_timeout=2)
        task = {"prompt": "Child. " + root_code_directive(CHILD_SLOW), "context": "x"}
        top = f"out = rlm_batch([{task!r}, {task!r}])\nanswer['content'] = '|'.join(out)\nanswer['ready'] = True"
        row = DatasetRow(id="restart", question="Top. " + root_code_directive(top), context="x")
        s = load_settings(
            redis_url=server.url, base_url=str(f.base_url), model=model, tenant="r", max_depth=2,
            sub_call_timeout=120, rollout_timeout=120,
        )  # fmt: skip
        leaves = K.rq_started(f"{K.queue_name_for_model(model)}@r")
        async with RLMEnv(settings=s) as env:
            run = asyncio.create_task(env.rollout(row, model=model, rollout_id="r_top" + uuid.uuid4().hex[:6]))
            deadline = time.monotonic() + 40
            while sync.zcard(leaves) < 4:  # both children's leaf calls in flight
                assert time.monotonic() < deadline and not run.done(), "the leaves never started"
                await asyncio.sleep(0.05)  # polling the fleet's state, bounded by the deadline
            t0 = time.monotonic()
            server.stop()
            server.start()  # same port, empty
            res = await asyncio.wait_for(run, 40)
            waited = time.monotonic() - t0
        assert waited < 20, waited
        event = next(e for e in res.trajectory if e["type"] == "rlm_batch")
        assert [r["status"] for r in event["results"]] == ["error", "error"], event["results"]
        deadline = time.monotonic() + 20
        while True:  # the REPL host reconnects and registers again
            try:
                if sync.scard(K.rq_workers_of_queue(K.queue_name_for_model(model))) == 1:
                    break
            except redis.ConnectionError:
                pass
            assert time.monotonic() < deadline, "the REPL host did not register again"
            time.sleep(0.1)  # polling the worker's registration, bounded by the deadline
        assert all(p.poll() is None for p in f.group.procs)
        sync.close()


async def test_trees_answer_on_repl_hosts_whose_cpus_are_saturated(redis_url: str, tmp_path: Any) -> None:
    """Two busy processes per core beside two REPL hosts with the default heartbeat TTL (10 s):
    every depth-2 tree answers, and no child lease lapses (nothing taken back). (At a 4 s TTL, a
    REPL host's heartbeat was seen to lapse when the test suite's own processes loaded the same
    two cores as well; a lapse there re-runs the child, which still answers.)"""
    model = f"fleet-tcpu-{uuid.uuid4().hex[:6]}"
    logs = str(tmp_path / "logs")
    with LocalFleet(
        redis_url=redis_url, model=model, workers=2, worker_concurrency=16, repl_slots=2, log_dir=logs,
    ) as f:  # fmt: skip
        for i in range(2 * (os.cpu_count() or 1)):
            f.group.spawn([sys.executable, "-c", "while True: pass"], f"burn{i}")
        out = await tree_job(redis_url, str(f.base_url), model, max_depth=2, rollouts=2, parts=2, tenant="c")
    text = log_text(logs)
    assert all(s == "answer_ready" for s in out.stop_reasons) and out.correct == 2, out.summary()
    assert set(out.depths) == {2} and "took back" not in text, (out.summary(), text[-3000:])
