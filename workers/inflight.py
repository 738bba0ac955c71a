"""What one worker holds right now: its in-flight jobs, their tasks, and finished jobs not yet recorded.

:class:`InFlight` is the state the worker's parts share (the fetcher adds jobs, the job
tasks finish them, the flush records them, the heartbeat extends them, the reaper skips
them), and what tests read instead of the worker's internals.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from rlmq.common.jobs.store import FinishedJob, StartedJob
from rlmq.workers.capacity import MODEL_CALLS, Capacity


class InFlight:
    """The jobs a worker has started and not yet recorded as finished, by queue.

    Args:
        default_queue: the worker's own queue (where a job of unknown origin is counted).
        capacity: the worker's pools; a held job holds a slot of its pool (see :meth:`track`).
    """

    def __init__(self, default_queue: str, capacity: Capacity) -> None:
        self.default_queue = default_queue
        self.capacity = capacity
        self._jobs: dict[str, StartedJob] = {}  # member ``job:exec`` -> job
        self._queue_of: dict[str, str] = {}  # member -> the queue it came from
        self._pool_of: dict[str, str] = {}  # member -> the capacity pool it holds a slot of
        self._running: set[str] = set()  # members whose call has not produced a result yet
        self.tasks: set[asyncio.Task[None]] = set()
        """Tasks of sub-calls (including early lane calls that may still be cancelled)."""
        self.done: list[FinishedJob] = []
        """Finished jobs waiting for the flush to record them."""
        self.done_event = asyncio.Event()
        self.slot_free = asyncio.Event()
        """Set when a job's slot may have come free (the fetch loop waits on it)."""
        self.running_changed = asyncio.Event()
        """Set when the calls counted against the concurrency may have changed (the resume gate waits on it)."""

    def slots_changed(self) -> None:
        """Wake whoever waits for a slot: jobs were released, or a budgeted call parked."""
        self.slot_free.set()
        self.running_changed.set()

    def __len__(self) -> int:
        """Jobs held: started and not yet recorded (what counts against the concurrency)."""
        return len(self._jobs)

    def __contains__(self, member: object) -> bool:
        return member in self._jobs

    @property
    def running(self) -> int:
        """Sub-calls whose result is not produced yet (the in-flight gauge: a job whose
        result waits only for the flush is no longer counted, so the gauge reaches 0 before
        any producer can see the last result)."""
        return len(self._running)

    def track(self, job: StartedJob, queue: str, pool: str = MODEL_CALLS) -> None:
        """Hold ``job`` (taken from ``queue``) with a slot of ``pool``.

        Raises:
            KeyError: no such pool.
        """
        if job.member not in self._jobs:
            self.capacity.hold(pool)
            self._pool_of[job.member] = pool
        self._jobs[job.member] = job
        self._queue_of[job.member] = queue
        self._running.add(job.member)

    def add_task(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coro`` as a sub-call task (kept until it ends)."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def finished(self, done: FinishedJob) -> None:
        """Queue a finished job for the flush."""
        self._running.discard(done.job.member)
        self.done.append(done)
        self.done_event.set()

    def take_done(self) -> list[FinishedJob]:
        """The finished jobs waiting for the flush, handed over (the list starts again empty)."""
        self.done_event.clear()
        batch, self.done = self.done, []
        return batch

    def put_back(self, batch: list[FinishedJob]) -> None:
        """Finished jobs a flush could not record: held again, ahead of newer ones."""
        self.done = batch + self.done
        self.done_event.set()

    def queue_of(self, member: str) -> str:
        """The queue a held job came from."""
        return self._queue_of.get(member, self.default_queue)

    def release(self, members: list[str]) -> None:
        """Forget jobs (recorded, handed back, or left to the reaper); frees their slots."""
        for m in members:
            if self._jobs.pop(m, None) is not None:
                self.capacity.let_go(self._pool_of.pop(m))
            self._queue_of.pop(m, None)
            self._running.discard(m)
        self.slots_changed()

    def members_by_queue(self) -> dict[str, list[str]]:
        """Held jobs' members grouped by the queue they came from."""
        out: dict[str, list[str]] = {}
        for member in self._jobs:
            out.setdefault(self.queue_of(member), []).append(member)
        return out

    def clear(self) -> None:
        """Forget everything (after a shutdown handed the jobs back)."""
        self.release(list(self._jobs))
