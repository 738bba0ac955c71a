"""Running rlmq's event loops: uvloop when it is installed, asyncio's own loop otherwise.

uvloop cuts the per-hop cost of the queue path (each sub-call crosses several sockets; see
``bench/README.md``). The worker and the ``rlmq`` commands run on it; ``RLMEnv`` inside a
trainer runs on whatever loop the trainer has.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """``uvloop.new_event_loop`` when uvloop is importable, else ``None`` (asyncio's default)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh event loop (uvloop when installed), like ``asyncio.run``."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
