"""Fleet-wide provider limits on fakeredis (Lua through lupa): requests, tokens and concurrent
requests per upstream, shared by every limiter (worker) of one Redis; 429 pauses; fair waits."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from typing import Any

import fakeredis
import pytest

from rlmq.cli.status import collect, render
from rlmq.common import keys as K
from rlmq.common.provider_limits import Permit, ProviderLimiter, ProviderLimits, snapshot
from rlmq.scripted.quota import ProviderQuota
from rlmq.workers.provider_transport import LimitedTransport, request_tokens, spent_tokens
from rlmq.workers.transport import HttpReply


def limiter(server: fakeredis.FakeServer, name: str = "w1", **limits: Any) -> ProviderLimiter:
    r = fakeredis.aioredis.FakeRedis(server=server)
    return ProviderLimiter(r, ProviderLimits(upstream="up", margin=0.0, **limits), name=name)


def grant_times(server: fakeredis.FakeServer) -> list[float]:
    """The grant times (Redis's clock) in the upstream's window log."""
    r = fakeredis.FakeRedis(server=server)
    entries: list[Any] = r.zrange(K.ProviderKeys("up").requests, 0, -1, withscores=True)
    return sorted(float(entry[1]) for entry in entries)


async def test_two_workers_share_one_requests_per_window_limit() -> None:
    server = fakeredis.FakeServer()
    a, b = limiter(server, "a", rpm=5, window=0.6), limiter(server, "b", rpm=5, window=0.6)
    started = time.monotonic()
    times: list[float] = []

    async def one(x: ProviderLimiter) -> Permit:
        permit = await x.acquire(0, lease=10, timeout=10)
        times.append(time.monotonic())
        return permit

    permits = await asyncio.gather(*(one(x) for x in (a, b) for _ in range(7)))
    took = time.monotonic() - started
    assert len({p.id for p in permits}) == 14
    # never more than 5 grants in any 0.6 s (less a little for the in-process round trips), across both workers
    assert max(sum(1 for t in times if s <= t < s + 0.55) for s in times) == 5
    assert 1.1 <= took < 4.0, took  # 14 requests at 5 per 0.6 s: three windows
    assert sum(p.refused for p in permits) == 9


async def test_tokens_count_the_cap_first_and_what_was_spent_after() -> None:
    server = fakeredis.FakeServer()
    lim = limiter(server, tpm=100, window=30)
    first = await lim.acquire(60, lease=10, timeout=5)
    second = asyncio.ensure_future(lim.acquire(60, lease=10, timeout=5))
    await asyncio.sleep(0.2)
    assert not second.done()  # 60 + 60 > 100 while the first counts its cap
    await lim.finish(first, 10)  # it spent 10: 10 + 60 fits
    permit = await asyncio.wait_for(second, 2)
    assert permit.refused and permit.tokens == 60
    snap = snapshot(fakeredis.FakeRedis(server=server))
    assert [(s["upstream"], s["requests"], s["tokens"], s["tpm"]) for s in snap] == [("up", 2, 70, 100)]


async def test_a_call_whose_cap_alone_passes_the_tokens_limit_runs_in_an_empty_window() -> None:
    lim = limiter(fakeredis.FakeServer(), tpm=100, window=30)
    permit = await lim.acquire(500, lease=10, timeout=2)
    assert permit.tokens == 500 and not permit.refused


async def test_concurrent_requests_wait_for_one_to_end() -> None:
    server = fakeredis.FakeServer()
    a, b = limiter(server, "a", max_concurrent=2), limiter(server, "b", max_concurrent=2)
    p1, p2 = await a.acquire(0, lease=10, timeout=2), await b.acquire(0, lease=10, timeout=2)
    third = asyncio.ensure_future(a.acquire(0, lease=10, timeout=5))
    await asyncio.sleep(0.2)
    assert not third.done()
    await b.finish(p2, 0)
    assert (await asyncio.wait_for(third, 2)).refused
    await a.finish(p1, None)


async def test_a_dead_workers_request_stops_counting_when_its_lease_lapses() -> None:
    server = fakeredis.FakeServer()
    dead, alive = limiter(server, "dead", max_concurrent=1), limiter(server, "alive", max_concurrent=1)
    await dead.acquire(0, lease=0.4, timeout=2)  # never finished
    started = time.monotonic()
    await alive.acquire(0, lease=10, timeout=3)
    assert 0.25 <= time.monotonic() - started < 2.0


async def test_a_pause_holds_every_worker_of_the_upstream() -> None:
    server = fakeredis.FakeServer()
    a, b = limiter(server, "a", rpm=1000), limiter(server, "b", rpm=1000)
    await a.pause(0.5)
    started = time.monotonic()
    await b.acquire(0, lease=10, timeout=3)
    assert 0.4 <= time.monotonic() - started < 1.5
    assert await a.pause(0.0) > 0  # a shorter pause never shortens a longer one


async def test_an_ask_that_times_out_counts_nothing() -> None:
    server = fakeredis.FakeServer()
    lim = limiter(server, rpm=1, window=30)
    await lim.acquire(0, lease=10, timeout=1)
    with pytest.raises(TimeoutError, match="provider limits of upstream 'up'"):
        await lim.acquire(0, lease=10, timeout=0.3)
    await asyncio.sleep(0.1)
    assert len(grant_times(server)) == 1
    await lim.close()


async def test_waiting_requests_are_granted_round_robin_over_rollouts() -> None:
    lim = limiter(fakeredis.FakeServer(), rpm=2, window=0.3)
    order: list[str] = []

    async def one(key: str) -> None:
        await lim.acquire(0, lease=10, key=key, timeout=10)
        order.append(key)

    burst = [asyncio.ensure_future(one("a")) for _ in range(10)]
    await asyncio.sleep(0.05)
    late = asyncio.ensure_future(one("b"))
    await asyncio.gather(*burst, late)
    assert order.index("b") <= 3, order  # not behind the whole burst of "a"


def reply(status: int, body: dict[str, Any] | None = None, headers: Mapping[str, str] | None = None) -> HttpReply:
    return HttpReply(status, dict(headers or {}), json.dumps(body or {}).encode())


class Provider:
    """An in-memory provider: answers 429 (Retry-After 0.3) to its first ``refuse`` requests."""

    def __init__(self, refuse: int) -> None:
        self.refuse = refuse
        self.arrivals: list[float] = []

    async def post(self, url: str, data: bytes, *, headers: Mapping[str, str], timeout: float) -> HttpReply:
        self.arrivals.append(time.monotonic())
        if len(self.arrivals) <= self.refuse:
            return reply(429, {"error": "rate"}, {"Retry-After": "0.3"})
        return reply(200, {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}})

    async def close(self) -> None:
        pass


async def test_a_429_pauses_the_upstream_for_the_fleet_and_the_request_is_sent_again() -> None:
    server = fakeredis.FakeServer()
    provider = Provider(refuse=1)
    one = LimitedTransport(provider, limiter(server, "a", rpm=1000, tpm=10**6))
    other = limiter(server, "b", rpm=1000)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}).encode()
    got = await one.post("http://x/v1/chat/completions", body, headers={}, timeout=5)
    assert got.status == 200 and one.answered_429 == 1
    assert provider.arrivals[1] - provider.arrivals[0] >= 0.25  # sent again after the pause
    paused_at = time.monotonic()
    await one.limiter.pause(0.3)
    await other.acquire(0, lease=5, timeout=3)  # another worker waits for the pause too
    assert time.monotonic() - paused_at >= 0.25
    await one.close()
    snap = snapshot(fakeredis.FakeRedis(server=server))[0]
    assert snap["tokens"] == 12 + 0 + 0  # the 429 counts no tokens, the answer its usage


def test_a_request_counts_its_body_and_its_cap() -> None:
    body = json.dumps({"messages": [{"role": "user", "content": '"max_tokens": 9 x'}], "max_tokens": 40}).encode()
    assert request_tokens(body) == -(-len(body) // 4) + 40
    assert spent_tokens(reply(200, {"usage": {"prompt_tokens": 3, "completion_tokens": 4}})) == 7
    assert spent_tokens(reply(200, {"choices": []})) is None
    assert spent_tokens(reply(500)) == 0


def test_the_scripted_quota_refuses_past_its_limits_and_says_when_to_come_back() -> None:
    now = [1000.0]
    quota = ProviderQuota(rpm=2, tpm=100, window=10, clock=lambda: now[0])
    first, _ = quota.admit(30)
    assert first is not None and quota.admit(30)[0] is not None
    assert quota.admit(1) == (None, 10)  # a third request in the window: 429, Retry-After 10
    now[0] += 10.5
    entry, _ = quota.admit(90)
    assert entry is not None
    assert quota.admit(20)[0] is None  # 90 + 20 > 100 tokens
    quota.settle(entry, 40)  # it spent 40
    assert quota.admit(20)[0] is not None
    assert (quota.accepted, quota.refused) == (4, 2)


async def test_rlmq_status_shows_what_is_used_of_each_limit() -> None:
    server = fakeredis.FakeServer()
    lim = limiter(server, rpm=600, tpm=100_000, max_concurrent=8)
    permits = [await lim.acquire(300, lease=30, timeout=2) for _ in range(3)]
    await lim.finish(permits[0], 120)
    await lim.pause(5)
    text = render(collect(fakeredis.FakeRedis(server=server)))
    row = next(line for line in text.splitlines() if line.startswith("up "))
    assert "PROVIDER LIMITS (1)" in text
    cells = row.split()
    assert cells[:6] == ["up", "60", "s", "3/600", "720/100000", "2/8"], row  # 300 + 300 + 120 spent
    assert cells[6] in ("4.9", "5.0") and cells[7] == "s", row


def test_the_share_of_the_limit_counts_whole_windows_while_there_was_work() -> None:
    from tests.fleet.provider import rpm_share

    bursts = [0.0] * 10 + [1.05] * 10 + [2.1] * 4  # 10 per 1 s window, then the work ran out
    assert rpm_share(bursts, 10, 1.0) == 1.0
    paced = [i * 0.2 for i in range(24)]  # half the limit's pace
    assert rpm_share(paced, 10, 1.0) == 0.5
    assert rpm_share([0.0, 0.1], 10, 1.0) == 0.2
