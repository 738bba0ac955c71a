"""Hosted-tool calls in flight per rollout, fair between the rollouts that share one process.

A worker sends the calls of many rollouts' sub-LLMs and a rollout's process runs the calls of all
its rollouts; in both, every call costs a few turns of one event loop, a few Redis commands and
CPU of a shared host. A cap per rollout (:data:`~rlmq.common.tool_wire.CALLS_PER_ROLLOUT`) keeps one
rollout's flood from queueing the others behind it, but not from keeping hundreds of round trips a
second going beside another rollout's single call, whose every hop then waits behind them. What
costs the others is the rate of calls started, not the calls that wait on a slow tool.

:class:`FairTurns` makes the cap fair: a rollout alone has all ``cap`` calls in flight; while
another rollout has calls in flight (or ended its last one less than ``linger`` seconds ago, so a
rollout that calls one tool after another stays counted between its calls), a rollout may hold
no more *young* calls in flight (started less than ``young`` seconds ago) than the busiest of the
others holds calls (at least one), and never more than ``cap`` in all. A rollout with a single
call in flight thus holds a flood of instant calls to one call at a time, about its own rate;
a flood of slow calls still fills its cap, one more each ``young`` seconds; two floods keep
``cap`` each. Waiting calls of one rollout get their turns in the order they asked, and rollouts
are served in rotation.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import deque
from collections.abc import Callable

from rlmq.common.tool_wire import CALLS_PER_ROLLOUT

__all__ = ["LINGER", "YOUNG", "FairTurns"]

LINGER = 0.1
"""Seconds a rollout still counts as calling tools after its last call ended."""
YOUNG = 0.05
"""Seconds a call counts as young (its round trip still under way, not waiting on a slow tool)."""


class FairTurns:
    """Calls in flight per rollout (``key``), fair between rollouts (see the module docstring).

    Args:
        cap: most calls of one rollout in flight at once (>= 1).
        linger: seconds a rollout counts as active after its last call ended (>= 0).
        young: seconds a call counts against its rollout's fair share after it started (> 0).
        clock: monotonic seconds (a test's fake clock).

    Raises:
        ValueError: ``cap`` below 1, ``linger`` below 0 or ``young`` not above 0.
    """

    def __init__(
        self,
        cap: int = CALLS_PER_ROLLOUT,
        *,
        linger: float = LINGER,
        young: float = YOUNG,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if cap < 1 or linger < 0 or young <= 0:
            raise ValueError(f"cap must be >= 1, linger >= 0 and young > 0 (got {cap}, {linger}, {young})")
        self.cap, self.linger, self.young, self._clock = cap, linger, young, clock
        self._held: dict[str, list[float]] = {}  # start times of the calls in flight, oldest first
        self._ended: dict[str, float] = {}  # keys that hold none: when their last call ended
        self._waiting: dict[str, deque[asyncio.Future[float]]] = {}  # insertion order: the rotation
        self._timer: asyncio.TimerHandle | None = None

    def held(self, key: str) -> int:
        """Calls of ``key`` in flight."""
        return len(self._held.get(key, ()))

    def _young(self, key: str) -> int:
        starts = self._held.get(key)
        return len(starts) - bisect.bisect_right(starts, self._clock() - self.young) if starts else 0

    def waiting(self, key: str) -> int:
        """Calls of ``key`` waiting for a turn (:meth:`acquire`)."""
        return len(self._waiting.get(key, ()))

    def room(self, key: str) -> int:
        """Calls ``key`` may start now without waiting: 0 when none, or when earlier calls of
        ``key`` wait for their turn; at most ``cap`` less its calls in flight; when no other
        rollout is active, exactly that; else at most the most calls any other holds (at least 1)
        less its own young calls."""
        if self._waiting.get(key):
            return 0
        return self._room(key)

    def _room(self, key: str) -> int:
        room = self.cap - self.held(key)
        busiest = max((len(s) for k, s in self._held.items() if k != key), default=0)
        if room <= 0 or (busiest == 0 and not self._lingering(key)):
            return max(0, room)
        return max(0, min(room, max(1, busiest) - self._young(key)))

    def hold(self, key: str) -> float:
        """Count one call of ``key`` in flight, without waiting (the caller checked :meth:`room`,
        or holds it past its share on purpose: a call already under way).

        Returns:
            The turn, to :meth:`release` when the call ends.
        """
        now = self._clock()
        self._held.setdefault(key, []).append(now)
        self._ended.pop(key, None)
        self._prune(now)
        return now

    def release(self, key: str, turn: float) -> None:
        """End one call of ``key`` (``turn``: what :meth:`hold` or :meth:`acquire` returned); lets
        waiting calls start.

        Raises:
            KeyError / ValueError: ``key`` holds no such turn.
        """
        starts = self._held[key]
        starts.remove(turn)
        if not starts:
            del self._held[key]
            self._ended[key] = self._clock()
        self._wake()

    async def acquire(self, key: str, timeout: float) -> float | None:
        """Wait for a turn of ``key`` (FIFO among its calls), at most ``timeout`` seconds.

        Returns:
            The turn (:meth:`release` it when the call ends), or ``None``: none came in time.
        """
        if self.room(key) > 0:
            return self.hold(key)
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, deque()).append(fut)
        try:
            await asyncio.wait([fut], timeout=max(0.0, timeout))
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(key, fut.result())  # handed over as the caller was cancelled: given back
            self._drop(key, fut)
            raise
        if fut.done():
            return fut.result()
        self._drop(key, fut)
        return None

    def _drop(self, key: str, fut: asyncio.Future[float]) -> None:
        fut.cancel()
        queue = self._waiting.get(key)
        if queue is not None:
            try:
                queue.remove(fut)
            except ValueError:
                pass
            if not queue:
                del self._waiting[key]
        self._wake()  # a rollout that stopped waiting may let the next one in

    def _lingering(self, key: str) -> bool:
        self._prune(self._clock())
        return any(k != key for k in self._ended)

    def _prune(self, now: float) -> None:
        """Forget the rollouts that stopped lingering (oldest first: the dict is in ending order)."""
        for k, ended in list(self._ended.items()):
            if now - ended < self.linger:
                break
            del self._ended[k]

    def _wake(self) -> None:
        """Hand turns to waiting calls, a rollout at a time in rotation, while any has room; when
        some still wait, look again once a call grows old or a rollout stops lingering."""
        self._prune(self._clock())
        granted = True
        while granted:
            granted = False
            for key in list(self._waiting):
                queue = self._waiting[key]
                while queue and queue[0].done():
                    queue.popleft()  # a waiter that gave up
                if queue and self._room(key) > 0:
                    fut = queue.popleft()
                    fut.set_result(self.hold(key))
                    granted = True
                    self._waiting[key] = self._waiting.pop(key)  # to the back of the rotation
                if not queue:
                    self._waiting.pop(key, None)
        if self._waiting and self._timer is None:
            now = self._clock()
            moments = [ended + self.linger for ended in self._ended.values()]
            for starts in self._held.values():
                i = bisect.bisect_right(starts, now - self.young)
                if i < len(starts):
                    moments.append(starts[i] + self.young)  # its oldest young call grows old
            if moments:
                delay = max(0.0, min(moments) - now) + 0.001
                self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._wake()
