"""One cell's wait, timed by the parent's own clock."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from rlmq.producer.repl.handle import ChildHandle

__all__ = ["CellClock", "CellResult", "run_cell"]


@dataclass
class CellResult:
    """What one :meth:`Repl.execute` call produced.

    Attributes:
        output: stdout + stderr (tracebacks included) + the repr of a last expression,
            cut to ``max_output_length`` characters with a marker, plus a note when
            the REPL timed out, died, or its answer was cut.
        answer_ready: ``bool(answer["ready"])`` after the cell.
        answer_content: ``str(answer["content"])`` after the cell, at most
            ``max_answer_length`` characters.
        seconds: wall time of the cell (seconds), up to its end, timeout or death.
        timed_out: the cell hit ``code_execution_timeout`` (the REPL was restarted).
        restarted: the REPL was restarted during or after this cell (timeout, crash, or a
            message over the size limit); its variables and imports are gone.
        helper_error: bash only: a command of the cell (``llm_batch``, ...) could not start its
            helper, so what the cell did is not what the model asked; ``None``: none failed so.
    """

    output: str
    answer_ready: bool
    answer_content: str
    seconds: float
    timed_out: bool
    restarted: bool
    helper_error: str | None = None


class CellClock:
    """A cell's time budget, counted by the parent: it runs except while the parent itself
    serves an ``llm_batch`` request of this REPL (:meth:`Repl.serving`).

    Args:
        seconds: the cell's timeout (seconds).
        pause: whether serving ``llm_batch`` pauses it.
    """

    def __init__(self, seconds: float, pause: bool) -> None:
        self.remaining = seconds
        self._pause = pause
        self.serving = 0
        self._mark = time.monotonic()
        self.changed = asyncio.Event()

    @property
    def paused(self) -> bool:
        return self._pause and self.serving > 0

    def tick(self) -> float:
        """Count the time since the last tick (unless paused); return the seconds remaining."""
        now = time.monotonic()
        if not self.paused:
            self.remaining -= now - self._mark
        self._mark = now
        return self.remaining

    def add_serving(self, delta: int) -> None:
        """One more (``+1``) or one fewer (``-1``) ``llm_batch`` request being served by the parent."""
        self.tick()  # the time up to now counts with the state it had
        self.serving += delta
        self.changed.set()


async def run_cell(
    child: ChildHandle, code: str, clock: CellClock, recheck: float, history: str | None = None
) -> tuple[dict[str, Any] | None, bool]:
    """Send ``code`` to ``child`` and wait for its result message.

    Args:
        child: the running child.
        code: the cell's source.
        clock: the cell's time budget (its ``remaining`` seconds run out: timed out).
        recheck: seconds between re-checks while the clock is paused.
        history: the conversation as JSON lines, for the child to write to ``.messages`` in its
            working directory before the cell runs (``None``: no file).

    Returns:
        (the result message, or ``None`` when the child died, closed its pipe, or sent a
        line over the limit; whether the cell timed out). Other messages are ignored.
    """
    receiving: asyncio.Task[dict[str, Any] | None] | None = None
    try:
        try:
            command: dict[str, Any] = {"op": "exec", "code": code}
            if history is not None:
                command["history"] = history
            await asyncio.wait_for(child.send(command), max(clock.remaining, 0.001))
        except TimeoutError:
            return None, True
        except OSError:  # BrokenPipeError: the child is gone
            return None, False
        receiving = asyncio.ensure_future(child.receive())
        while True:
            if clock.tick() <= 0:
                return None, True
            clock.changed.clear()
            changed = asyncio.ensure_future(clock.changed.wait())
            # Paused: wake when the parent's account changes (or, to re-check, after a while).
            wait = recheck if clock.paused else clock.remaining
            try:
                done, _ = await asyncio.wait({receiving, changed}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
            if receiving not in done:
                continue
            message = receiving.result()
            if message is None:
                return None, False
            if message.get("type") == "result":
                return message, False
            receiving = asyncio.ensure_future(child.receive())  # anything else: ignored
    finally:
        if receiving is not None and not receiving.done():
            receiving.cancel()
