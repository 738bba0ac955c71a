"""A cgroup per REPL: its memory and its processes counted for the whole REPL, not per process.

``RLIMIT_AS`` bounds one process's address space; pages that are no process's mapping
(``memfd`` files, System V and POSIX shared memory, tmpfs files) and the sum over a cell's
processes escape it. A memory cgroup charges every page a REPL's processes allocate, whatever
holds it, so ``memory.max`` (v2) / ``memory.limit_in_bytes`` (v1) bounds them together; the
kernel's OOM killer ends a process of that REPL (never one outside it) when the REPL is over.
``pids.max`` bounds its processes and threads together, whatever uid they run as.

Used only when the producer runs as root (a REPL then runs under a uid of its own and cannot
write its cgroup's files, nor move out of it). Version 2 where the unified hierarchy offers
the ``memory`` and ``pids`` controllers to a child of the producer's own cgroup (or of
``parent``, a delegated cgroup given by the operator); else version 1's ``memory`` and
``pids`` hierarchies; else none (:func:`create` says why).
"""

from __future__ import annotations

import os
import signal
import uuid
from dataclasses import dataclass

__all__ = ["ReplCgroup", "create"]

_MOUNTINFO = "/proc/self/mountinfo"
_OWN = "/proc/self/cgroup"


@dataclass(frozen=True)
class ReplCgroup:
    """One REPL's cgroup: ``version`` 1 or 2, and its folders (v1: one per hierarchy)."""

    version: int
    folders: tuple[str, ...]

    def add(self, pid: int) -> None:
        """Move process ``pid`` (and what it will start) into the cgroup.

        Raises:
            OSError: the kernel refused it.
        """
        for folder in self.folders:
            with open(os.path.join(folder, "cgroup.procs"), "w") as f:
                f.write(str(pid))

    def pids(self) -> list[int]:
        """Processes in it now."""
        found: set[int] = set()
        for folder in self.folders:
            try:
                with open(os.path.join(folder, "cgroup.procs")) as f:
                    found.update(int(line) for line in f if line.strip())
            except OSError:
                continue
        return sorted(found)

    def kill(self) -> None:
        """SIGKILL every process in it (v2: ``cgroup.kill``, else one by one, twice)."""
        if self.version == 2:
            try:
                with open(os.path.join(self.folders[0], "cgroup.kill"), "w") as f:
                    f.write("1")
                return
            except OSError:
                pass
        for _ in range(2):  # a process forked while the first pass ran is caught by the second
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer ended in it so far."""
        name, key = ("memory.events", "oom_kill") if self.version == 2 else ("memory.oom_control", "oom_kill")
        for folder in self.folders:
            try:
                with open(os.path.join(folder, name)) as f:
                    for line in f:
                        parts = line.split()
                        if len(parts) == 2 and parts[0] == key:
                            return int(parts[1])
            except (OSError, ValueError):
                continue
        return 0

    def peak_bytes(self) -> int | None:
        """The most memory it held at once (bytes), where the kernel says."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        for folder in self.folders:
            try:
                with open(os.path.join(folder, name)) as f:
                    return int(f.read())
            except (OSError, ValueError):
                continue
        return None

    def remove(self) -> bool:
        """Remove its folders (only once no process is left in it); whether all are gone."""
        done = True
        for folder in self.folders:
            try:
                os.rmdir(folder)
            except FileNotFoundError:
                pass
            except OSError:
                done = False
        return done


def _mounts() -> dict[str, tuple[str, str]]:
    """{"memory" / "pids" (v1) or "" (v2): (mount point, root of the mount in its hierarchy)}."""
    found: dict[str, tuple[str, str]] = {}
    try:
        with open(_MOUNTINFO) as f:
            lines = f.read().splitlines()
    except OSError:
        return found
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        root, point, fstype, options = fields[3], fields[4], rest[0], rest[2].split(",")
        if fstype == "cgroup2":
            found.setdefault("", (point, root))
        elif fstype == "cgroup":
            for name in ("memory", "pids"):
                if name in options:
                    found.setdefault(name, (point, root))
    return found


def _own_paths() -> dict[str, str]:
    """This process's cgroup per v1 controller, and ``""``: its v2 cgroup."""
    paths: dict[str, str] = {}
    try:
        with open(_OWN) as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for name in controllers.split(",") if controllers else [""]:
                    paths[name] = path
    except (OSError, ValueError):
        pass
    return paths


def _folder(mount: tuple[str, str], path: str) -> str:
    point, root = mount
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    return os.path.join(point, path.lstrip("/"))


def _name() -> str:
    """A new REPL cgroup's folder name: ``rlmq-repl-<producer pid>-<random>``."""
    return f"rlmq-repl-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _remove_stale(parent: str) -> None:
    """Remove REPL cgroups in ``parent`` left by producers that died (SIGKILL: no close ran)
    and hold no process; a live producer's are never touched."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) != 4 or parts[:2] != ["rlmq", "repl"] or not parts[2].isdigit():
            continue
        try:
            os.kill(int(parts[2]), 0)
            continue  # its producer lives
        except ProcessLookupError:
            pass
        except OSError:
            continue
        try:
            os.rmdir(os.path.join(parent, name))  # EBUSY while a process is in it
        except OSError:
            pass


def _write(folder: str, name: str, value: str) -> None:
    with open(os.path.join(folder, name), "w") as f:
        f.write(value)


def _controllers(folder: str, name: str) -> set[str]:
    try:
        with open(os.path.join(folder, name)) as f:
            return set(f.read().split())
    except OSError:
        return set()


def _create_v2(parent: str, memory_bytes: int, max_processes: int | None) -> ReplCgroup:
    want = {"memory", "pids"}
    if not want <= _controllers(parent, "cgroup.controllers"):
        raise OSError(f"{parent} does not offer the memory and pids controllers (cgroup v2)")
    if not want <= _controllers(parent, "cgroup.subtree_control"):
        _write(parent, "cgroup.subtree_control", "+memory +pids")  # EBUSY when it holds processes
    _remove_stale(parent)
    folder = os.path.join(parent, _name())
    os.mkdir(folder, 0o755)
    try:
        _write(folder, "memory.max", str(memory_bytes))
        if os.path.exists(os.path.join(folder, "memory.swap.max")):
            _write(folder, "memory.swap.max", "0")
        _write(folder, "pids.max", str(max_processes) if max_processes is not None else "max")
    except OSError:
        os.rmdir(folder)
        raise
    return ReplCgroup(2, (folder,))


def _create_v1(
    mounts: dict[str, tuple[str, str]], own: dict[str, str], memory_bytes: int, max_processes: int | None
) -> ReplCgroup:
    if "memory" not in mounts or "pids" not in mounts:
        raise OSError("no cgroup v1 memory and pids hierarchies are mounted")
    name = _name()
    folders: list[str] = []
    try:
        for controller in ("memory", "pids"):
            parent = _folder(mounts[controller], own.get(controller, "/"))
            _remove_stale(parent)
            folder = os.path.join(parent, name)
            os.mkdir(folder, 0o755)
            folders.append(folder)
        memory, pids = folders
        _write(memory, "memory.limit_in_bytes", str(memory_bytes))
        if os.path.exists(os.path.join(memory, "memory.memsw.limit_in_bytes")):
            try:  # with swap accounting: no swapping past the limit either
                _write(memory, "memory.memsw.limit_in_bytes", str(memory_bytes))
            except OSError:
                pass
        _write(pids, "pids.max", str(max_processes) if max_processes is not None else "max")
    except OSError:
        for folder in folders:
            os.rmdir(folder)
        raise
    return ReplCgroup(1, tuple(folders))


def create(memory_bytes: int, max_processes: int | None, parent: str | None = None) -> tuple[ReplCgroup | None, str]:
    """Make a cgroup for one REPL with ``memory_bytes`` of memory (bytes, every page its
    processes allocate) and ``max_processes`` processes and threads (``None``: no limit).

    Args:
        memory_bytes: ``memory.max`` (v2) / ``memory.limit_in_bytes`` (v1); swap not allowed.
        max_processes: ``pids.max``.
        parent: a cgroup v2 folder delegated to the producer for its REPLs (``None``: the
            producer's own cgroup).

    Returns:
        (the cgroup, "") or (``None``, why there is none): not root, or the host offers no
        writable memory and pids controllers.
    """
    if os.geteuid() != 0:
        return None, "the producer is not root (a REPL would run as its user and could raise its own limits)"
    mounts, own = _mounts(), _own_paths()
    reasons: list[str] = []
    if parent is not None or "" in mounts:
        base = parent or _folder(mounts[""], own.get("", "/"))
        try:
            return _create_v2(base, memory_bytes, max_processes), ""
        except OSError as exc:
            reasons.append(f"cgroup v2: {exc}")
    try:
        return _create_v1(mounts, own, memory_bytes, max_processes), ""
    except OSError as exc:
        reasons.append(f"cgroup v1: {exc}")
    return None, "; ".join(reasons)
