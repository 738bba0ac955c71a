"""Where an asyncio task is suspended, for tests that cancel a coroutine at each of its
suspension points in turn."""

from __future__ import annotations

import asyncio
from typing import Any


def where(task: asyncio.Task[Any]) -> tuple[tuple[str, int], ...]:
    """Where ``task`` is suspended: the (file, line) of every frame of its coroutine chain."""
    out: list[tuple[str, int]] = []
    coro: Any = task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is None:
            break
        out.append((frame.f_code.co_filename, frame.f_lineno))
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
    return tuple(out)
