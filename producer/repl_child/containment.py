"""The REPL child's containment: namespaces of its own, a private scratch file system, the host's
sockets and processes hidden, and the host paths its programs need carried into the sandbox."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from .shared import HOME

__all__ = ["CLONE_NEWUSER", "PACKAGE_DIR", "SCRATCH", "contain", "helper_python", "isolate_network"]

PACKAGE_DIR = os.path.dirname(os.path.realpath(__file__))
"""This package's folder as the host sees it (a real path): the child and its bash cells'
commands run its programs, so the sandbox carries it in when it lies under a covered folder."""

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
SCRATCH = "/tmp"  # noqa: S108 - inside the REPL's own mount namespace: its private tmpfs
_PRIVATE = "/tmp/.rlmq"  # noqa: S108 - root-owned: the interception socket's folder, the work dir (read-only)
_COVERED = ("/tmp", "/run", "/var/run", "/dev/shm", "/var/tmp")  # noqa: S108


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _mount(libc: Any, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    import ctypes

    enc = [None if x is None else x.encode() for x in (source, target, fstype, data)]
    if libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _read_only(libc: Any, path: str = "/", writable: bool = False) -> bool:
    """Make every mount at and under ``path`` of this (private) mount namespace read-only, or
    (``writable``) the one mount at ``path`` writable again: ``mount_setattr(2)`` (Linux >= 5.12,
    x86_64 / arm64 syscall 442), ``AT_RECURSIVE`` when making read-only."""
    import ctypes

    # struct mount_attr: attr_set, attr_clr, propagation, userns_fd; MOUNT_ATTR_RDONLY = 1
    attr = (ctypes.c_uint64 * 4)(0, 1, 0, 0) if writable else (ctypes.c_uint64 * 4)(1, 0, 0, 0)
    flags = 0 if writable else 0x8000
    try:
        return int(libc.syscall(442, -100, path.encode(), flags, ctypes.byref(attr), ctypes.sizeof(attr))) == 0
    except (AttributeError, OSError):
        return False


def _host_unix_sockets() -> list[str]:
    """Paths of the path-named Unix sockets listening in this network namespace (``/proc/net/unix``)."""
    paths: list[str] = []
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
            next(f, None)
            for line in f:
                fields = line.split()
                if len(fields) >= 8 and fields[7].startswith("/") and int(fields[3], 16) & 0x10000:
                    paths.append(fields[7])
    except (OSError, ValueError):
        pass
    return paths


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def helper_python() -> str:
    """The interpreter a bash cell's commands run: the base interpreter behind this one (the
    helper runs ``-I -S``, stdlib only, so a venv's own ``bin/python`` and its pyvenv.cfg are
    not needed), as a real path, so nothing it resolves through may be hidden by the sandbox."""
    for candidate in (getattr(sys, "_base_executable", None), sys.executable):
        if candidate and os.access(os.path.realpath(candidate), os.X_OK):
            return os.path.realpath(candidate)
    return sys.executable


def _carried() -> list[str]:
    """Host paths this child and its bash commands need that lie under a folder the sandbox
    covers with its own tmpfs (:data:`_COVERED`: a checkout, venv or Python under ``/tmp``):
    this package (the child's programs), the helper's interpreter, and the stdlib prefixes.
    Outermost paths only; paths inside the sandbox's own folders are left out (they cannot be
    recreated there)."""
    wanted = [PACKAGE_DIR, helper_python()]
    wanted += [os.path.realpath(p) for p in {sys.base_prefix, sys.base_exec_prefix} if p]
    wanted = sorted({p for p in wanted if _under(p, _COVERED) and not _under(p, (HOME, _PRIVATE))})
    outer = [p for p in wanted if not any(p != q and _under(p, (q,)) for q in wanted)]
    return [p for p in outer if os.path.exists(p)]


def _carry(mount: Callable[..., None], fds: dict[str, int]) -> list[str]:
    """Recreate each of ``fds`` (host path -> ``O_PATH`` descriptor opened before the tmpfs
    covered it) at the same path inside the sandbox and bind the host's file or folder there
    (read-only once the file system is made so). The folders made for it are root's (or the
    producer's), 0755, in the sticky ``/tmp``: the REPL's uid can neither write nor move them."""
    done = []
    for path, fd in fds.items():
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(path, mode=0o755, exist_ok=True)
        elif not os.path.exists(path):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444))
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        done.append(path)
    return done


def contain(init: dict[str, Any]) -> dict[str, Any]:
    """Put this process (and all it will start) into namespaces of its own, where it can.

    With a mount namespace (as root, or in an unprivileged user namespace): the host file
    system becomes read-only; a tmpfs of ``scratch_bytes`` bytes (nosuid, nodev) covers
    ``/tmp``, and folders of it cover ``/dev/shm``, ``/var/tmp`` and ``/run`` (so ``/var/run``),
    hiding the host's files and Unix sockets there; every other listening host Unix socket
    is covered with ``/dev/null``; as root, a procfs of its own with ``hidepid`` hides the
    processes of other uids (their command lines too); the work dir (context, packages) is bound read-only at
    ``/tmp/.rlmq/work`` and the interception socket's folder at ``/tmp/.rlmq/ipc``; HOME and
    cwd become ``/tmp/home``. The tmpfs lives as long as a process of this namespace does,
    and all of them are killed with the REPL, so nothing it writes outlives it. An IPC
    namespace makes System V and POSIX message-queue objects die with it too, and a network
    namespace leaves it no interface (with ``isolate_network``). Must run single-threaded,
    before privileges are dropped.

    Args:
        init: the init message (``workdir``, ``context_path``, ``files_dir``, ``sys_path``,
            ``unix_socket``, ``namespaces``, ``isolate_network``, ``scratch_bytes``).

    Returns:
        ``{"net_isolated", "fs_private", "ro_root", "proc_hidden": bool, "hidden_sockets": int,
        "carried": [str, ...], "paths": {"context_path", "files_dir", "sys_path", "unix_socket"}}``
        (paths as seen from inside), plus ``"fs_error": str`` when the private file system
        failed and the host's view was restored.

    Raises:
        OSError: a step failed after the host file system was made read-only.
    """
    report = _first_report(init)
    if not init.get("namespaces", True):
        return report
    want_net = bool(init.get("isolate_network"))
    host_sockets = _host_unix_sockets()
    try:
        libc = _libc()
    except (ImportError, OSError):
        return report
    if not _unshare(libc, CLONE_NEWNS | CLONE_NEWIPC | (CLONE_NEWNET if want_net else 0)):
        report["net_isolated"] = want_net and isolate_network()
        return report
    report["net_isolated"] = want_net
    workdir, sock = init["workdir"], init.get("unix_socket")
    fs = _PrivateFs(libc)
    try:
        fs.build(workdir, sock, int(init.get("scratch_bytes") or 256 * 1024**2), host_sockets, report)
    except OSError as exc:
        fs.close_descriptors()
        if report["ro_root"]:  # past the point of return: fail the start loudly
            raise
        # Back to the host's view (the namespace stays private; the REPL is then as without one).
        fs.undo()
        report.update(hidden_sockets=0, proc_hidden=False, carried=[], fs_error=str(exc))
        os.chdir(workdir)
        return report
    _move_inside(report, workdir, sock)
    return report


def _first_report(init: dict[str, Any]) -> dict[str, Any]:
    """The report of a child not (yet) contained: its paths as the host sees them."""
    return {
        "net_isolated": False,
        "fs_private": False,
        "ro_root": False,
        "hidden_sockets": 0,
        "proc_hidden": False,
        "carried": [],
        "paths": {
            "context_path": init["context_path"],
            "files_dir": init.get("files_dir"),
            "sys_path": list(init.get("sys_path") or []),
            "unix_socket": init.get("unix_socket"),
        },
    }


def _unshare(libc: Any, flags: int) -> bool:
    """Enter new namespaces of ``flags``: as root directly, otherwise together with a user
    namespace that maps this process's own uid and gid. Returns whether it worked."""
    if os.geteuid() == 0:
        return int(libc.unshare(flags)) == 0
    uid, gid = os.getuid(), os.getgid()
    if int(libc.unshare(CLONE_NEWUSER | flags)) != 0:
        return False
    _map_own_ids(uid, gid)
    return True


def _map_own_ids(uid: int, gid: int) -> None:
    """In a new user namespace: map ``uid`` and ``gid`` to themselves (no groups). A map that
    cannot be written leaves the namespaces in place; only ids read back differently."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        except OSError:
            pass


class _PrivateFs:
    """The private file system being built in this process's own mount namespace: the mount
    points made so far (undone if a later step fails) and the ``O_PATH`` descriptors of host
    paths opened before the tmpfs covers them."""

    def __init__(self, libc: Any) -> None:
        self.libc = libc
        self.done: list[str] = []
        self.fds: dict[str, int] = {}
        self.carried: dict[str, int] = {}

    def mount(self, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        _mount(self.libc, source, target, fstype, flags, data)
        if not flags & MS_REMOUNT:
            self.done.append(target)

    def build(
        self, workdir: str, sock: str | None, scratch: int, host_sockets: list[str], report: dict[str, Any]
    ) -> None:
        """Build it (see :func:`contain`), recording into ``report`` as it goes; cwd ends in HOME.

        Raises:
            OSError: a step failed (``report["ro_root"]`` says whether the host was made read-only).
        """
        _mount(self.libc, None, "/", None, MS_REC | MS_PRIVATE)
        self.fds["work"] = os.open(workdir, os.O_PATH | os.O_DIRECTORY)
        if sock:
            self.fds["ipc"] = os.open(os.path.dirname(sock), os.O_PATH | os.O_DIRECTORY)
        for path in _carried():
            try:
                self.carried[path] = os.open(path, os.O_PATH)
            except OSError:
                pass  # not carried: a bash REPL's start check then says what cannot start
        self._scratch(scratch)
        report["carried"] = _carry(self.mount, self.carried)
        report["hidden_sockets"] += self._hide_sockets(host_sockets)
        report["proc_hidden"] = self._private_proc()
        os.mkdir(HOME, 0o700)
        # Last: everything read-only (the work dir and socket binds too), then the scratch
        # space's own mounts writable again.
        report["ro_root"] = _read_only(self.libc)  # False on kernels before 5.12: the host stays as it is
        for target in (SCRATCH, "/dev/shm", "/var/tmp") if report["ro_root"] else ():  # noqa: S108
            if target in self.done and not _read_only(self.libc, target, writable=True):
                raise OSError(f"{target} could not be made writable again")
        os.chdir(HOME)
        for fd in self.carried.values():
            os.close(fd)
        self.carried.clear()

    def _scratch(self, scratch: int) -> None:
        """The tmpfs of ``scratch`` bytes over ``/tmp``, the work dir and socket folder bound into
        its root-owned ``/tmp/.rlmq``, and folders of it over ``/dev/shm``, ``/var/tmp``, ``/run``."""
        inodes = max(1024, scratch // 4096)  # an empty file is kernel memory too
        self.mount("rlmq-repl", SCRATCH, "tmpfs", MS_NOSUID | MS_NODEV, f"size={scratch},nr_inodes={inodes},mode=1777")
        os.mkdir(_PRIVATE, 0o755)
        for name in list(self.fds):
            target = os.path.join(_PRIVATE, name)
            os.mkdir(target, 0o755)
            self.mount(f"/proc/self/fd/{self.fds[name]}", target, None, MS_BIND)
            os.close(self.fds.pop(name))
        for name, target, mode in (("shm", "/dev/shm", 0o1777), ("vartmp", "/var/tmp", 0o1777), ("run", "/run", 0o755)):  # noqa: S108
            inner = os.path.join(_PRIVATE, name)
            os.mkdir(inner)
            os.chmod(inner, mode)
            if os.path.isdir(target) and not os.path.islink(target):
                self.mount(inner, target, None, MS_BIND)
        if os.path.isdir("/var/run") and not os.path.islink("/var/run"):
            self.mount(os.path.join(_PRIVATE, "run"), "/var/run", None, MS_BIND)

    def _hide_sockets(self, host_sockets: list[str]) -> int:
        """Cover each listening host Unix socket outside the covered folders with ``/dev/null``;
        returns how many were covered."""
        hidden = 0
        for path in host_sockets:
            if _under(path, _COVERED) or not os.path.exists(path):
                continue
            try:
                self.mount("/dev/null", path, None, MS_BIND)
                hidden += 1
            except OSError:
                pass
        return hidden

    def _private_proc(self) -> bool:
        """A procfs of its own where other uids' processes are not even listed (``hidepid``);
        returns whether one was mounted."""
        for options in ("hidepid=invisible", "hidepid=2"):
            try:
                self.mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | 8, options)  # 8: MS_NOEXEC
                return True
            except OSError:
                continue
        return False

    def close_descriptors(self) -> None:
        """Close the host paths' descriptors still open (after a failed step)."""
        for fd in self.fds.values():
            os.close(fd)
        for fd in self.carried.values():
            os.close(fd)

    def undo(self) -> None:
        """Detach every mount made so far, last first."""
        for target in reversed(self.done):
            self.libc.umount2(target.encode(), 2)  # MNT_DETACH


def _move_inside(report: dict[str, Any], workdir: str, sock: str | None) -> None:
    """With the private file system in place: the report's paths, HOME, TMPDIR and PYTHONPATH as
    seen from inside (the work dir at ``/tmp/.rlmq/work``, the socket's folder at ``/tmp/.rlmq/ipc``)."""
    work = os.path.join(_PRIVATE, "work")

    def inside(path: str) -> str:
        return os.path.join(work, os.path.relpath(path, workdir))

    paths = report["paths"]
    paths["context_path"] = inside(paths["context_path"])
    if paths["files_dir"]:
        paths["files_dir"] = inside(paths["files_dir"])
    paths["sys_path"] = [inside(p) for p in paths["sys_path"]]
    if sock:
        paths["unix_socket"] = os.path.join(_PRIVATE, "ipc", os.path.basename(sock))
    os.environ.update({"HOME": HOME, "TMPDIR": SCRATCH})
    if os.environ.get("PYTHONPATH"):
        os.environ["PYTHONPATH"] = os.pathsep.join(inside(p) for p in os.environ["PYTHONPATH"].split(os.pathsep))
    report["fs_private"] = True


def isolate_network() -> bool:
    """Move this process into a network namespace of its own; return whether it worked.

    The new namespace has only a loopback interface, and it is down: no TCP or UDP peer is
    reachable, not even the host's 127.0.0.1. The interception server stays reachable through
    its Unix socket, which lives in the file system, not in the network namespace. As root
    this is a plain network namespace (before privileges are dropped); otherwise a user
    namespace with it, where the kernel allows unprivileged user namespaces, mapping the
    process's own uid and gid so files keep their owners. Must run while single-threaded.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if int(libc.unshare(CLONE_NEWNET)) == 0:
            return True
        if os.geteuid() == 0:
            return False
        uid, gid = os.getuid(), os.getgid()
        if int(libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)) != 0:
            return False
    except (ImportError, OSError, AttributeError):
        return False
    _map_own_ids(uid, gid)  # the network is isolated all the same if a map cannot be written
    return True
