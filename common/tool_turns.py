"""Hosted-tool calls in flight per rollout, fair between the rollouts that share one process.

A worker sends the calls of many rollouts' sub-LLMs and a rollout's process runs the calls of all
its rollouts; in both, every call costs a few turns of one event loop, a few Redis commands and
CPU of a shared host. A cap per rollout (:data:`~rlmq.common.tool_wire.CALLS_PER_ROLLOUT`) keeps one
rollout's flood from queueing the others behind it, but not from keeping hundreds of round trips a
second going beside another rollout's single call, whose every hop then waits behind them.

:class:`FairTurns` makes the cap fair: a rollout alone has all ``cap`` calls in flight; while
another rollout has calls in flight (or ended its last one less than ``linger`` seconds ago, so a
rollout that calls one tool after another stays counted between its calls), a rollout may hold
no more calls in flight than the busiest of the others (at least one). A rollout with a single
call in flight thus holds a flooding one to a single call too: each gets the same turns, whatever
it has pending; two floods keep ``cap`` each. Waiting calls of one rollout get their turns in the
order they asked, and rollouts are served in rotation.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from rlmq.common.tool_wire import CALLS_PER_ROLLOUT

__all__ = ["LINGER", "FairTurns"]

LINGER = 0.1
"""Seconds a rollout still counts as calling tools after its last call ended."""


class FairTurns:
    """Calls in flight per rollout (``key``), fair between rollouts (see the module docstring).

    Args:
        cap: most calls of one rollout in flight at once (>= 1).
        linger: seconds a rollout counts as active after its last call ended (>= 0).
        clock: monotonic seconds (a test's fake clock).

    Raises:
        ValueError: ``cap`` below 1 or ``linger`` below 0.
    """

    def __init__(
        self, cap: int = CALLS_PER_ROLLOUT, *, linger: float = LINGER, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if cap < 1 or linger < 0:
            raise ValueError(f"cap must be >= 1 and linger >= 0 (got {cap}, {linger})")
        self.cap, self.linger, self._clock = cap, linger, clock
        self._held: dict[str, int] = {}
        self._ended: dict[str, float] = {}  # keys that hold none: when their last call ended
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}  # insertion order: the rotation
        self._timer: asyncio.TimerHandle | None = None

    def held(self, key: str) -> int:
        """Calls of ``key`` in flight."""
        return self._held.get(key, 0)

    def waiting(self, key: str) -> int:
        """Calls of ``key`` waiting for a turn (:meth:`acquire`)."""
        return len(self._waiting.get(key, ()))

    def limit(self, key: str) -> int:
        """Calls ``key`` may hold in flight now: ``cap`` when no other rollout is active, else the
        most any other holds, at least 1 and at most ``cap``."""
        busiest = max((n for k, n in self._held.items() if k != key), default=0)
        if busiest == 0 and not self._lingering(key):
            return self.cap
        return min(self.cap, max(1, busiest))

    def room(self, key: str) -> int:
        """Calls ``key`` may start now without waiting (0 when none, or when earlier calls of
        ``key`` wait for their turn)."""
        if self._waiting.get(key):
            return 0
        return max(0, self.limit(key) - self.held(key))

    def hold(self, key: str) -> None:
        """Count one call of ``key`` in flight, without waiting (the caller checked :meth:`room`,
        or holds it past the limit on purpose: a call already under way); :meth:`release` ends it."""
        self._held[key] = self._held.get(key, 0) + 1
        self._ended.pop(key, None)

    def release(self, key: str) -> None:
        """End one call of ``key`` (held by :meth:`hold` or :meth:`acquire`); lets waiting calls start.

        Raises:
            KeyError: ``key`` holds no call.
        """
        left = self._held[key] - 1
        if left:
            self._held[key] = left
        else:
            del self._held[key]
            self._ended[key] = self._clock()
        self._wake()

    async def acquire(self, key: str, timeout: float) -> bool:
        """Wait for a turn of ``key`` (FIFO among its calls), at most ``timeout`` seconds.

        Returns:
            ``True``: the turn is held (:meth:`release` it); ``False``: none came in time.
        """
        if self.room(key) > 0:
            self.hold(key)
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, deque()).append(fut)
        try:
            await asyncio.wait([fut], timeout=max(0.0, timeout))
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(key)  # handed over as the caller was cancelled: given back
            self._drop(key, fut)
            raise
        if fut.done():
            return True
        self._drop(key, fut)
        return False

    def _drop(self, key: str, fut: asyncio.Future[None]) -> None:
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
        now = self._clock()
        for k, ended in list(self._ended.items()):
            if now - ended >= self.linger:
                del self._ended[k]
        return any(k != key for k in self._ended)

    def _wake(self) -> None:
        """Hand turns to waiting calls, a rollout at a time in rotation, while any has room; when
        some still wait only because another rollout lingers, look again once it stops counting."""
        granted = True
        while granted:
            granted = False
            for key in list(self._waiting):
                queue = self._waiting[key]
                while queue and queue[0].done():
                    queue.popleft()  # a waiter that gave up
                if queue and self.limit(key) > self.held(key):
                    fut = queue.popleft()
                    self.hold(key)
                    fut.set_result(None)
                    granted = True
                    self._waiting[key] = self._waiting.pop(key)  # to the back of the rotation
                if not queue:
                    self._waiting.pop(key, None)
        if self._waiting and self._ended and self._timer is None:
            when = min(self._ended.values()) + self.linger - self._clock()
            self._timer = asyncio.get_running_loop().call_later(max(0.0, when) + 0.001, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._wake()
