"""The REPL child: a standalone, stdlib-only program that runs model-written cells.

Started by :class:`rlmq.producer.repl.Repl` as::

    python -I repl_child.py <cmd_fd> <reply_fd>

It must not import rlmq nor any third-party package: it runs model-written code
and only needs the standard library.

Protocol (JSON lines, UTF-8, one object per line)
-------------------------------------------------
``cmd_fd`` (parent -> child) and ``reply_fd`` (child -> parent) are dedicated
pipes passed with ``pass_fds``; fd 0 is ``/dev/null`` and fd 1 and fd 2 are one
pipe the parent drains: everything the cell prints (``print``, tracebacks, the
repr of a last expression, output of subprocesses) goes there, in order.

1. parent -> child, first line, the init message (secrets never travel through
   argv or the environment, which other users of the host can read)::

       {"op": "init", "url": str, "token": str, "llm_batch_timeout": float (s),
        "workdir": str, "context_path": str, "sys_path": [str, ...],
        "cpu_seconds": int | null, "memory_bytes": int | null,
        "max_processes": int | null, "scratch_bytes": int, "max_open_files": int | null,
        "run_as": "auto" | int | null,
        "unix_socket": str | null, "isolate_network": bool, "namespaces": bool,
        "max_answer_length": int (characters), "max_batch_bytes": int,
        "max_batch_prompts": int, "refuse_shared_memory": bool,
        "tools": [{"name": str, "doc": str}, ...],
        "tool_timeout": float (s), "max_tool_bytes": int,
        "files_dir": str | null, "language": "python" | "bash",
        "output_format": "rlmq" | "reference", "sub_llms": bool}

   ``files_dir``: the context files (``context.txt`` / ``context.json`` / a copied
   ``context_dir``), copied into the working directory once the child runs as its own uid.
   ``language`` ``"bash"``: cells are bash (``repl_bash.py``, loaded from this folder), whose
   ``llm_batch``, ``rlm_batch`` and root tools run this program as a helper,
   ``python -I repl_child.py --command NAME ARGS...``, with the endpoint in its ``RLMQ_*``
   environment.

   ``llm_batch`` posts ``{"prompts"}`` to ``url``; ``rlm_batch`` posts ``{"tasks": [{"prompt",
   "context"}, ...]}`` to ``<url's folder>/rlm_batch`` (child rollouts), both with
   the same limits (``max_batch_prompts`` items, ``max_batch_bytes`` bytes of JSON).

   Each of ``tools`` becomes a REPL global of its name (a root tool), which posts
   ``{"name", "args", "kwargs"}`` to ``<url's folder>/root_tool`` and returns the result
   or raises ``RuntimeError`` with the producer's message.

   The child contains itself (:func:`_contain`: namespaces, private scratch space),
   drops to a uid of its own when it runs as root (``run_as``), applies the resource
   limits, loads ``context`` from the JSON file and answers
   ``{"type": "ready", "pid": int, "uid": int | null, "net_isolated": bool,
   "fs_private": bool, "ro_root": bool, "proc_hidden": bool, "hidden_sockets": int,
   "no_user_namespaces": bool, "shared_memory_refused": bool}``. Before anything else it
   closes every descriptor but fd 0-2 and its two pipes.
2. parent -> child, per cell: ``{"op": "exec", "code": str, "history"?: str}`` (``history``:
   JSON lines the child writes to ``.messages`` in its first working directory before the
   cell runs); the child answers
   ``{"type": "result", "answer_ready": bool, "answer_content": str,
   "seconds": float}`` once the cell is done (its output having been written to
   fd 1/2 before). ``answer_content`` is cut to ``max_answer_length`` characters
   here (with a note in the cell's output); the parent checks again, and kills a
   child whose line is longer than its limit.

Nothing else flows from child to parent: the parent keeps its own account of the
``llm_batch`` requests it serves (they reach it on the interception socket), so
nothing the child says can pause its cell timeout.

EOF on ``cmd_fd`` makes the child exit. Death of the child (``os._exit``, a
signal, a crash) shows as EOF on ``reply_fd``.
"""

from __future__ import annotations

import ast
import builtins
import http.client
import io
import json
import linecache
import os
import shutil
import socket
import sys
import threading
import time
import traceback
import types
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, BinaryIO, TextIO

_HERE = os.path.abspath(__file__)
_PROGRAMS = tuple(
    os.path.realpath(os.path.join(os.path.dirname(__file__), n)) for n in ("repl_child.py", "repl_bash.py")
)
"""This program and ``repl_bash.py`` as the host sees them: a bash cell's commands run them."""


class _Channel:
    """The reply pipe; writes are serialised because cells may call ``llm_batch`` from threads."""

    def __init__(self, fd: int) -> None:
        self._file: BinaryIO = open(fd, "wb", buffering=1 << 16)  # noqa: SIM115
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        # UTF-8, not \u escapes: at most 6 bytes a character (control characters), which the
        # parent's line limit (6 * max_answer_length + slack) admits
        data = (json.dumps(message, ensure_ascii=False) + "\n").encode("utf-8", "surrogatepass")
        with self._lock:
            self._file.write(data)
            self._file.flush()


UID_BASE = 100_000
"""When started as root, the child runs as uid/gid ``UID_BASE + its pid`` (no name, no groups)."""


def _own_uid(spec: str | int | None) -> int | None:
    """The unprivileged uid this REPL will run as, or ``None`` (it stays as it is).

    ``spec``: ``"auto"`` (``UID_BASE + pid``: unique among live REPLs of this host, so one
    REPL's processes and RLIMIT_NPROC count are its own), an int uid, or ``None``. Not root:
    ``None``. Two REPLs far apart in time may get the same uid (pids wrap); with a private
    file system (:func:`_contain`) no file of the earlier one is left for the later one.
    """
    if spec is None or os.geteuid() != 0:
        return None
    if spec == "auto" and not _reachable_by_others(os.path.dirname(os.__file__)):
        return None  # this interpreter's stdlib is private to root: imports would fail after the drop
    uid = UID_BASE + os.getpid() if spec == "auto" else int(spec)
    if uid <= 0:
        raise ValueError("the REPL never runs as root when asked to drop privileges")
    return uid


def _hand_over(uid: int | None, paths: tuple[str, ...]) -> None:
    """Give ``paths`` (folders) to ``uid`` with mode 0700 (nothing when ``uid`` is ``None``)."""
    if uid is None:
        return
    for path in paths:
        os.chown(path, uid, uid)
        os.chmod(path, 0o700)


def _share_read_only(uid: int | None, path: str) -> None:
    """Let ``uid`` read and search ``path`` (a folder the producer writes into) through its
    group, never write it: owner stays root, group ``uid``, mode 0750. The producer rewrites
    ``context.json`` there at every restart, so the REPL must not be able to plant a symlink
    in it (nor rename the folder: it does not own it)."""
    if uid is None:
        return
    os.chown(path, 0, uid)
    os.chmod(path, 0o750)


def _host_home(workdir: str, uid: int | None) -> str:
    """Without a private file system: HOME and cwd are ``<workdir>/home``, the REPL's own."""
    home = os.path.join(workdir, "home")
    os.makedirs(home, exist_ok=True)
    _hand_over(uid, (home,))
    os.chdir(home)
    os.environ.update({"HOME": home, "TMPDIR": home})
    return home


def _copy_files(src: str, dest: str) -> None:
    """Copy the context files the producer prepared (``src``, read-only) into the working
    directory ``dest``: the reference's ``context.txt`` / ``context.json`` / ``context_dir``.
    Links are copied as links, never followed."""
    for entry in os.scandir(src):  # the folder's entries: ``dest`` keeps its own mode
        target = os.path.join(dest, entry.name)
        if os.path.islink(target) or os.path.isfile(target):  # a restart without a private fs
            os.unlink(target)
        if entry.is_dir(follow_symlinks=False):
            shutil.copytree(entry.path, target, symlinks=True, dirs_exist_ok=True, copy_function=shutil.copyfile)
        elif entry.is_symlink():
            os.symlink(os.readlink(entry.path), target)
        else:
            shutil.copyfile(entry.path, target)


def _drop_privileges(uid: int | None) -> None:
    """As root, become ``uid`` (no groups) and set ``no_new_privs`` so setuid programs cannot
    regain privileges; ``None``: nothing."""
    if uid is None:
        return
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    except (ImportError, OSError, AttributeError):  # some Pythons ship without ctypes
        pass


CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
SCRATCH = "/tmp"  # noqa: S108 - inside the REPL's own mount namespace: its private tmpfs
HOME = "/tmp/home"  # noqa: S108
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


_SECCOMP_ARCH = {  # machine: (AUDIT_ARCH_*, clone, unshare, clone3, (memfd_create, memfd_secret, shmget))
    "x86_64": (0xC000003E, 56, 272, 435, (319, 447, 29)),
    "aarch64": (0xC00000B7, 220, 97, 435, (279, 447, 194)),
}
_IO_URING = (425, 426, 427)
"""``io_uring_setup``, ``io_uring_enter``, ``io_uring_register`` (the same numbers on both):
always refused (EPERM), as Docker's default profile does: io_uring's operations bypass seccomp's
view of system calls, kernel attack surface a cell does not need."""


def _seccomp_program(arch: tuple[Any, ...], refuse_shared_memory: bool) -> list[tuple[int, int, int, int]]:
    """The classic BPF program of :func:`_forbid_user_namespaces` (instructions as
    ``(code, jt, jf, k)``), jumps resolved from labels."""
    audit, nr_clone, nr_unshare, nr_clone3, shared_memory = arch
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    allow, errno_ret = 0x7FFF0000, 0x00050000
    # (code, label if true, label if false, k); a label None: the next instruction
    code: list[tuple[int, str | None, str | None, int] | str] = [
        (ld, None, None, 4),  # arch
        (jeq, None, "enosys", audit),  # another ABI (i386 through int 0x80): nothing at all
        (ld, None, None, 0),  # syscall number
        (jge, "enosys", None, 0x40000000),  # the x32 ABI: nothing at all
        (jeq, "enosys", None, nr_clone3),
        (jeq, "flags", None, nr_unshare),
        (jeq, "flags", None, nr_clone),
        *[(jeq, "eperm", None, nr) for nr in (*_IO_URING, *(shared_memory if refuse_shared_memory else ()))],
        (ret, None, None, allow),
        "flags",
        (ld, None, None, 16),  # args[0], low 32 bits (the flags)
        (jset, "eperm", None, CLONE_NEWUSER),
        (ret, None, None, allow),
        "eperm",
        (ret, None, None, errno_ret | 1),
        "enosys",
        (ret, None, None, errno_ret | 38),
    ]
    labels: dict[str, int] = {}
    for item in code:
        if isinstance(item, str):
            labels[item] = sum(1 for x in code[: code.index(item)] if not isinstance(x, str))
    program: list[tuple[int, int, int, int]] = []
    for item in code:
        if isinstance(item, str):
            continue
        op, on_true, on_false, k = item
        here = len(program)
        jt = 0 if on_true is None else labels[on_true] - here - 1
        jf = 0 if on_false is None else labels[on_false] - here - 1
        program.append((op, jt, jf, k))
    return program


def _forbid_user_namespaces(refuse_shared_memory: bool = False) -> bool:
    """Install a seccomp filter on this process (inherited by all it starts) that refuses
    ``unshare`` and ``clone`` with ``CLONE_NEWUSER`` (EPERM) and ``clone3`` (ENOSYS, so libc
    falls back to ``clone``): the cell cannot become root of a user namespace of its own,
    where it could mount file systems the REPL's limits do not count (a tmpfs is memory).
    With ``refuse_shared_memory`` (no memory cgroup counts the REPL's pages), also
    ``memfd_create``, ``memfd_secret`` and ``shmget`` (EPERM): memory no process's
    ``RLIMIT_AS`` counts. ``io_uring_*`` are always refused (EPERM). Other ABIs (i386, x32)
    get ENOSYS for every call. Sets
    ``no_new_privs`` first (required). Returns whether the filter is in place."""
    import ctypes
    import platform

    arch = _SECCOMP_ARCH.get(platform.machine())
    if arch is None:
        return False
    program = _seccomp_program(arch, refuse_shared_memory)

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    try:
        libc = _libc()
        filters = (SockFilter * len(program))(*[SockFilter(*insn) for insn in program])
        prog = SockFprog(len(program), filters)
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            return False
        return int(libc.prctl(22, 2, ctypes.byref(prog), 0, 0)) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    except (AttributeError, OSError):
        return False


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


def _helper_python() -> str:
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
    the two programs, the helper's interpreter, and the stdlib prefixes. Outermost paths only;
    paths inside the sandbox's own folders are left out (they cannot be recreated there)."""
    wanted = [*_PROGRAMS, _helper_python()]
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


def _contain(init: dict[str, Any]) -> dict[str, Any]:
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

    Returns:
        ``{"net_isolated", "fs_private", "ro_root", "proc_hidden": bool, "hidden_sockets": int,
        "paths": {"context_path", "sys_path", "unix_socket"}}`` (paths as seen from inside).
    """
    workdir = init["workdir"]
    sock = init.get("unix_socket")
    report: dict[str, Any] = {
        "net_isolated": False,
        "fs_private": False,
        "ro_root": False,
        "hidden_sockets": 0,
        "proc_hidden": False,
        "carried": [],
    }
    report["paths"] = {
        "context_path": init["context_path"],
        "files_dir": init.get("files_dir"),
        "sys_path": list(init.get("sys_path") or []),
        "unix_socket": sock,
    }
    if not init.get("namespaces", True):
        return report
    want_net = bool(init.get("isolate_network"))
    host_sockets = _host_unix_sockets()
    try:
        libc = _libc()
    except (ImportError, OSError):
        return report
    flags = CLONE_NEWNS | CLONE_NEWIPC | (CLONE_NEWNET if want_net else 0)
    if os.geteuid() != 0:
        uid, gid = os.getuid(), os.getgid()
        if int(libc.unshare(CLONE_NEWUSER | flags)) != 0:
            report["net_isolated"] = want_net and _isolate_network()
            return report
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            try:
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            except OSError:
                pass
    elif int(libc.unshare(flags)) != 0:
        report["net_isolated"] = want_net and _isolate_network()
        return report
    report["net_isolated"] = want_net
    done: list[str] = []  # mount points of this namespace, to undo if a later step fails
    fds: dict[str, int] = {}
    carried: dict[str, int] = {}

    def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        _mount(libc, source, target, fstype, flags, data)
        if not flags & MS_REMOUNT:
            done.append(target)

    try:
        _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
        fds["work"] = os.open(workdir, os.O_PATH | os.O_DIRECTORY)
        if sock:
            fds["ipc"] = os.open(os.path.dirname(sock), os.O_PATH | os.O_DIRECTORY)
        for path in _carried():
            try:
                carried[path] = os.open(path, os.O_PATH)
            except OSError:
                pass  # not carried: a bash REPL's start check then says what cannot start
        scratch = int(init.get("scratch_bytes") or 256 * 1024**2)
        inodes = max(1024, scratch // 4096)  # an empty file is kernel memory too
        mount("rlmq-repl", SCRATCH, "tmpfs", MS_NOSUID | MS_NODEV, f"size={scratch},nr_inodes={inodes},mode=1777")
        os.mkdir(_PRIVATE, 0o755)
        for name in list(fds):
            target = os.path.join(_PRIVATE, name)
            os.mkdir(target, 0o755)
            mount(f"/proc/self/fd/{fds[name]}", target, None, MS_BIND)
            os.close(fds.pop(name))
        for name, target, mode in (("shm", "/dev/shm", 0o1777), ("vartmp", "/var/tmp", 0o1777), ("run", "/run", 0o755)):  # noqa: S108
            inner = os.path.join(_PRIVATE, name)
            os.mkdir(inner)
            os.chmod(inner, mode)
            if os.path.isdir(target) and not os.path.islink(target):
                mount(inner, target, None, MS_BIND)
        if os.path.isdir("/var/run") and not os.path.islink("/var/run"):
            mount(os.path.join(_PRIVATE, "run"), "/var/run", None, MS_BIND)
        report["carried"] = _carry(mount, carried)
        for path in host_sockets:
            if _under(path, _COVERED) or not os.path.exists(path):
                continue
            try:
                mount("/dev/null", path, None, MS_BIND)
                report["hidden_sockets"] += 1
            except OSError:
                pass
        for options in ("hidepid=invisible", "hidepid=2"):  # other uids' processes: not even listed
            try:
                mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | 8, options)  # 8: MS_NOEXEC
                report["proc_hidden"] = True
                break
            except OSError:
                continue
        os.mkdir(HOME, 0o700)
        # Last: everything read-only (the work dir and socket binds too), then the scratch
        # space's own mounts writable again.
        report["ro_root"] = _read_only(libc)  # False on kernels before 5.12: the host stays as it is
        for target in (SCRATCH, "/dev/shm", "/var/tmp") if report["ro_root"] else ():  # noqa: S108
            if target in done and not _read_only(libc, target, writable=True):
                raise OSError(f"{target} could not be made writable again")
        os.chdir(HOME)
        for fd in carried.values():
            os.close(fd)
        carried.clear()
    except OSError as exc:
        for fd in fds.values():
            os.close(fd)
        for fd in carried.values():
            os.close(fd)
        if report["ro_root"]:  # past the point of return: fail the start loudly
            raise
        # Back to the host's view (the namespace stays private; the REPL is then as without one).
        for target in reversed(done):
            libc.umount2(target.encode(), 2)  # MNT_DETACH
        report.update(hidden_sockets=0, proc_hidden=False, carried=[], fs_error=str(exc))
        os.chdir(workdir)
        return report
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
    return report


def _isolate_network() -> bool:
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
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        except OSError:
            pass  # the network is isolated all the same; only ids read back differently
    return True


def _reachable_by_others(path: str) -> bool:
    """Whether a user with no rights of its own can read ``path`` (every parent searchable)."""
    import stat

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


def _tasks_of(uid: int) -> int:
    """Processes and threads now running as ``uid`` (what RLIMIT_NPROC counts)."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return n


def _apply_limits(
    cpu_seconds: int | None,
    memory_bytes: int | None,
    max_processes: int | None = None,
    own_uid: bool = False,
    file_bytes: int | None = None,
    open_files: int | None = None,
) -> None:
    """Set RLIMIT_CORE=0, RLIMIT_AS, RLIMIT_CPU, RLIMIT_NPROC, RLIMIT_FSIZE and RLIMIT_NOFILE
    on this process (inherited by its children). Python ignores SIGXFSZ, so a write past
    ``file_bytes`` fails with ``OSError(EFBIG)``; past ``open_files`` (per process) ``open``
    and ``connect`` fail with EMFILE, which bounds the connections one process of the cell
    can hold open to the interception socket (each costs the producer a descriptor).

    RLIMIT_NPROC counts every process and thread of the real uid: with a uid of its own
    (root parent, see :func:`_drop_privileges`) it is ``max_processes``; otherwise the uid's
    current count plus ``max_processes``. Root ignores RLIMIT_NPROC.

    Done here rather than in a ``preexec_fn`` of the parent, which is unsafe when the
    parent has threads; it runs before any model-written code.
    """
    import resource

    def lower(which: int, soft: int, hard: int) -> None:
        _, cur_hard = resource.getrlimit(which)
        if cur_hard != resource.RLIM_INFINITY:
            hard = min(hard, cur_hard)
            soft = min(soft, hard)
        resource.setrlimit(which, (soft, hard))

    lower(resource.RLIMIT_CORE, 0, 0)
    if file_bytes is not None:
        lower(resource.RLIMIT_FSIZE, file_bytes, file_bytes)
    if open_files is not None:
        lower(resource.RLIMIT_NOFILE, open_files, open_files)
    if max_processes is not None and os.getuid() != 0:
        n = max_processes if own_uid else _tasks_of(os.getuid()) + max_processes
        lower(resource.RLIMIT_NPROC, n, n)
    if memory_bytes is not None:
        lower(resource.RLIMIT_AS, memory_bytes, memory_bytes)
    if cpu_seconds is not None:
        # The soft limit sends SIGXCPU (which kills: Python keeps the default action);
        # the hard limit one second later is SIGKILL, for code that ignores SIGXCPU.
        lower(resource.RLIMIT_CPU, cpu_seconds, cpu_seconds + 1)


def _post(
    opener: urllib.request.OpenerDirector,
    url: str,
    body: bytes,
    token: str,
    timeout: float,
    *,
    refused: str,
    unreachable: str,
) -> bytes:
    """POST the JSON ``body`` to ``url`` (the rollout's own endpoint) with its bearer ``token``,
    waiting at most ``timeout`` seconds; returns the response body.

    Raises:
        RuntimeError: ``<refused> (HTTP <code>): <the server's message>`` for an HTTP error,
            ``<unreachable>: <reason>`` when the endpoint cannot be reached (no chained traceback).
    """
    request = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    error: str | None = None
    try:
        with opener.open(request, timeout=timeout) as response:
            raw: bytes = response.read()
            return raw
    except urllib.error.HTTPError as exc:
        error = f"{refused} (HTTP {exc.code}): {_server_message(exc)}"
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        error = f"{unreachable}: {reason}"
    raise RuntimeError(error)


def _server_message(err: urllib.error.HTTPError) -> str:
    try:
        raw = err.read()
    except Exception:  # noqa: BLE001
        raw = b""
    text = raw.decode("utf-8", "replace").strip()
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict) and "error" in body:
        return str(body["error"])
    return text or str(err.reason)


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over the interception server's Unix socket."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class _UnixHandler(urllib.request.HTTPHandler):
    """Sends every ``http://`` request of the opener through the Unix socket (replaces the
    opener's default HTTP handler)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._path = path

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        path = self._path
        return self.do_open(lambda host, timeout=60.0, **kw: _UnixHTTPConnection(path, timeout), req)


def _batch_results(raw: bytes, n: int, name: str, service: str) -> list[str]:
    """The ``n`` string results of an ``llm_batch``/``rlm_batch`` response ``raw``, after printing
    its summary; ``name`` and ``service`` word the error.

    Raises:
        RuntimeError: the response is not JSON with ``n`` string ``results``.
    """
    try:
        payload = json.loads(raw)
        results = payload["results"]
        summary = payload.get("summary", "")
    except (ValueError, KeyError, TypeError, AttributeError):
        raise RuntimeError(f"{name} got a malformed response from {service}") from None
    if not isinstance(results, list) or len(results) != n or not all(isinstance(r, str) for r in results):
        raise RuntimeError(f"{name} got a malformed response: expected {n} string results")
    if summary:
        print(summary if isinstance(summary, str) else str(summary))
    return list(results)


def _opener(unix_socket: str | None) -> urllib.request.OpenerDirector:
    """The HTTP opener of the REPL's calls to the interception endpoint: no proxy from the
    environment, and over ``unix_socket`` when the endpoint is one."""
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if unix_socket:
        handlers.append(_UnixHandler(unix_socket))
    return urllib.request.build_opener(*handlers)


def _non_string_prompts(prompts: list[Any]) -> dict[int, str]:
    """Place -> the error answer of each prompt that is not a str (verifiers 0.1.14's
    ``llm_batch`` answers such a prompt with an error and runs the others)."""
    return {
        i: f"Error: llm_batch prompt at index {i} must be a string, not {type(p).__name__}"
        for i, p in enumerate(prompts)
        if not isinstance(p, str)
    }


def _make_llm_batch(
    url: str,
    token: str,
    timeout: float,
    unix_socket: str | None,
    max_batch_bytes: int,
    max_batch_prompts: int,
) -> Callable[[list[str]], list[str]]:
    opener = _opener(unix_socket)
    # The producer serves one batch of a rollout at a time and keeps a bounded number of its
    # connections open (closing extras at once): threads of a cell wait here, not there.
    in_flight = threading.BoundedSemaphore(8)

    def llm_batch(prompts: list[str]) -> list[str]:
        """Send a batch of prompts to sub-LLMs and return their answers, in order.

        Args:
            prompts: a list of prompt strings; each becomes one sub-LLM call and the
                calls run in parallel.

        Returns:
            One answer string per prompt, in the order of ``prompts``. A summary of
            the batch (tokens, turns, seconds per prompt, budget) is printed.

        A prompt that is not a str gets ``Error: llm_batch prompt at index i must be a
        string, ...`` as its answer; the other prompts run.

        Raises:
            TypeError: ``prompts`` is not a list.
            ValueError: the batch is over the limits (prompts, bytes), or a prompt is not valid
                Unicode text (a lone surrogate); send smaller batches of text.
            RuntimeError: the batch was refused (for example the budget is spent)
                or the sub-LLM service could not be reached.
        """
        if not isinstance(prompts, list):
            raise TypeError(f"llm_batch(prompts) expects a list of str, got {type(prompts).__name__}")
        refused = _non_string_prompts(prompts)
        if refused:  # those answered with an error, the rest sent, as the reference's llm_batch does
            sent = [p for i, p in enumerate(prompts) if i not in refused]
            answers = iter(llm_batch(sent) if sent else [])
            return [refused[i] if i in refused else next(answers) for i in range(len(prompts))]
        if not prompts:
            return []
        for i, prompt in enumerate(prompts):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"llm_batch: prompts[{i}] is not valid Unicode text (a lone surrogate at character {exc.start})"
                ) from None
        if len(prompts) > max_batch_prompts:
            raise ValueError(
                f"llm_batch got {len(prompts)} prompts; at most {max_batch_prompts} per call: split the batch"
            )
        body = json.dumps({"prompts": prompts}).encode("utf-8", "surrogatepass")
        if len(body) > max_batch_bytes:
            raise ValueError(
                f"llm_batch prompts take {len(body)} bytes; at most {max_batch_bytes} per call: "
                "send shorter prompts or split the batch"
            )
        with in_flight:
            raw = _post(
                opener, url, body, token, timeout,
                refused="llm_batch failed", unreachable="llm_batch could not reach the sub-LLM service",
            )  # fmt: skip
        return _batch_results(raw, len(prompts), "llm_batch", "the sub-LLM service")

    return llm_batch


def _make_rlm_batch(
    url: str,
    token: str,
    timeout: float,
    unix_socket: str | None,
    max_batch_bytes: int,
    max_batch_prompts: int,
) -> Callable[[list[Any]], list[str]]:
    """The REPL global ``rlm_batch``: posts its tasks to ``<url's folder>/rlm_batch``."""
    opener = _opener(unix_socket)
    rlm_url = url.rsplit("/", 1)[0] + "/rlm_batch"
    in_flight = threading.BoundedSemaphore(8)

    def rlm_batch(tasks: list[Any]) -> list[str]:
        """Run each task as a child RLM (its own REPL and model) and return their answers, in order.

        Args:
            tasks: a list; each task is a prompt (str) or ``{"prompt": str, "context": JSON}``,
                ``context`` (a str, list or dict) being the child's ``context`` variable.

        Returns:
            One answer string per task, in order (``[error] ...`` / ``[rejected] ...`` for a task
            that failed or was refused). A summary of the batch is printed.

        Raises:
            TypeError: ``tasks`` is not a list of str or {"prompt": str, "context": JSON} dicts.
            ValueError: the batch is over the limits (tasks, bytes), or a prompt or context is not
                valid Unicode text; send smaller batches of text.
            RuntimeError: the batch was refused or the service could not be reached.
        """
        if not isinstance(tasks, list):
            raise TypeError(f"rlm_batch(tasks) expects a list, got {type(tasks).__name__}")
        body_tasks: list[dict[str, Any]] = []
        for i, task in enumerate(tasks):
            if isinstance(task, str):
                body_tasks.append({"prompt": task})
                continue
            if not isinstance(task, dict):
                raise TypeError(
                    f"rlm_batch(tasks): tasks[{i}] is {type(task).__name__}; "
                    'give a str or {"prompt": str, "context": ...}'
                )
            strangers = sorted(str(k) for k in task if k not in ("prompt", "context"))
            if strangers:
                raise TypeError(f"rlm_batch(tasks): tasks[{i}] has unknown key(s) {', '.join(strangers)}")
            if not isinstance(task.get("prompt"), str):
                raise TypeError(f'rlm_batch(tasks): tasks[{i}]["prompt"] must be a str')
            context = task.get("context")
            if context is not None and not isinstance(context, (str, list, dict)):
                raise TypeError(
                    f'rlm_batch(tasks): tasks[{i}]["context"] must be a str, list or dict, not {type(context).__name__}'
                )
            body_tasks.append({"prompt": task["prompt"], "context": context})
        if not body_tasks:
            return []
        if len(body_tasks) > max_batch_prompts:
            raise ValueError(
                f"rlm_batch got {len(body_tasks)} tasks; at most {max_batch_prompts} per call: split the batch"
            )
        try:
            text = json.dumps({"tasks": body_tasks}, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise TypeError(f"rlm_batch(tasks): a context is not a JSON value: {exc}") from None
        try:
            body = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"rlm_batch: a prompt or context is not valid Unicode text (a lone surrogate at character {exc.start})"
            ) from None
        if len(body) > max_batch_bytes:
            raise ValueError(
                f"rlm_batch tasks take {len(body)} bytes; at most {max_batch_bytes} per call: "
                "send shorter prompts and contexts or split the batch"
            )
        with in_flight:
            raw = _post(
                opener, rlm_url, body, token, timeout,
                refused="rlm_batch failed", unreachable="rlm_batch could not reach the producer",
            )  # fmt: skip
        return _batch_results(raw, len(body_tasks), "rlm_batch", "the producer")

    return rlm_batch


def _make_root_tool(
    spec: dict[str, Any], url: str, token: str, timeout: float, unix_socket: str | None, max_bytes: int
) -> Callable[..., Any]:
    """The REPL global of one root tool: posts its JSON arguments to ``<endpoint>/root_tool``."""
    opener = _opener(unix_socket)
    name = str(spec["name"])
    tool_url = url.rsplit("/", 1)[0] + "/root_tool"

    def tool(*args: Any, **kwargs: Any) -> Any:
        try:
            body = json.dumps({"name": name, "args": list(args), "kwargs": kwargs}).encode("utf-8", "surrogatepass")
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{name}() takes JSON values (str, int, float, bool, None, list, dict): {exc}") from None
        if len(body) > max_bytes:
            raise ValueError(f"{name}() arguments take {len(body)} bytes of JSON; at most {max_bytes}")
        raw = _post(
            opener, tool_url, body, token, timeout,
            refused=f"{name}() was refused", unreachable=f"{name}() could not reach the producer",
        )  # fmt: skip
        try:
            payload = json.loads(raw)
        except ValueError:
            raise RuntimeError(f"{name}() got a malformed response from the producer") from None
        if isinstance(payload, dict) and "result" in payload:
            return payload["result"]
        if isinstance(payload, dict) and isinstance(payload.get("error"), str):
            raise RuntimeError(payload["error"])
        raise RuntimeError(f"{name}() got a malformed response from the producer")

    tool.__name__ = tool.__qualname__ = name
    tool.__doc__ = str(spec.get("doc") or "") or None
    tool.__module__ = "__main__"
    return tool


def _strip_internal_frames(exc: traceback.TracebackException) -> None:
    """Drop this file's frames from ``exc`` and the exceptions chained to it, in place."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        te = todo.pop()
        if id(te) in seen:
            continue
        seen.add(id(te))
        te.stack = traceback.StackSummary.from_list([fs for fs in te.stack if os.path.abspath(fs.filename) != _HERE])
        for nxt in (te.__cause__, te.__context__):
            if nxt is not None:
                todo.append(nxt)
        todo.extend(getattr(te, "exceptions", None) or [])


def _format_exception(exc: BaseException) -> str:
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__, compact=True)
    _strip_internal_frames(te)
    return "".join(te.format())


class _CellRunner:
    """The child's side: the persistent namespace and the runner of cells in it."""

    def __init__(
        self, namespace: dict[str, Any], out: TextIO, err: TextIO, max_answer_length: int, reference: bool = False
    ) -> None:
        self.namespace = namespace
        self.max_answer_length = max_answer_length
        self.out = out
        self.err = err
        self.cells = 0
        self.pid = os.getpid()
        self.reference = reference
        """verifiers 0.1.14's output format (the ``output_format`` ``"reference"`` of the init message)."""

    def _register_source(self, filename: str, code: str) -> None:
        lines = code.splitlines(keepends=True)
        linecache.cache[filename] = (len(code), None, lines, filename)

    def run(self, code: str) -> dict[str, Any]:
        self.cells += 1
        filename = f"<cell-{self.cells}>"
        self._register_source(filename, code)
        started = time.perf_counter()
        if self.reference:
            self._run_reference(code, filename)
        else:
            try:
                value = self._exec(code, filename)
                if value is not None:
                    self._write(self.out, repr(value) + "\n")
            except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt too
                self._write(self.err, _format_exception(exc))
        if os.getpid() != self.pid:
            os._exit(0)  # a process the cell forked came back here: it must not answer nor read commands
        seconds = time.perf_counter() - started
        self._flush()
        ready, content = self._answer()
        return {
            "type": "result",
            "answer_ready": ready,
            "answer_content": content,
            "seconds": seconds,
        }

    def _exec(self, code: str, filename: str) -> Any:
        """Run ``code``; the value of its last statement when that is an expression, else ``None``."""
        try:
            tree = ast.parse(code, filename, "exec")
        except (SyntaxError, ValueError) as exc:  # ValueError: null bytes in the source
            raise exc.with_traceback(None) from None
        last: ast.Expression | None = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body[-1].value)
            tree.body.pop()
        exec(compile(tree, filename, "exec"), self.namespace)  # noqa: S102
        if last is None:
            return None
        return eval(compile(last, filename, "eval"), self.namespace)  # noqa: S307

    def _run_reference(self, code: str, filename: str) -> None:
        """Run a cell with verifiers 0.1.14's output: what it printed, then what it wrote to
        ``sys.stderr`` after a ``stderr:`` line, then ``Out[n]: repr`` of its last expression
        or its traceback. (What subprocesses write to the file descriptors stays in place.)"""
        saved, caught = sys.stderr, io.StringIO()
        sys.stderr = caught
        tail = ""
        try:
            value = self._exec(code, filename)
            if value is not None:
                tail = f"Out[{self.cells}]: {value!r}\n"
        except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt too
            tail = _format_exception(exc)
        finally:
            sys.stderr = saved
        self._flush()
        stderr = caught.getvalue().rstrip()
        if stderr:
            self._write(self.out, f"stderr:\n{stderr}\n")
        if tail:
            self._write(self.out, tail)

    def _write(self, stream: TextIO, text: str) -> None:
        try:
            stream.write(text)
            stream.flush()
        except Exception:  # noqa: BLE001 - the cell may have closed or replaced streams
            try:
                os.write(2, text.encode("utf-8", "backslashreplace"))
            except OSError:
                pass

    def _flush(self) -> None:
        for stream in (sys.stdout, sys.stderr, self.out, self.err):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass

    def _answer(self) -> tuple[bool, str]:
        answer = self.namespace.get("answer")
        if not isinstance(answer, dict):
            return False, ""
        try:
            ready = bool(answer.get("ready", False))
        except Exception:  # noqa: BLE001
            ready = False
        try:
            content = answer.get("content", "")
            content = content if isinstance(content, str) else str(content)
        except Exception as exc:  # noqa: BLE001
            content = f"<answer['content'] could not be converted to str: {exc!r}>"
        if not isinstance(content, str):  # a str subclass whose __str__ returns something else
            content = "<answer['content'] is not a str>"
        if len(content) > self.max_answer_length:
            self._write(
                self.err,
                f"[answer['content'] has {len(content)} characters; only the first {self.max_answer_length} "
                "reach the producer]\n",
            )
            content = str.__getitem__(content, slice(0, self.max_answer_length))
        return ready, str.__str__(content)


def _write_history(home: str, text: str) -> None:
    """Overwrite ``<home>/.messages`` with the conversation (JSON lines), as the REPL's own uid;
    a link planted there is replaced, never written through."""
    path = os.path.join(home, ".messages")
    try:
        if os.path.islink(path):
            os.unlink(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with open(fd, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(text)
    except OSError as exc:  # a full scratch space, a folder the cell removed: said in the output
        runner_note(sys.stderr, f"[.messages could not be written: {exc}]")


def runner_note(err: TextIO, text: str) -> None:
    """A line of the REPL's own on the cell's stderr."""
    try:
        err.write(text + "\n")
        err.flush()
    except Exception:  # noqa: BLE001
        pass


def _die_with_the_producer(cmd_fd: int, own_uid: bool) -> None:
    """Watch the command pipe from a daemon thread: when its write end closes (the producer
    closed the REPL, or died, even of SIGKILL), kill this REPL's whole process group and, with a
    uid of its own, every process of that uid (``kill(-1)``), so a cell sleeping forever, or its
    processes, cannot outlive a dead producer. ``poll`` with no event asked reports only the
    hang-up and consumes nothing the main loop reads."""
    import select
    import signal

    def watch() -> None:
        poller = select.poll()
        poller.register(cmd_fd, 0)
        while True:
            try:
                events = poller.poll()
            except InterruptedError:
                continue
            if any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in events):
                break
        if own_uid:
            try:
                os.kill(-1, signal.SIGKILL)  # every process of this REPL's own uid, this one last
            except OSError:
                pass
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="rlmq-producer-watch", daemon=True).start()


def _stdio(fd: int) -> io.TextIOWrapper:
    # Unbuffered text over the raw fd, as ``python -u`` does: nothing is lost on os._exit.
    return io.TextIOWrapper(
        io.FileIO(fd, "w", closefd=False),
        encoding="utf-8",
        errors="backslashreplace",
        write_through=True,
    )


def _close_other_descriptors(keep: tuple[int, ...]) -> None:
    """Close every descriptor from 3 up but ``keep``: the child starts with exactly the ones it
    is given (fd 0-2 and its two pipes), whatever the parent's event loop left inheritable (uvloop
    keeps a launcher's inheritable descriptors open across the spawn: a log file, a socket to a
    Redis). ``os.closerange`` is ``close_range(2)`` where the kernel has it."""
    low = 3
    for fd in sorted(set(keep)):
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    os.closerange(low, 1 << 20)
    try:  # descriptors above the probe (a soft limit raised past 2**20): close them one by one
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor, already closed


def _load_bash() -> Any:
    """``repl_bash.py`` beside this program (``-I`` puts no folder of ours on ``sys.path``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("repl_bash", _PROGRAMS[1])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_HELPER_ENV = ("RLMQ_URL", "RLMQ_TOKEN", "RLMQ_SOCKET", "RLMQ_BATCH_TIMEOUT", "RLMQ_MAX_BATCH_BYTES",
               "RLMQ_MAX_BATCH_PROMPTS", "RLMQ_TOOL_TIMEOUT", "RLMQ_MAX_TOOL_BYTES")  # fmt: skip


def _helper_env(init: dict[str, Any], unix_socket: str | None) -> dict[str, str]:
    """What a bash cell's commands need to reach the rollout's endpoint (see :func:`_command`)."""
    values = (init["url"], init["token"], unix_socket or "", init["llm_batch_timeout"], init["max_batch_bytes"],
              init["max_batch_prompts"], 2 * float(init.get("tool_timeout") or 60.0) + 30.0,
              init.get("max_tool_bytes") or 1024 * 1024)  # fmt: skip
    return {
        **dict(zip(_HELPER_ENV, map(str, values), strict=True)),
        "RLMQ_PYTHON": _helper_python(),
        "RLMQ_HELPER": _PROGRAMS[0],
    }


def _probe_helper(env: dict[str, str]) -> str | None:
    """Run a bash cell's command once as a cell would (this uid, these limits, this sandbox):
    ``None`` when it started and loaded ``repl_bash.py``, else one line saying why not."""
    import subprocess

    argv = [env["RLMQ_PYTHON"], "-I", "-S", env["RLMQ_HELPER"], "--probe"]
    try:
        done = subprocess.run(argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=120, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{argv[0]} could not run: {exc}"
    if done.returncode == 0 and done.stdout.strip() == b"ok":
        return None
    lines = [line for line in done.stderr.decode("utf-8", "replace").splitlines() if line.strip()]
    why = lines[-1].strip()[:500] if lines else f"exit status {done.returncode}"
    return f"{argv[0]} -I -S {argv[3]} (exit status {done.returncode}): {why}"


def _bash_runner(bash: Any, init: dict[str, Any], unix_socket: str | None, err: TextIO, max_answer: int) -> Any:
    """The bash cell runner (``repl_bash.BashRunner``), its commands reaching the rollout's endpoint."""
    batches = ["llm_batch", "rlm_batch"] if init.get("sub_llms") is not False else []
    names = [*batches, *(str(t["name"]) for t in init.get("tools") or [])]
    env = {**os.environ, **_helper_env(init, unix_socket)}
    return bash.BashRunner(os.getcwd(), env, names, max_answer, lambda text: runner_note(err, text))


def _command(argv: list[str]) -> int:
    """A bash cell's command (``llm_batch``, ``rlm_batch``, a root tool) as a process of its own."""
    env = {k: os.environ.get(k, "") for k in _HELPER_ENV}
    url, token, sock = env["RLMQ_URL"], env["RLMQ_TOKEN"], env["RLMQ_SOCKET"] or None
    limits = (
        float(env["RLMQ_BATCH_TIMEOUT"]),
        sock,
        int(env["RLMQ_MAX_BATCH_BYTES"]),
        int(env["RLMQ_MAX_BATCH_PROMPTS"]),
    )

    def make(name: str) -> Callable[..., Any]:
        if name == "llm_batch":
            return _make_llm_batch(url, token, *limits)
        if name == "rlm_batch":
            return _make_rlm_batch(url, token, *limits)
        tool_limits = (float(env["RLMQ_TOOL_TIMEOUT"]), sock, int(env["RLMQ_MAX_TOOL_BYTES"]))
        return _make_root_tool({"name": name}, url, token, *tool_limits)

    return int(_load_bash().command(argv, make))


def main(argv: list[str]) -> int:
    if len(argv) > 2 and argv[1] == "--command":
        return _command(argv[2:])
    if argv[1:] == ["--probe"]:  # the child's check that its bash commands can start (see _probe_helper)
        _load_bash()
        print("ok")
        return 0
    cmd_fd, reply_fd = int(argv[1]), int(argv[2])
    _close_other_descriptors((cmd_fd, reply_fd))  # first: before anything else runs here
    for fd in (cmd_fd, reply_fd):
        os.set_inheritable(fd, False)  # not leaked to processes the cell starts
    commands = open(cmd_fd, "rb")  # noqa: SIM115
    channel = _Channel(reply_fd)

    line = commands.readline()
    if not line:
        return 0
    init = json.loads(line)
    bash = _load_bash() if init.get("language") == "bash" else None  # before the privileges go
    uid = _own_uid(init.get("run_as"))
    _share_read_only(uid, init["workdir"])  # context and packages: readable, never writable
    if init.get("unix_socket"):  # the rollout's own socket: no other REPL's uid may connect to it
        try:
            _share_read_only(uid, os.path.dirname(init["unix_socket"]))
        except OSError:
            pass  # no such folder: llm_batch will say it cannot reach the service
    contained = _contain(init)
    paths = contained.pop("paths")
    if contained["fs_private"]:
        _hand_over(uid, (HOME,))
    else:
        _host_home(init["workdir"], uid)
    _drop_privileges(uid)
    if paths["files_dir"]:  # as its own uid, into its own (private) working directory
        _copy_files(paths["files_dir"], os.getcwd())
    refuse_shared_memory = bool(init.get("refuse_shared_memory"))
    contained["no_user_namespaces"] = _forbid_user_namespaces(refuse_shared_memory)
    contained["shared_memory_refused"] = refuse_shared_memory and contained["no_user_namespaces"]
    _die_with_the_producer(cmd_fd, uid is not None)
    _apply_limits(
        init.get("cpu_seconds"),
        init.get("memory_bytes"),
        init.get("max_processes"),
        uid is not None,
        init.get("scratch_bytes"),
        init.get("max_open_files"),
    )
    if bash is not None:  # as a cell's command will run: after containment, privileges and limits
        contained["helper_error"] = _probe_helper(_helper_env(init, paths["unix_socket"]))
    for path in reversed(paths["sys_path"]):
        sys.path.insert(0, path)

    out, err = _stdio(1), _stdio(2)
    sys.stdout = sys.__stdout__ = out  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = err  # type: ignore[misc]
    sys.argv = [""]
    sys.dont_write_bytecode = True  # -I ignores PYTHONDONTWRITEBYTECODE

    with open(paths["context_path"], encoding="utf-8") as f:
        context = json.load(f)

    # Cells run in a fresh ``__main__`` module, so objects they define pickle normally
    # (multiprocessing) and this program's own names stay out of their sight.
    main_module = types.ModuleType("__main__")
    main_module.__dict__.update(
        {
            "__builtins__": builtins,
            "context": context,
            "llm_batch": _make_llm_batch(
                init["url"],
                init["token"],
                float(init["llm_batch_timeout"]),
                paths["unix_socket"],
                int(init["max_batch_bytes"]),
                int(init["max_batch_prompts"]),
            ),
            "rlm_batch": _make_rlm_batch(
                init["url"],
                init["token"],
                float(init["llm_batch_timeout"]),
                paths["unix_socket"],
                int(init["max_batch_bytes"]),
                int(init["max_batch_prompts"]),
            ),
            "answer": {"content": "", "ready": False},
        }
    )
    for spec in init.get("tools") or []:  # root tools: run in the producer, reached like llm_batch
        main_module.__dict__[str(spec["name"])] = _make_root_tool(
            spec,
            init["url"],
            init["token"],
            # the producer times the tool (and the wait for the rollout's call before it); a backstop
            2 * float(init.get("tool_timeout") or 60.0) + 30.0,
            paths["unix_socket"],
            int(init.get("max_tool_bytes") or 1024 * 1024),
        )
    if init.get("sub_llms") is False:  # enable_sub_llms off: no sub-LLMs to call
        del main_module.__dict__["llm_batch"], main_module.__dict__["rlm_batch"]
    sys.modules["__main__"] = main_module
    max_answer = int(init.get("max_answer_length", 1_000_000))
    reference = init.get("output_format") == "reference"
    runner = _CellRunner(main_module.__dict__, out, err, max_answer, reference) if bash is None else None
    runner = runner or _bash_runner(bash, init, paths["unix_socket"], err, max_answer)
    home = os.getcwd()  # the working directory the context files are in: `.messages` goes here too
    del init, context

    channel.send({"type": "ready", "pid": os.getpid(), "uid": uid, **contained})
    while True:
        line = commands.readline()
        if not line:
            return 0
        message = json.loads(line)
        if message.get("op") == "exec":
            if isinstance(message.get("history"), str):
                _write_history(home, message["history"])
            channel.send(runner.run(message["code"]))


if __name__ == "__main__":
    _self = sys.modules["__main__"]  # keep this module alive once __main__ is replaced
    sys.exit(main(sys.argv))
