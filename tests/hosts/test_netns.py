"""The test fleet's hosts: namespaces on a bridge that reach each other, a link that goes down and
comes back, a delay proxy that adds its round trip, nothing left behind, and a loud failure where
namespaces cannot be made."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.hosts.netns import HostNet, NetnsUnavailable


def reach(net: HostNet, host: str, address: str, port: int) -> bool:
    probe = net.argv(host, ["timeout", "2", "bash", "-c", f"exec 3<>/dev/tcp/{address}/{port}"])
    return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0


def connect_seconds(net: HostNet, host: str, address: str, port: int) -> float:
    code = (
        "import socket,time\n"
        f"s=socket.create_connection(('{address}',{port}),5); s.sendall(b'x'); t=time.monotonic(); s.recv(1)\n"
        "print(time.monotonic()-t)"
    )
    done = subprocess.run(net.argv(host, [sys.executable, "-c", code]), capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


def test_hosts_reach_each_other_until_a_link_goes_down_and_a_proxy_adds_its_round_trip() -> None:
    with HostNet(subnet=9) as net:
        a, b = net.add("a"), net.add("b")
        assert (a, b) == ("10.213.9.1", "10.213.9.2")
        echo_code = (
            "import socket\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "s.bind(('127.0.0.1', 7000)); s.listen()\n"
            "while True:\n c,_=s.accept(); c.sendall(c.recv(1)); c.close()"
        )
        echo = subprocess.Popen(net.argv("b", [sys.executable, "-c", echo_code]))
        proxy_argv = [sys.executable, "-m", "tests.hosts.delay_proxy", "--listen", f"{b}:7001", "--to",
                      "127.0.0.1:7000", "--rtt-ms", "40"]  # fmt: skip
        proxy = subprocess.Popen(net.argv("b", proxy_argv), stdout=subprocess.PIPE)
        try:
            assert proxy.stdout is not None and b"listening" in proxy.stdout.readline()
            deadline = time.monotonic() + 10
            while not reach(net, "a", b, 7001):
                assert time.monotonic() < deadline, "host a cannot reach host b"
                time.sleep(0.1)  # the echo server starting, bounded
            # 40 ms added: one round trip of the echo (the connect to the proxy itself is local to the link)
            assert 0.035 <= connect_seconds(net, "a", b, 7001) < 0.5
            net.down("b")
            assert not reach(net, "a", b, 7001)
            net.up("b")
            assert reach(net, "a", b, 7001)
        finally:
            for p in (echo, proxy):
                p.kill()
                p.wait()
        names = [net.switch, net.ns("a"), net.ns("b")]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names), listed  # every namespace (and its links) removed


def test_without_ip_the_fleet_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(NetnsUnavailable, match="iproute2"):
        HostNet()
