"""What the producer's side (``producer/repl/``) shares with the REPL child: stdlib only.

The parent imports these names from :mod:`rlmq.producer.repl_child`; the child uses them in
place. Nothing here runs at import but plain assignments.
"""

from __future__ import annotations

import os
import stat

__all__ = ["HOME", "PROGRAM", "UID_BASE", "reachable_by_others"]

UID_BASE = 100_000
"""When started as root, the child runs as uid/gid ``UID_BASE + its pid`` (no name, no groups);
the producer treats no uid below it as a REPL's own (it never kills nor sweeps one)."""

HOME = "/tmp/home"  # noqa: S108 - inside the REPL's own mount namespace: its private tmpfs
"""HOME and the working directory of a REPL with a private file system, as the REPL sees them."""

PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py")
"""The file the parent runs as the child (``python -I <PROGRAM> <cmd_fd> <reply_fd>``)."""


def reachable_by_others(path: str) -> bool:
    """Whether a user with no rights of its own can read ``path`` (every parent searchable)."""
    path = os.path.realpath(path)
    try:
        if not os.stat(path).st_mode & stat.S_IROTH:
            return False
        while True:
            if not os.stat(path).st_mode & stat.S_IXOTH:
                return False
            parent = os.path.dirname(path)
            if parent == path:
                return True
            path = parent
    except OSError:
        return False
