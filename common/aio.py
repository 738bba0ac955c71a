"""Running rlmq's event loops: uvloop when it is installed, asyncio's own loop otherwise.

uvloop cuts the per-hop cost of the queue path (each sub-call crosses several sockets; see
``bench/README.md``). The worker and the ``rlmq`` commands run on it; ``RLMEnv`` inside a
trainer runs on whatever loop the trainer has.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Collection, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

RECANCEL_SECONDS = 1.0
"""After Ctrl-C, how often the main coroutine is cancelled again while it still runs."""

RECANCEL_TASK_SECONDS = 0.1
"""How often :func:`cancel_and_wait` cancels again the tasks that have not ended yet."""


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """``uvloop.new_event_loop`` when uvloop is importable, else ``None`` (asyncio's default)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class SigintLatch:
    """The SIGINT handler of an ``rlmq`` command: it counts every Ctrl-C.

    Outside an event loop it raises ``KeyboardInterrupt`` as Python's default handler does;
    Python drops an exception raised while a finalizer (``__del__``) runs, so the count is
    what :func:`run` trusts: a command that was interrupted before its loop started stops
    there. Inside :func:`run` it cancels the main coroutine instead.
    """

    def __init__(self) -> None:
        self.count = 0
        self.on_interrupt: Callable[[], None] | None = None

    def __call__(self, signum: int, frame: object) -> None:
        self.count += 1
        if self.on_interrupt is not None:
            self.on_interrupt()
            return
        raise KeyboardInterrupt


@contextlib.contextmanager
def sigint_latch() -> Iterator[SigintLatch]:
    """Install a :class:`SigintLatch` as the SIGINT handler for the block (main thread only;
    elsewhere the latch is returned but not installed), and restore the previous one after."""
    latch = SigintLatch()
    try:
        previous = signal.signal(signal.SIGINT, latch)
    except ValueError:  # not the main thread
        yield latch
        return
    try:
        yield latch
    finally:
        if signal.getsignal(signal.SIGINT) is latch:
            signal.signal(signal.SIGINT, previous)


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh event loop (uvloop when installed), like ``asyncio.run``.

    Ctrl-C (SIGINT) cancels ``main``, as ``asyncio.run`` does, but does not rely on that one
    cancellation arriving: redis-py's asyncio client now and then swallows a cancellation
    that lands inside a command (measured with redis-py 8.1: about one cancel in four of a
    ``PING`` under uvloop, one in seventy on asyncio's own loop), and ``main`` would then run
    on as if nothing happened. So while ``main`` still runs it is cancelled again every
    ``RECANCEL_SECONDS``, and when it ends, however it ends, ``KeyboardInterrupt`` is raised.
    Under :func:`sigint_latch` (the ``rlmq`` commands), a Ctrl-C that came before the loop
    started stops the run before ``main`` begins. A command that installs its own SIGINT
    handler inside ``main`` (the worker's graceful stop) replaces this one.

    Raises:
        KeyboardInterrupt: SIGINT arrived while ``main`` ran (or, under a latch, before).
    """
    current = signal.getsignal(signal.SIGINT)
    if isinstance(current, SigintLatch):
        return _run(main, current)
    with sigint_latch() as latch:
        return _run(main, latch)


def _run(main: Coroutine[Any, Any, T], latch: SigintLatch) -> T:
    if latch.count:
        main.close()  # never started
        raise KeyboardInterrupt
    # While the loop is set up and torn down the latch only counts: a KeyboardInterrupt raised
    # in there lands in uvloop's own code or a finalizer it runs (measured: a segfault, now
    # and then); _interruptible looks at the count once the loop runs.
    latch.on_interrupt = _count_only
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            result = runner.run(_interruptible(main, latch))
    except asyncio.CancelledError:
        if latch.count:  # turned into KeyboardInterrupt here, outside the loop: raised inside
            raise KeyboardInterrupt from None  # a uvloop task it crashed the loop (a segfault)
        raise
    finally:
        latch.on_interrupt = None
    if latch.count:
        raise KeyboardInterrupt
    return result


def _count_only() -> None:
    """:attr:`SigintLatch.on_interrupt` while no coroutine can be cancelled: the count is all."""


async def _interruptible(main: Coroutine[Any, Any, T], latch: SigintLatch) -> T:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    timer: asyncio.TimerHandle | None = None

    def cancel() -> None:
        nonlocal timer
        if timer is not None:
            timer.cancel()
        if not task.done():
            task.cancel()
            timer = loop.call_later(RECANCEL_SECONDS, cancel)

    # The latch runs in the main thread between bytecodes; it hands over to the loop.
    def hand_over() -> None:
        loop.call_soon_threadsafe(cancel)

    latch.on_interrupt = hand_over
    if latch.count:  # a Ctrl-C came while the loop was being set up
        cancel()
    try:
        return await main
    finally:
        latch.on_interrupt = _count_only
        if timer is not None:
            timer.cancel()


async def cancel_and_wait(tasks: Collection[asyncio.Future[Any]]) -> None:
    """Cancel ``tasks`` and wait until every one has ended, cancelling again every
    ``RECANCEL_TASK_SECONDS`` those still running.

    One cancellation is not always enough: redis-py's asyncio client now and then swallows
    one that lands inside a command (see :func:`run`), and a ``while True`` loop that
    swallowed its cancellation (a worker's heartbeat, its wake-up listener) runs on, so a
    plain ``task.cancel(); await task`` can wait forever. What the tasks raised is retrieved
    and dropped (they are being stopped).
    """
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_TASK_SECONDS)
    for t in tasks:
        if not t.cancelled():
            t.exception()
