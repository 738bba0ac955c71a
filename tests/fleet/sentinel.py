"""A Redis master, its replica and one Sentinel on loopback (private ports), for failover tests."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

from rlmq.cli.local import LocalFleet
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.connection import async_client
from rlmq.common.redis_server import find_redis_server
from tests.fleet.harness import main_job

SERVICE = "rlmqm"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SentinelSet:
    """``redis-server`` master and replica (no persistence) and a Sentinel (quorum 1, the master down
    after ``down_ms``); :attr:`url` is the Sentinel URL. :meth:`kill_master` fails it over."""

    def __init__(self, folder: Path, down_ms: int = 1000) -> None:
        self.binary = find_redis_server()
        self.ports = {"master": _free_port(), "replica": _free_port(), "sentinel": _free_port()}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder)]
        try:
            self._start("master", [self.binary, "--port", str(self.ports["master"]), *common])
            self._start("replica", [self.binary, "--port", str(self.ports["replica"]), *common,
                                    "--replicaof", "127.0.0.1", str(self.ports["master"])])  # fmt: skip
            conf = folder / "sentinel.conf"
            conf.write_text(
                f"port {self.ports['sentinel']}\nbind 127.0.0.1\ndir {folder}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.ports['master']} 1\n"
                f"sentinel down-after-milliseconds {SERVICE} {down_ms}\n"
                f"sentinel failover-timeout {SERVICE} 5000\n"
            )
            self._start("sentinel", [self.binary, str(conf), "--sentinel"])
            self._wait_replicated()
        except BaseException:
            self.close()
            raise
        self.url = f"redis+sentinel://127.0.0.1:{self.ports['sentinel']}/{SERVICE}/0"

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.folder / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 15
        while True:
            try:
                if redis.Redis(port=self.ports[name], socket_timeout=1).ping():
                    return
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} did not start: {(self.folder / f'{name}.log').read_text()[-2000:]}")
            time.sleep(0.05)  # another process starting, bounded by the deadline

    def _wait_replicated(self) -> None:
        replica = redis.Redis(port=self.ports["replica"])
        sentinel = redis.Redis(port=self.ports["sentinel"])
        deadline = time.monotonic() + 20
        while True:
            link = replica.info("replication").get("master_link_status")
            known = sentinel.execute_command("SENTINEL", "REPLICAS", SERVICE)
            if link == "up" and known:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the replica did not sync or the Sentinel does not know it ({link})")
            time.sleep(0.1)  # replication starting, bounded by the deadline

    def master_port(self) -> int:
        """The port of the master the Sentinel names now."""
        host, port = redis.Redis(port=self.ports["sentinel"]).execute_command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE
        )
        return int(port)

    def kill_master(self) -> None:
        """``kill -9`` the master: the Sentinel promotes the replica after ``down_ms``."""
        proc = self.procs["master"]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def cut_replica(self) -> None:
        """Break the replica's replication for real: it follows a master that does not exist (a free
        port), keeping its data; whatever the master writes from now on never reaches it. The
        Sentinel still knows it as the master's replica, and promotes it when the master dies."""
        redis.Redis(port=self.ports["replica"]).execute_command("REPLICAOF", "127.0.0.1", str(_free_port()))

    def heal_replica(self) -> None:
        """Point the replica at the master again and wait until it has caught up."""
        redis.Redis(port=self.ports["replica"]).execute_command("REPLICAOF", "127.0.0.1", str(self.ports["master"]))
        master = redis.Redis(port=self.ports["master"])
        deadline = time.monotonic() + 15
        while master.execute_command("WAIT", 1, 200) < 1:
            if time.monotonic() > deadline:
                raise AssertionError("the replica did not catch up with the master")

    def wait_promoted(self, before: int, timeout: float = 20.0) -> int:
        """Wait until the Sentinel names another master than the port ``before``; its port."""
        deadline = time.monotonic() + timeout
        while (port := self.master_port()) == before:
            if time.monotonic() > deadline:
                raise AssertionError(f"the Sentinel did not promote the replica within {timeout:g} s")
            time.sleep(0.1)  # the Sentinel's down-after and election, bounded by the deadline
        return port

    def rejoin(self) -> None:
        """Start a Redis on the killed master's port as a replica of the master the Sentinel names
        now (what a supervisor restarting the lost host does; never as an empty master), and wait
        until it has synced."""
        master = self.master_port()
        self.ports["rejoined"] = self.ports["master"]
        common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.folder)]
        self._start("rejoined", [self.binary, "--port", str(self.ports["rejoined"]), *common,
                                 "--replicaof", "127.0.0.1", str(master)])  # fmt: skip
        deadline = time.monotonic() + 15
        while redis.Redis(port=self.ports["rejoined"]).info("replication").get("master_link_status") != "up":
            if time.monotonic() > deadline:
                raise AssertionError("the restarted Redis did not sync with the promoted master")
            time.sleep(0.05)  # a full sync of a small data set, bounded by the deadline

    def close(self) -> None:
        """Stop every process (idempotent)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


async def probe(url: str, stop: asyncio.Event, ok_at: list[float]) -> None:
    """INCR a key every 20 ms through ``url`` until ``stop``, noting when each answered (monotonic s)."""
    client = async_client(url)
    try:
        while not stop.is_set():
            try:
                await client.incr("rlmq-failover-probe")
                ok_at.append(time.monotonic())
            except Exception:  # noqa: BLE001 - a failover: the next try reconnects
                pass
            await asyncio.sleep(0.02)
    finally:
        await client.aclose()


async def probe_grants(url: str, stop: asyncio.Event, ok_at: list[float]) -> None:
    """Reserve and settle a grant of a probe ledger every 20 ms through ``url`` (its ledger waits for
    the replicas a Sentinel URL asks by default) until ``stop``, noting when each was granted."""
    client = async_client(url)
    ledger = BudgetLedger(client, ttl=600)
    try:
        await ledger.open("failover-probe", 10**12, cap=1)
        for i in itertools.count():
            if stop.is_set():
                return
            try:
                if (await ledger.reserve("failover-probe", f"p{i}", None)).granted:
                    ok_at.append(time.monotonic())
                    await ledger.settle("failover-probe", f"p{i}", 1)
            except Exception:  # noqa: BLE001 - a failover, or no replica to acknowledge: ask again
                pass
            await asyncio.sleep(0.02)
    finally:
        await client.aclose()


def _longest_gap(ok_at: list[float], since: float) -> float:
    return round(max((b - a for a, b in zip(ok_at, ok_at[1:], strict=False) if b > since), default=0.0), 2)


async def failover_run(
    folder: Path, *, kill_after: float = 1.0, calls: int = 16, budget: int = 1200, rejoin: bool = True
) -> dict[str, Any]:
    """The main job (3 rollouts x ``calls`` sub-calls of 100 tokens, 2 s each, ``budget`` each) on two
    workers through a Sentinel URL, the master killed ``kill_after`` seconds in; with ``rejoin``, its
    host is brought back as a replica of the promoted master once the Sentinel promoted it (the
    workers' grants wait for one replica's acknowledgement, the default with a Sentinel URL).
    Returns the job's counts (``out``: :class:`~tests.fleet.harness.Outcome`), ``no_service_s`` (the
    longest time a client's ``INCR`` every 20 ms got no answer), ``no_grants_s`` (the same for a
    grant every 20 ms), ``promoted_s`` and ``rejoined_s`` (after the kill), ``job_after_kill_s``,
    and whether the Sentinel names another master than before (``promoted``)."""
    s = SentinelSet(folder / "redis")
    try:
        before = s.master_port()
        with LocalFleet(redis_url=s.url, model="failover", workers=2, worker_concurrency=64,
                        log_dir=str(folder / "logs")) as f:  # fmt: skip
            stop, ok_at, granted_at = asyncio.Event(), [], []
            prober = asyncio.create_task(probe(s.url, stop, ok_at))
            grants = asyncio.create_task(probe_grants(s.url, stop, granted_at))
            job = asyncio.create_task(main_job(s.url, str(f.base_url), "failover", rollouts=3, calls=calls,
                                               budget=budget, tokens=100, sleep=2, timeout=30))  # fmt: skip
            await asyncio.sleep(kill_after)
            killed = time.monotonic()
            s.kill_master()
            await asyncio.to_thread(s.wait_promoted, before)
            promoted, rejoined = time.monotonic() - killed, None
            if rejoin:
                await asyncio.to_thread(s.rejoin)
                rejoined = round(time.monotonic() - killed, 1)
            out = await asyncio.wait_for(job, 90)
            finished = time.monotonic() - killed
            stop.set()
            await asyncio.gather(prober, grants)
        return {
            "out": out, "no_service_s": _longest_gap(ok_at, killed - 1),
            "no_grants_s": _longest_gap(granted_at, killed - 1),
            "promoted_s": round(promoted, 1), "rejoined_s": rejoined, "job_after_kill_s": round(finished, 1),
            "promoted": s.master_port() != before,
        }  # fmt: skip
    finally:
        s.close()


async def unreplicated_failover_run(
    folder: Path, *, replica_acks: int | None = None, kill_after: float = 1.0, calls: int = 16, budget: int = 800
) -> dict[str, Any]:
    """A failover that loses the master's last writes, under a fleet's main job: 3 rollouts x ``calls``
    sub-calls of 100 tokens (3 s each; grants of 100: ``budget // 100`` calls run at once, the rest
    wait for tokens) on two workers whose grants wait for ``replica_acks`` replicas (``None``: the
    default, 1 with a Sentinel URL). Once the rollouts' ledgers are on the replica, its replication
    is broken (:meth:`SentinelSet.cut_replica`), so the sub-calls' jobs and grants never reach it;
    ``kill_after`` seconds later the master is killed (``kill -9``) and the Sentinel promotes the
    replica; with acknowledgements asked, the killed master's host is brought back as a replica
    (:meth:`SentinelSet.rejoin`). Returns the job's counts (``out``) and the seconds from the kill
    to the promotion (``promoted_s``), to the rejoined replica (``rejoined_s``; ``None`` when not),
    and to the job's end (``job_after_kill_s``)."""
    s = SentinelSet(folder / "redis")
    args = [] if replica_acks is None else ["--redis-replica-acks", str(replica_acks)]
    try:
        before = s.master_port()
        with LocalFleet(redis_url=s.url, model="unreplicated", workers=2, worker_concurrency=64,
                        worker_args=[*args, "--redis-replica-ack-timeout", "0.2"],
                        log_dir=str(folder / "logs")) as f:  # fmt: skip
            cut = asyncio.Event()

            async def cut_replica() -> None:
                await asyncio.to_thread(s.heal_replica)  # the ledgers just opened are on the replica
                await asyncio.to_thread(s.cut_replica)
                cut.set()

            job = asyncio.create_task(main_job(s.url, str(f.base_url), "unreplicated", rollouts=3, calls=calls,
                                               budget=budget, tokens=100, sleep=3, timeout=30, cap=100,
                                               opened=cut_replica))  # fmt: skip
            await asyncio.wait_for(cut.wait(), 30)
            await asyncio.sleep(kill_after)
            killed = time.monotonic()
            s.kill_master()
            await asyncio.to_thread(s.wait_promoted, before)
            promoted = time.monotonic() - killed
            rejoined = None
            if replica_acks != 0:
                await asyncio.to_thread(s.rejoin)
                rejoined = round(time.monotonic() - killed, 1)
            out = await asyncio.wait_for(job, 90)
            finished = time.monotonic() - killed
        return {"out": out, "promoted_s": round(promoted, 1), "rejoined_s": rejoined,
                "job_after_kill_s": round(finished, 1)}  # fmt: skip
    finally:
        s.close()
