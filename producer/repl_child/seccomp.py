"""The REPL child's seccomp filter: no user namespaces of its own, no io_uring, and (without a
memory cgroup) no shared memory that no process's ``RLIMIT_AS`` counts."""

from __future__ import annotations

from typing import Any

from .containment import CLONE_NEWUSER

__all__ = ["forbid_user_namespaces"]

_SECCOMP_ARCH = {  # machine: (AUDIT_ARCH_*, clone, unshare, clone3, (memfd_create, memfd_secret, shmget))
    "x86_64": (0xC000003E, 56, 272, 435, (319, 447, 29)),
    "aarch64": (0xC00000B7, 220, 97, 435, (279, 447, 194)),
}
_IO_URING = (425, 426, 427)
"""``io_uring_setup``, ``io_uring_enter``, ``io_uring_register`` (the same numbers on both):
always refused (EPERM), as Docker's default profile does: io_uring's operations bypass seccomp's
view of system calls, kernel attack surface a cell does not need."""


def _seccomp_program(arch: tuple[Any, ...], refuse_shared_memory: bool) -> list[tuple[int, int, int, int]]:
    """The classic BPF program of :func:`forbid_user_namespaces` (instructions as
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


def forbid_user_namespaces(refuse_shared_memory: bool = False) -> bool:
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
        libc = ctypes.CDLL(None, use_errno=True)
        filters = (SockFilter * len(program))(*[SockFilter(*insn) for insn in program])
        prog = SockFprog(len(program), filters)
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            return False
        return int(libc.prctl(22, 2, ctypes.byref(prog), 0, 0)) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    except (AttributeError, OSError):
        return False
