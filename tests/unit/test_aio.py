"""``rlmq.common.aio.run``: Ctrl-C ends the run even when a library swallows the cancellation."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from rlmq.common.aio import SignalLatch, cancel_and_wait, run, signal_latch

# Every test here that signals itself needs SIGINT delivered, whatever the suite inherited.
pytestmark = pytest.mark.usefixtures("sigint_delivered")


def test_ctrl_c_ends_a_run_whose_first_cancellation_was_swallowed() -> None:
    cancels = 0

    async def main() -> str:
        nonlocal cancels
        loop = asyncio.get_running_loop()
        loop.call_soon(os.kill, os.getpid(), signal.SIGINT)
        while True:
            try:
                await asyncio.Event().wait()  # forever, unless cancelled
            except asyncio.CancelledError:
                cancels += 1
                if cancels == 1:
                    continue  # what a library that swallows a cancellation does
                raise

    with pytest.raises(KeyboardInterrupt):
        run(main())
    assert cancels == 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_is_reported_even_when_the_run_then_returns() -> None:
    async def main() -> str:
        loop = asyncio.get_running_loop()
        loop.call_soon(os.kill, os.getpid(), signal.SIGINT)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "finished anyway"  # swallowed, and the run ends normally
        return "never"

    with pytest.raises(KeyboardInterrupt):
        run(main())


def test_a_run_without_ctrl_c_returns_its_result() -> None:
    async def main() -> int:
        await asyncio.sleep(0)
        return 7

    assert run(main()) == 7


async def test_cancel_and_wait_ends_a_loop_that_swallowed_its_cancellation() -> None:
    """What redis-py does now and then inside a command, a worker's ``while True`` loop
    would otherwise survive: one ``cancel()`` and an ``await`` then wait forever."""
    swallowed = 0

    async def loop_forever() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if swallowed == 0:
                    swallowed += 1
                    continue
                raise

    async def fails() -> None:
        raise RuntimeError("ended badly before the stop")

    tasks = [asyncio.create_task(loop_forever()), asyncio.create_task(fails())]
    await asyncio.sleep(0)  # both start: the first waits, the second has failed
    await cancel_and_wait(tasks)
    assert swallowed == 1
    assert tasks[0].cancelled() and isinstance(tasks[1].exception(), RuntimeError)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped one, on purpose
def test_a_ctrl_c_dropped_by_a_finalizer_still_stops_the_next_run() -> None:
    """Python drops an exception raised while a ``__del__`` runs: a Ctrl-C landing there
    (the demo once lost one in a redis-py pool's finalizer) must still stop the command."""

    class Finalized:
        def __init__(self, latch: SignalLatch) -> None:
            self.latch = latch

        def __del__(self) -> None:
            self.latch(signal.SIGINT, None)  # what Python runs when SIGINT lands in here

    started = False

    async def main() -> None:
        nonlocal started
        started = True

    with signal_latch() as latch:
        Finalized(latch)  # collected at once: its KeyboardInterrupt is printed and dropped
        assert latch.count == 1
        with pytest.raises(KeyboardInterrupt):
            run(main())
    assert not started
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_held_block_runs_to_its_end_and_the_signal_is_counted() -> None:
    """A run that has finished writes its results whole even if SIGTERM comes meanwhile."""
    said: list[str] = []
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a command gets it (pytest may have inherited an ignore)
    with signal_latch(deadline=None) as latch:
        latch._say = said.append
        with latch.held():
            os.kill(os.getpid(), signal.SIGTERM)  # delivered at the next bytecode: no exception
            wrote = "all of it"
        assert latch.count == 1 and latch.exit_code == 143
        with pytest.raises(KeyboardInterrupt):
            run(asyncio.sleep(0))  # the next run stops at once
    assert wrote == "all of it" and said and "SIGTERM" in said[0]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_second_signal_kills_registered_children_and_never_raises() -> None:
    killed: list[str] = []
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with signal_latch(deadline=None) as latch:
        latch._say = lambda text: None
        unhook = latch.on_hurry(lambda: killed.append("group"))
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100):  # the handler runs between bytecodes
                pass
        os.kill(os.getpid(), signal.SIGINT)  # the second: no exception, children killed
        for _ in range(100):
            pass
        unhook()
    assert killed == ["group"] and latch.count == 2


def test_the_latch_is_found_when_sigint_was_inherited_ignored() -> None:
    """A command started with SIGINT ignored (``cmd &`` in a script) still finds its latch, by
    SIGTERM's handler: the run's report then names the signal that stopped it."""
    code = (
        "import signal\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "from rlmq.common.aio import current_latch, signal_latch\n"
        "with signal_latch() as latch:\n"
        "    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN\n"
        "    assert current_latch() is latch\n"
        "assert current_latch() is None\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
