"""Supervision of long-lived asyncio tasks: a task that fails is restarted, or its process ends.

A worker's background tasks (recording results, heartbeats, the reaper, the wake listener)
must never die silently: a worker that keeps heartbeating while it no longer records results
holds its jobs for ever (nobody takes them back) and answers nothing. So every such task runs
under :func:`supervised`: an unexpected exception is logged with its traceback, the task is
started again after a backoff, and when it keeps failing (``max_restarts`` within
``window`` seconds) ``on_give_up`` is called, which stops the process with a non-zero
exit so that the fleet's supervisor (systemd, Kubernetes, compose) starts a fresh one and
the other workers' reapers re-queue its jobs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("rlmq.supervise")

BACKOFF_BASE = 0.1
"""Seconds before the first restart; doubled per restart up to :data:`BACKOFF_MAX`."""
BACKOFF_MAX = 5.0


async def supervised(
    name: str,
    body: Callable[[], Coroutine[Any, Any, None]],
    *,
    on_give_up: Callable[[str, BaseException], None],
    max_restarts: int = 5,
    window: float = 60.0,
) -> None:
    """Run ``body()`` until it returns, restarting it after an unexpected exception.

    Args:
        name: what the log calls the task.
        body: builds the task's coroutine (called again for each restart).
        on_give_up: called with ``name`` and the last exception when the task failed more
            than ``max_restarts`` times within ``window`` seconds; the supervisor then returns.
        max_restarts / window: the restart budget (count per seconds).

    Cancellation is never caught: a cancelled supervisor ends with its task.
    """
    failures: deque[float] = deque()
    delay = BACKOFF_BASE
    while True:
        try:
            await body()
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            now = time.monotonic()
            failures.append(now)
            while failures and now - failures[0] > window:
                failures.popleft()
            if len(failures) > max_restarts:
                log.critical("task %s failed %d times in %.0f s; giving up: %r", name, len(failures), window, exc)
                on_give_up(name, exc)
                return
            log.error("task %s failed; restarting in %.1f s", name, delay, exc_info=True)
            await asyncio.sleep(delay)  # restart backoff, not synchronisation
            delay = min(delay * 2, BACKOFF_MAX)
