"""Child processes tied to the process that started them.

Every process an ``rlmq`` command starts (the embedded ``redis-server``, local workers, the
scripted model) runs in a session of its own, so a Ctrl-C at the terminal reaches only the
command, which then stops its children in order. Each child is also tied to its parent with
Linux's ``PR_SET_PDEATHSIG``: when the parent dies, even by ``SIGKILL``, the kernel sends the
child ``SIGTERM``, so nothing is left behind.

``PR_SET_PDEATHSIG`` fires when the *thread* that started the child ends, not the process;
children started from any other thread than the main one are therefore not tied (they still
get their own session and are stopped by their owner).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
"""``prctl`` option (``<linux/prctl.h>``): the signal a process gets when its parent dies."""


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that ties the child to this process.

    Args:
        sig: the signal the child gets when this process (its starting thread) dies.

    Returns:
        The function to pass as ``preexec_fn``, or ``None`` when the tie cannot be made
        (not Linux, or called outside the main thread: see the module's note).
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, never in the forked child
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the tie was made
            os._exit(1)

    return preexec
