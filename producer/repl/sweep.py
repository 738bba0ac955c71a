"""Removing what a REPL's own uid left on the host, where no private file system held it.

Without a mount namespace a REPL (as root: under a uid of its own) can write into the
host's world-writable folders and create System V IPC objects, which outlive its processes.
Once those processes are dead, :func:`sweep_uid` removes every entry that uid owns under
those folders, and its System V objects, so a later REPL that gets the same uid (pids wrap)
finds nothing of an earlier one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat

from rlmq.producer.repl_child import UID_BASE

__all__ = ["WORLD_WRITABLE", "sweep_uid"]

WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")  # noqa: S108
"""The host folders anyone may write into (their sub-folders are walked too)."""


def _sweep_tree(top: str, uid: int) -> int:
    """Remove the entries under ``top`` owned by ``uid``; never follows a symlink and works
    relative to directory fds, so a path swapped meanwhile cannot redirect a removal."""
    removed = 0
    try:
        walker = os.fwalk(top, follow_symlinks=False)
        for _root, dirs, files, dirfd in walker:
            for name in files:
                with contextlib.suppress(OSError):
                    if os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_uid == uid:
                        os.unlink(name, dir_fd=dirfd)
                        removed += 1
            keep = []
            for name in dirs:
                try:
                    st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                except OSError:
                    continue
                if st.st_uid == uid and stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(name, dir_fd=dirfd, ignore_errors=True)
                    removed += 1
                else:
                    keep.append(name)
            dirs[:] = keep
    except OSError:
        pass
    return removed


def _sweep_sysv(uid: int) -> int:
    """Remove the System V shared memory segments, semaphore sets and message queues that
    ``uid`` owns or created (``/proc/sysvipc``, ``IPC_RMID``)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    removed = 0
    for kind, id_column in (("shm", "shmid"), ("sem", "semid"), ("msg", "msqid")):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                header = f.readline().split()
                rows = [line.split() for line in f if line.strip()]
        except OSError:
            continue
        col = {name: i for i, name in enumerate(header)}
        for row in rows:
            try:
                if uid not in (int(row[col["uid"]]), int(row[col["cuid"]])):
                    continue
                ident = int(row[col[id_column]])
            except (KeyError, ValueError, IndexError):
                continue
            if kind == "shm":
                rc = libc.shmctl(ident, 0, None)
            elif kind == "sem":
                rc = libc.semctl(ident, 0, 0)
            else:
                rc = libc.msgctl(ident, 0, None)
            removed += rc == 0
    return removed


def sweep_uid(uid: int, roots: tuple[str, ...] = WORLD_WRITABLE) -> int:
    """Remove every file, folder and System V object owned by ``uid`` under ``roots``.

    Call it only once every process of ``uid`` is dead. Walks the whole of each root, so its
    cost grows with the entries there (it runs in a thread, at a REPL's restart and close).

    Args:
        uid: a REPL's own uid (>= 100000; others are refused with ``ValueError``).
        roots: the folders walked.

    Returns:
        The number of entries removed.

    Raises:
        ValueError: ``uid`` is below 100000 (not a REPL's own).
    """
    if uid < UID_BASE:  # never sweep a uid that is not a REPL's own
        raise ValueError(f"refusing to sweep uid {uid}: not a REPL's own")
    removed = sum(_sweep_tree(root, uid) for root in roots if os.path.isdir(root))
    return removed + _sweep_sysv(uid)
