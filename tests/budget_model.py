"""An interleaving explorer for the budget wait's wake-ups, driving the real code on fakeredis.

A *schedule* is run on one fresh event loop and one fresh fakeredis server. Worker process W
(a :class:`BudgetLedger` and its :class:`ReleaseWaits`) starts budgeted calls; the rest of the
fleet, O (another client on the same server), holds one running call per rollout. Every rollout
has a budget of ``BUDGET`` tokens (the demo's ``--sub-llm-max-completion-tokens 20``): O's
call holds all of it, so W's calls are told to wait for half a grant (10). The events of a
schedule, in its order, with ``gaps[i]`` event-loop turns after event ``i``:

* ``("call", r)``: W starts a call of rollout ``r`` (``acquire``; once granted it settles with
  ``USED`` tokens, publishing a release that may wake W's own other calls),
* ``("settle", r)``: O's call of rollout ``r`` finishes with ``USED`` tokens,
* ``("kill", -1)``: W's pub/sub connection is cut (its socket closed under it).

A schedule also says how many loop turns a new connection takes to connect (``connect_turns``:
a busy machine) and whether W's pool has an idle connection when the first wait starts
(``warm``: on a busy worker every pooled connection is in use by other calls).

The property (:func:`run`): once every event has happened and the loop is quiet, every call
of W has been granted. With budget 20 and 2 tokens used a call, every call fits, so a call
still waiting then waits while tokens are free and nothing runs: a lost wake-up.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import fakeredis
from fakeredis._clients._async import FakeAsyncRedisConnection

from rlmq.common.budget.ledger import GRANTED, BudgetLedger
from rlmq.common.budget.wait import ReleaseWaits

BUDGET = 20
USED = 2
QUIET = -1
"""A gap that runs the loop until nothing is ready to run and no timer is due within
:data:`SOON` seconds (a reconnect backoff is; the calls' own timers are a minute away, so a call
still waiting then waits for a wake-up that did not come)."""
SOON = 5.0
MAX_TURNS = 5_000


async def _turns(n: int) -> None:
    """Run ``n`` loop turns, or with :data:`QUIET` until no callback is ready (at most :data:`MAX_TURNS`)."""
    if n != QUIET:
        for _ in range(n):
            await asyncio.sleep(0)
        return
    loop: Any = asyncio.get_running_loop()
    for _ in range(MAX_TURNS):
        await asyncio.sleep(0)
        if loop._ready:
            continue
        # Only this task's own wake-up was ready: the rest waits for a future or a timer.
        due = [h.when() for h in loop._scheduled if not h.cancelled()]
        wait = min(due, default=float("inf")) - loop.time()
        if wait > SOON:
            return
        await asyncio.sleep(max(0.0, wait))


@dataclass(frozen=True)
class Schedule:
    events: tuple[tuple[str, int], ...]
    gaps: tuple[int, ...]
    connect_turns: int
    warm: bool

    def __str__(self) -> str:
        steps = " ".join(
            f"{k}{'' if r < 0 else f'(R{r})'} +{'quiet' if g == QUIET else g}"
            for (k, r), g in zip(self.events, self.gaps, strict=True)
        )
        return f"[{steps}] connect_turns={self.connect_turns} warm={self.warm}"


def _slow_connection(turns: int) -> type[FakeAsyncRedisConnection]:
    class SlowConnect(FakeAsyncRedisConnection):
        async def _connect(self) -> None:
            for _ in range(turns):
                await asyncio.sleep(0)  # a loop turn: what a connect costs on a busy machine
            await super()._connect()

    return SlowConnect


async def _run(schedule: Schedule) -> str | None:
    server = fakeredis.FakeServer()
    conn_class = _slow_connection(schedule.connect_turns)
    w_client = fakeredis.aioredis.FakeRedis(server=server, connection_class=conn_class)
    o_client = fakeredis.aioredis.FakeRedis(server=server)
    w, o = BudgetLedger(w_client, ttl=60), BudgetLedger(o_client, ttl=60)
    if not schedule.warm:  # W's pub/sub connection comes from a pool with no idle connection
        cold = fakeredis.aioredis.FakeRedis(server=server, connection_class=conn_class)
        w._waits = ReleaseWaits(cold, w._park_changed)
    deadline = time.time() + 60
    rollouts = sorted({r for kind, r in schedule.events if r >= 0})
    for r in rollouts:
        await o.open(f"R{r}", BUDGET)
        held = await o.reserve(f"R{r}", "o", None, deadline)
        assert held.tokens == BUDGET, held
    calls: list[tuple[str, asyncio.Task[Any]]] = []

    async def call(rollout: str, rid: str) -> int:
        grant, _, _ = await w.acquire(rollout, rid, None, deadline)
        if grant.code == GRANTED:
            await w.settle(rollout, rid, USED)
        return grant.code

    try:
        for (kind, r), gap in zip(schedule.events, schedule.gaps, strict=True):
            if kind == "call":
                rid = f"w{len(calls)}"
                calls.append((f"R{r}:{rid}", asyncio.create_task(call(f"R{r}", rid))))
            elif kind == "settle":
                await o.settle(f"R{r}", "o", USED)
            elif kind == "kill":
                waits: Any = w._waits
                for conn in _w_pubsub_connections(waits):
                    sock = getattr(conn, "_sock", None)
                    await conn.disconnect()
                    if sock is not None:
                        sock._response_available.set()  # a read blocked on it returns, as on a real socket's EOF
            await _turns(gap)
        await _turns(QUIET)
        stuck = [name for name, t in calls if not t.done()]
        failed = [f"{name}: {t.exception()!r}" for name, t in calls if t.done() and t.exception()]
        codes = [(name, t.result()) for name, t in calls if t.done() and not t.exception()]
        wrong = [f"{name}: code {code}" for name, code in codes if code != GRANTED]
        if stuck or failed or wrong:
            return f"still waiting {stuck}, failed {failed}, not granted {wrong}"
        return None
    finally:
        for _, t in calls:
            t.cancel()
        await asyncio.gather(*(t for _, t in calls), return_exceptions=True)
        await w.aclose()
        await o.aclose()


def _w_pubsub_connections(waits: Any) -> list[Any]:
    """W's pub/sub connection(s), whichever way the code under test keeps them."""
    if waits is None:
        return []
    found = []
    link = getattr(waits, "_link", None)
    if link is not None:
        found.append(link.conn)
    pubsub = getattr(waits, "_pubsub", None)
    if pubsub is not None and pubsub.connection is not None:
        found.append(pubsub.connection)
    return found


def run(schedule: Schedule) -> str | None:
    """Run one schedule on a fresh loop; ``None`` when the property holds, else what went wrong."""
    quiet = logging.getLogger("rlmq.common.budget.wait")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the kills' reconnect warnings, thousands of times
    try:
        return asyncio.run(_run(schedule))
    finally:
        quiet.setLevel(level)


def schedules(
    calls: Sequence[int], *, gaps: Sequence[int], connect_turns: Sequence[int], kill: bool = False
) -> Iterator[Schedule]:
    """Every schedule of a scenario: ``calls[r]`` calls of rollout ``r`` on W, one settle of O's call
    per rollout, optionally one pub/sub kill; every order of those events
    (O's settles and W's calls interleaved every way), every gap, connect time and pool state."""
    base: list[tuple[str, int]] = [("call", r) for r, n in enumerate(calls) for _ in range(n)]
    base += [("settle", r) for r in range(len(calls))]
    if kill:
        base.append(("kill", -1))
    seen: set[tuple[tuple[str, int], ...]] = set()
    for order in itertools.permutations(base):
        if order in seen:
            continue
        seen.add(order)
        for gap in itertools.product(gaps, repeat=len(order) - 1):
            for turns in connect_turns:
                for warm in (False, True):
                    yield Schedule(order, (*gap, QUIET), turns, warm)


def explore(scenario: Iterator[Schedule], limit: int | None = None) -> tuple[int, Schedule | None, str | None]:
    """Run schedules until one breaks the property; ``(schedules run, the counterexample, why)``."""
    n = 0
    for schedule in scenario:
        n += 1
        why = run(schedule)
        if why is not None:
            return n, schedule, why
        if limit is not None and n >= limit:
            break
    return n, None, None
