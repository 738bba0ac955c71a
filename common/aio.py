"""Running rlmq's event loops: uvloop when it is installed, asyncio's own loop otherwise.

uvloop cuts the per-hop cost of the queue path (each sub-call crosses several sockets; see
``bench/README.md``). The worker and the ``rlmq`` commands run on it; ``RLMEnv`` inside a
trainer runs on whatever loop the trainer has.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Collection, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

RECANCEL_SECONDS = 1.0
"""After a stop signal, how often the main coroutine is cancelled again while it still runs."""

RECANCEL_TASK_SECONDS = 0.1
"""How often :func:`cancel_and_wait` cancels again the tasks that have not ended yet."""


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """``uvloop.new_event_loop`` when uvloop is importable, else ``None`` (asyncio's default)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals that stop an ``rlmq`` command: Ctrl-C, ``kill`` / ``timeout`` / a job scheduler,
and a closed terminal."""

STOP_DEADLINE_SECONDS = 20.0
"""After the first stop signal, the command and everything it started have ended within this
many seconds: when the orderly stop has not finished by then, the children still registered
with :meth:`SignalLatch.on_hurry` are killed and the process exits (code 128 + signal)."""


class SignalLatch:
    """The stop-signal handler of an ``rlmq`` command (SIGINT, SIGTERM, SIGHUP): it counts them.

    The first signal starts an orderly stop: outside an event loop it raises
    ``KeyboardInterrupt`` as Python's default SIGINT handler does; inside :func:`run` it
    cancels the main coroutine instead. It also arms a watchdog: if the process still runs
    ``deadline`` seconds later, the children registered with :meth:`on_hurry` are killed and
    the process exits with ``128 + signal``. A second signal never raises (it would cut the
    orderly stop short and leave children behind): it kills the registered children at once,
    and the orderly stop goes on without waiting for them.

    Python drops an exception raised while a finalizer (``__del__``) runs, so the count is
    what :func:`run` trusts: a command that was interrupted before its loop started stops
    there. What the latch does is written to stderr (``say``), one line per signal.

    Args:
        deadline: seconds from the first signal to the watchdog's hard stop (``None``: no watchdog).
        say: where the one-line notices go (default: stderr, written with ``os.write``, which
            is safe inside a signal handler).
    """

    def __init__(
        self, deadline: float | None = STOP_DEADLINE_SECONDS, say: Callable[[str], None] | None = None
    ) -> None:
        self.count = 0
        self.first: int | None = None
        self.deadline = deadline
        self.on_interrupt: Callable[[], None] | None = None
        self.stopping_note = "stopping"
        self._say = say or _say
        self._hurry: dict[int, Callable[[], None]] = {}
        self._next_id = 0
        self._watchdog: threading.Timer | None = None

    @property
    def exit_code(self) -> int:
        """``128 + signal number`` of the first signal (130 for SIGINT, 143 SIGTERM, 129 SIGHUP)."""
        return 128 + int(self.first if self.first is not None else signal.SIGINT)

    def on_hurry(self, kill: Callable[[], None]) -> Callable[[], None]:
        """Register ``kill`` (it must not block): called on a second signal and by the watchdog.

        Returns:
            A function that unregisters it (call it once the children have ended).
        """
        self._next_id += 1
        key = self._next_id
        self._hurry[key] = kill
        return lambda: self._hurry.pop(key, None) and None

    def hurry(self) -> None:
        """Kill every registered set of children now (they are unregistered)."""
        kills, self._hurry = list(self._hurry.values()), {}
        for kill in kills:
            with contextlib.suppress(Exception):
                kill()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A block a first signal does not interrupt (it is counted, announced and the watchdog
        armed; the block runs to its end): writing the results of a run that has finished."""
        previous, self.on_interrupt = self.on_interrupt, _count_only
        try:
            yield
        finally:
            self.on_interrupt = previous

    def cancel_watchdog(self) -> None:
        """Disarm the watchdog (the orderly stop has finished)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _hard_stop(self) -> None:
        self._say(f"rlmq: still stopping after {self.deadline:g} s; killing what is left and exiting")
        self.hurry()
        os._exit(self.exit_code)

    def __call__(self, signum: int, frame: object) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.count > 1:
            self._say(f"rlmq: {name} again: stopping at once (children killed; finished rollouts are still saved)")
            self.hurry()
            return
        self.first = signum
        if self.deadline is not None:
            self._watchdog = threading.Timer(self.deadline, self._hard_stop)
            self._watchdog.daemon = True
            self._watchdog.start()
        self._say(
            f"rlmq: {name}: {self.stopping_note} (within {self.deadline:g} s; send it again to stop at once)"
            if self.deadline is not None
            else f"rlmq: {name}: {self.stopping_note}"
        )
        if self.on_interrupt is not None:
            self.on_interrupt()
            return
        raise KeyboardInterrupt


def _say(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, (text + "\n").encode())


def current_latch() -> SignalLatch | None:
    """The :class:`SignalLatch` installed for a stop signal (by :func:`signal_latch`), if any: the
    SIGINT handler, or SIGTERM's when SIGINT was left ignored (a command started in the
    background of a script, or under ``nohup``)."""
    for signum in STOP_SIGNALS:
        try:
            handler = signal.getsignal(signum)
        except ValueError:  # pragma: no cover - no signals in this interpreter
            return None
        if isinstance(handler, SignalLatch):
            return handler
    return None


@contextlib.contextmanager
def signal_latch(deadline: float | None = STOP_DEADLINE_SECONDS) -> Iterator[SignalLatch]:
    """Install a :class:`SignalLatch` as the handler of :data:`STOP_SIGNALS` for the block
    (main thread only; elsewhere the latch is returned but not installed), and restore the
    previous handlers after. A signal this process inherited as ignored stays ignored (``nohup``
    ignores SIGHUP, a shell script's ``cmd &`` SIGINT). The watchdog is disarmed when the block
    ends."""
    latch = SignalLatch(deadline)
    previous: dict[signal.Signals, Any] = {}
    try:
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is signal.SIG_IGN:
                continue  # ignored by whoever started us (`nohup`: SIGHUP; `cmd &` in a script: SIGINT)
            previous[sig] = signal.signal(sig, latch)
    except ValueError:  # not the main thread
        yield latch
        return
    try:
        yield latch
    finally:
        latch.cancel_watchdog()
        for sig, handler in previous.items():
            if signal.getsignal(sig) is latch:
                signal.signal(sig, handler)


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh event loop (uvloop when installed), like ``asyncio.run``.

    A stop signal (:data:`STOP_SIGNALS`: Ctrl-C, SIGTERM, SIGHUP) cancels ``main``, as Ctrl-C
    does under ``asyncio.run``, but does not rely on that one
    cancellation arriving: redis-py's asyncio client now and then swallows a cancellation
    that lands inside a command (measured with redis-py 8.1: about one cancel in four of a
    ``PING`` under uvloop, one in seventy on asyncio's own loop), and ``main`` would then run
    on as if nothing happened. So while ``main`` still runs it is cancelled again every
    ``RECANCEL_SECONDS``, and when it ends, however it ends, ``KeyboardInterrupt`` is raised.
    Under :func:`signal_latch` (the ``rlmq`` commands), a Ctrl-C that came before the loop
    started stops the run before ``main`` begins; without a latch, one is installed for the
    run (with no watchdog). A command that installs its own signal handlers inside ``main``
    (the worker's graceful stop) replaces this one for those signals.

    Raises:
        KeyboardInterrupt: a stop signal arrived while ``main`` ran (or, under a latch, before).
    """
    current = current_latch()
    if current is not None:
        return _run(main, current)
    with signal_latch(deadline=None) as latch:
        return _run(main, latch)


def _run(main: Coroutine[Any, Any, T], latch: SignalLatch) -> T:
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
    """:attr:`SignalLatch.on_interrupt` while no coroutine can be cancelled: the count is all."""


async def _interruptible(main: Coroutine[Any, Any, T], latch: SignalLatch) -> T:
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


def raise_if_cancelling() -> None:
    """Raise :class:`asyncio.CancelledError` when the current task was asked to cancel and is
    still running: the cancellation was swallowed on its way (redis-py's asyncio client now and
    then swallows one that lands inside a blocking command, see ``docs/redis-py-cancel.md``)
    but ``Task.cancelling()`` still counts it. Call it at the top of every loop around a
    blocking read, so a loop ends at its next turn (one block timeout later), not never.

    Raises:
        asyncio.CancelledError: ``asyncio.current_task().cancelling()`` is above 0.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def start_in_daemon_thread(
    call: Callable[[], T], *, name: str, on_end: Callable[[], None] | None = None
) -> asyncio.Future[T]:
    """Start ``call()`` in a daemon thread of its own; return a future of the running loop that
    gets its result, or whatever it raised (``BaseException`` included: ``SystemExit`` from a
    tool fails its call, not the process).

    A call past its caller's timeout runs on until it returns (a thread cannot be stopped) but
    holds no pool's thread (later calls do not queue behind it) and not the process's exit (a
    pool's threads are joined at exit). ``on_end``, if given, runs in the thread when ``call``
    ends, before the future is settled. Cancelling the future leaves the thread running.

    Raises:
        RuntimeError: no thread could be started (the process is out of threads or memory);
            nothing ran then.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            (future.set_result if ok else future.set_exception)(value)

    def run() -> None:
        ok: bool = True
        value: Any = None
        try:
            value = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting call
            ok, value = False, exc
        finally:
            if on_end is not None:
                on_end()
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, ok, value)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class OverrunThreads:
    """Daemon threads whose callers stopped waiting for them (a timeout, a cancelled task), counted
    until they end: a thread cannot be stopped, so a tool that hangs keeps its thread; the count lets
    its owner refuse further sync calls while ``limit`` such threads run on (:attr:`full`).

    Used by the sub-LLM tool registry (:mod:`rlmq.common.tool_registry`) and the root tools
    (:mod:`rlmq.producer.root_tools`). Thread-safe.

    Args:
        limit: how many threads may run on past their callers before :attr:`full`.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0
        """Threads running now whose callers stopped waiting."""
        self._lock = threading.Lock()

    @property
    def full(self) -> bool:
        """True while ``limit`` threads (or more) run on past their callers."""
        return self.count >= self.limit

    def start(
        self, call: Callable[[], T], *, name: str, on_end: Callable[[], None] | None = None
    ) -> Coroutine[Any, Any, T]:
        """Start ``call()`` in a daemon thread of its own (:func:`start_in_daemon_thread`, ``on_end``
        as there) and return the coroutine that waits for it: when that wait is cancelled while the
        thread runs, the thread counts in :attr:`count` until it ends. Await it at once.

        Raises:
            RuntimeError: no thread could be started (nothing ran, nothing is counted); any other
                error of starting one propagates the same way.
        """
        state = {"ended": False, "counted": False}

        def ended() -> None:
            with self._lock:
                state["ended"] = True
                if state["counted"]:
                    self.count -= 1
            if on_end is not None:
                on_end()

        future = start_in_daemon_thread(call, name=name, on_end=ended)
        return self._wait(future, state)

    async def _wait(self, future: asyncio.Future[T], state: dict[str, bool]) -> T:
        try:
            return await future
        except asyncio.CancelledError:  # the caller's timeout or cancel: the thread runs on
            with self._lock:
                if not state["ended"]:
                    state["counted"] = True
                    self.count += 1
            raise
