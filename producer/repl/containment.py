"""What a REPL child is contained by, and saying so once when it is less than full.

Some containment needs Linux namespaces (root, or unprivileged user namespaces): without
them the REPL keeps the host's network, file system and Unix sockets. The first REPL started
in a process that got less than full containment logs one warning naming what is then not
contained, and :func:`containment_seen` gives the same record to ``meta.json``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Containment", "containment_seen", "note_containment"]

log = logging.getLogger("rlmq.repl")


@dataclass(frozen=True)
class Containment:
    """What one started REPL child reported about its own containment.

    Attributes:
        network: in a network namespace of its own (no TCP/UDP, no abstract Unix sockets).
        private_fs: in a mount namespace of its own with a private, size-limited tmpfs over
            ``/tmp``, ``/dev/shm``, ``/run``, ``/var/tmp``, removed with the REPL.
        read_only_root: the rest of the host file system is read-only to it.
        hidden_sockets: listening path-named host Unix sockets covered (outside those folders).
        hidden_processes: other uids' processes are not listed in its ``/proc`` (``hidepid``).
        no_user_namespaces: a seccomp filter refuses it user namespaces of its own (where it
            could mount a tmpfs no limit of the REPL counts).
        own_uid: runs under a uid of its own (the producer runs as root).
        memory_cgroup: the version (1 or 2) of the cgroup that bounds the REPL's memory and
            processes together (``memory_bytes``, ``max_processes``), or ``None``: none.
        shared_memory_refused: without a memory cgroup, ``memfd_create``, ``memfd_secret`` and
            System V ``shmget`` are refused (seccomp), pages no ``RLIMIT_AS`` counts.
        not_contained: plain-language list of what is then NOT contained.
    """

    network: bool
    private_fs: bool
    read_only_root: bool
    hidden_sockets: int
    hidden_processes: bool
    no_user_namespaces: bool
    own_uid: bool
    memory_cgroup: int | None = None
    shared_memory_refused: bool = False
    not_contained: list[str] = field(default_factory=list)

    @classmethod
    def from_ready(
        cls, message: dict[str, Any], *, isolate_network: bool, cgroup: int | None = None, no_cgroup_why: str = ""
    ) -> Containment:
        """Build it from the child's ``ready`` message (``isolate_network``: whether it was asked;
        ``cgroup``: the version of the REPL's cgroup, ``None`` with ``no_cgroup_why``)."""
        net = message.get("net_isolated") is True
        fs = message.get("fs_private") is True
        ro = message.get("ro_root") is True
        hidden = message.get("hidden_sockets")
        uid = isinstance(message.get("uid"), int)
        procs = message.get("proc_hidden") is True
        no_userns = message.get("no_user_namespaces") is True
        shm_refused = message.get("shared_memory_refused") is True
        missing: list[str] = []
        if cgroup is None:
            missing.append(_memory_not_contained(fs, shm_refused, no_cgroup_why))
        if not net:
            why = "" if isolate_network else " (no interception Unix socket was given)"
            missing.append(
                f"network: the REPL can open TCP/UDP connections to anything the host reaches, and abstract "
                f"Unix sockets{why}"
            )
        missing += _files_not_contained(message, fs, ro, uid)
        if not procs:
            missing.append("processes: the REPL can list the host's processes and read their command lines")
        if not no_userns:
            missing.append("user namespaces: the REPL may create its own and mount file systems there (memory)")
        if not uid:
            missing.append(
                "user: the REPL runs as the producer's user (it can read what that user can, "
                "signal its processes and read its /proc entries, and a process it starts in a "
                "session of its own can outlive it)"
            )
        return cls(
            network=net,
            private_fs=fs,
            read_only_root=ro,
            hidden_sockets=hidden if isinstance(hidden, int) else 0,
            hidden_processes=procs,
            no_user_namespaces=no_userns,
            own_uid=uid,
            memory_cgroup=cgroup,
            shared_memory_refused=shm_refused,
            not_contained=missing,
        )

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (for ``meta.json``)."""
        return asdict(self)


def _memory_not_contained(fs: bool, shm_refused: bool, no_cgroup_why: str) -> str:
    """What is not contained of the REPL's memory without a cgroup (``fs``: with a private file
    system; ``shm_refused``: shared memory refused by seccomp; ``no_cgroup_why``: why none)."""
    where = "the private tmpfs (scratch_bytes)" if fs else "the host's /dev/shm and /tmp"
    refused = (
        "memfd and System V shared memory are refused"
        if shm_refused
        else "memfd and System V shared memory are NOT refused"
    )
    return (
        f"memory: bounded per process (RLIMIT_AS of each of up to max_processes processes), not per REPL, "
        f"since no cgroup could be made ({no_cgroup_why or 'not asked'}); {refused}; POSIX shared memory "
        f"and files in memory count against {where}"
    )


def _files_not_contained(message: dict[str, Any], fs: bool, ro: bool, uid: bool) -> list[str]:
    """What is not contained of the host's files (``fs``: a private file system; ``ro``: the host
    read-only; ``uid``: a uid of its own; ``message``: the ``ready`` message, for ``fs_error``)."""
    if fs:
        return [] if ro else ["files: host folders writable by everyone (other than /tmp, /dev/shm, /run) are writable"]
    missing = []
    if isinstance(message.get("fs_error"), str):
        missing.append(f"the private file system failed: {message['fs_error'][:300]}")
    if uid:
        missing.append(
            "files: the REPL shares the host's /tmp, /var/tmp, /dev/shm and /run (its own files and "
            "System V IPC objects there are removed when it ends; disk use is limited per file, not in "
            "total), and it can connect to host Unix sockets (databases under /run, say)"
        )
    else:
        missing.append(
            "files: the REPL shares the host's /tmp, /dev/shm and /run; its files there (and its System V "
            "IPC objects) can outlive it, and it can connect to host Unix sockets (databases under /run, say)"
        )
    return missing


class _Seen:
    """Containments seen in this process: the first, and the first that was not full."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.first: Containment | None = None
        self.degraded: Containment | None = None


_SEEN = _Seen()


def note_containment(containment: Containment) -> None:
    """Record the containment of a started REPL. The first one in this process that is not
    full is logged at WARNING on the ``rlmq.repl`` logger, once (later ones are not)."""
    with _SEEN.lock:
        if _SEEN.first is None:
            _SEEN.first = containment
        if not containment.not_contained or _SEEN.degraded is not None:
            return
        _SEEN.degraded = containment
    log.warning(
        "the REPL sandbox is not fully contained on this host (namespaces need root or unprivileged "
        "user namespaces, a memory cgroup needs root and a writable cgroup file system); NOT contained: %s",
        "; ".join(containment.not_contained),
    )


def containment_seen() -> dict[str, Any] | None:
    """For ``meta.json``: the first less-than-full containment of a REPL in this process, else
    the first containment seen (a dict, see :class:`Containment`), or ``None`` (no REPL started)."""
    seen = _SEEN.degraded or _SEEN.first
    return None if seen is None else seen.as_dict()
