"""Who the REPL child runs as and what it may use: its own uid, its folders, its resource limits."""

from __future__ import annotations

import os
import shutil

from .shared import UID_BASE, reachable_by_others

__all__ = ["apply_limits", "copy_files", "drop_privileges", "hand_over", "host_home", "own_uid", "share_read_only"]


def own_uid(spec: str | int | None) -> int | None:
    """The unprivileged uid this REPL will run as, or ``None`` (it stays as it is).

    ``spec``: ``"auto"`` (``UID_BASE + pid``: unique among live REPLs of this host, so one
    REPL's processes and RLIMIT_NPROC count are its own), an int uid, or ``None``. Not root:
    ``None``. Two REPLs far apart in time may get the same uid (pids wrap); with a private
    file system (:func:`.containment.contain`) no file of the earlier one is left for the later one.
    """
    if spec is None or os.geteuid() != 0:
        return None
    if spec == "auto" and not reachable_by_others(os.path.dirname(os.__file__)):
        return None  # this interpreter's stdlib is private to root: imports would fail after the drop
    uid = UID_BASE + os.getpid() if spec == "auto" else int(spec)
    if uid <= 0:
        raise ValueError("the REPL never runs as root when asked to drop privileges")
    return uid


def hand_over(uid: int | None, paths: tuple[str, ...]) -> None:
    """Give ``paths`` (folders) to ``uid`` with mode 0700 (nothing when ``uid`` is ``None``)."""
    if uid is None:
        return
    for path in paths:
        os.chown(path, uid, uid)
        os.chmod(path, 0o700)


def share_read_only(uid: int | None, path: str) -> None:
    """Let ``uid`` read and search ``path`` (a folder the producer writes into) through its
    group, never write it: owner stays root, group ``uid``, mode 0750. The producer rewrites
    ``context.json`` there at every restart, so the REPL must not be able to plant a symlink
    in it (nor rename the folder: it does not own it)."""
    if uid is None:
        return
    os.chown(path, 0, uid)
    os.chmod(path, 0o750)


def host_home(workdir: str, uid: int | None) -> str:
    """Without a private file system: HOME and cwd are ``<workdir>/home``, the REPL's own."""
    home = os.path.join(workdir, "home")
    os.makedirs(home, exist_ok=True)
    hand_over(uid, (home,))
    os.chdir(home)
    os.environ.update({"HOME": home, "TMPDIR": home})
    return home


def copy_files(src: str, dest: str) -> None:
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


def drop_privileges(uid: int | None) -> None:
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


def apply_limits(
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
    (root parent, see :func:`drop_privileges`) it is ``max_processes``; otherwise the uid's
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
