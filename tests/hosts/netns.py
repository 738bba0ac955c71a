"""A fleet of hosts on one machine: Linux network namespaces joined by veth links and a bridge.

:class:`HostNet` makes a *switch* namespace holding a bridge, and one namespace per host whose
``eth0`` (one end of a veth pair; the other end is a port of the bridge) has an address of its
own in ``10.213.<subnet>.0/24``. Nothing is added to the machine's own namespace: every link,
address and the bridge live in namespaces this class created, and :meth:`HostNet.close` ends
their processes and deletes them (also after a failure, and at interpreter exit).

A host's link goes down with :meth:`HostNet.down` (its switch port is set down: its packets are
dropped, its TCP connections stall, as a pulled cable or a partition does) and comes back with
:meth:`HostNet.up`. Processes run on a host through ``ip netns exec`` (:meth:`HostNet.argv`).

Needs root and ``ip`` (iproute2); without them :class:`HostNet` raises, never skips.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import uuid

SUBNET = "10.213"
"""The private /16 the test fleets use inside their own namespaces."""


class NetnsUnavailable(AssertionError):
    """Network namespaces cannot be made here (not root, no ``ip``, a kernel without them)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    except FileNotFoundError as exc:
        raise NetnsUnavailable("the multi-host test fleet needs `ip` (iproute2)") from exc
    if check and done.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


class HostNet:
    """Hosts as network namespaces on one bridge (see the module docstring).

    Args:
        subnet: the third octet of the hosts' /24 (``10.213.<subnet>.0/24``).

    Raises:
        NetnsUnavailable: namespaces cannot be made (not root, no ``ip``, no kernel support).
    """

    def __init__(self, subnet: int = 7) -> None:
        if os.geteuid() != 0:
            raise NetnsUnavailable("the multi-host test fleet needs root (ip netns)")
        self.prefix = f"rlmqh{uuid.uuid4().hex[:5]}"
        self.subnet = subnet
        self.switch = f"{self.prefix}-sw"
        self.hosts: dict[str, str] = {}
        """Host name -> its address."""
        self._ports: dict[str, str] = {}
        self._made: list[str] = []
        atexit.register(self.close)
        try:
            self._add_ns(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def ns(self, host: str) -> str:
        """The namespace name of ``host``."""
        return f"{self.prefix}-{host}"

    def add(self, host: str) -> str:
        """Add a host on the bridge; returns its address (``10.213.<subnet>.<n>``)."""
        n = len(self.hosts) + 1
        ns, port = self.ns(host), f"p{n}"
        self._add_ns(ns)  # a failure from here on leaves it to close(), which the caller's `with` runs
        _ip("link", "add", "name", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")
        address = f"{SUBNET}.{self.subnet}.{n}"
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        self.hosts[host], self._ports[host] = address, port
        return address

    def argv(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run on ``host`` (``ip netns exec``: the same binary, working directory and environment)."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def down(self, host: str) -> None:
        """Take ``host``'s link down: its packets are dropped both ways until :meth:`up`."""
        _ip("-n", self.switch, "link", "set", self._ports[host], "down")

    def up(self, host: str) -> None:
        """Bring ``host``'s link back."""
        _ip("-n", self.switch, "link", "set", self._ports[host], "up")

    def close(self) -> None:
        """End every process in the fleet's namespaces and delete them (idempotent)."""
        for name in reversed(self._made):
            pids = _ip("netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", name, check=False)
        self._made.clear()
        atexit.unregister(self.close)

    def __enter__(self) -> HostNet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
