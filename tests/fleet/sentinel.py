"""A Redis master, its replica and one Sentinel on loopback (private ports), for failover tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from rlmq.common.redis_server import find_redis_server

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

    def close(self) -> None:
        """Stop every process (idempotent)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()
