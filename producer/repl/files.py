"""The rollout's context as files in the REPL's working directory, as verifiers' ``RLMEnv`` wrote it.

The reference (verifiers ``RLMEnv``, 0.1.14, ``setup_state``) gives its REPL a working directory
holding the row's context: ``info["context_dir"]`` copied in whole (refused when it, or anything
under it, is a symlink, or when its files add up to more than 1,000,000,000 bytes); else
``info["context"]``: a str as ``context.txt`` (UTF-8), anything else as ``context.json``
(``json.dumps`` with ASCII escapes, no NaN). rlmq does the same, and for a row without either in
``info`` writes the row's own ``context`` the same way, so every rollout's REPL holds its input as
files and as the ``context`` variable (the RLM paper's style).

Here the producer prepares the files in the REPL's host folder (:func:`prepare_files`, read-only
to the REPL), and the REPL's own process copies them into its working directory once it runs as
its own uid inside its namespaces, so the copy lands in its private scratch space and counts
against it (``scratch_bytes``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Final

from rlmq.common.schemas import DatasetRow

__all__ = [
    "CONTEXT_DIR_MAX_BYTES", "ContextFiles", "context_files", "file_name", "prepare_files", "repl_context",
    "retain_working_directory",
]  # fmt: skip

CONTEXT_DIR_MAX_BYTES: Final = 1_000_000_000
"""The reference's bound on a ``context_dir`` (bytes of its files, summed)."""


@dataclass(frozen=True)
class ContextFiles:
    """What a rollout's REPL finds in its working directory.

    Attributes:
        source: ``"context_dir"``, ``"info.context"`` or ``"row.context"`` (where the files came from).
        directory: the host folder copied in (``source == "context_dir"``), else ``None``.
        name: ``"context.txt"`` or ``"context.json"`` (a single file), else ``None``.
        text: that file's content, else ``None``.
    """

    source: str
    directory: str | None = None
    name: str | None = None
    text: str | None = None


def _single(value: Any, source: str) -> ContextFiles:
    if isinstance(value, str):
        return ContextFiles(source, name="context.txt", text=value)
    try:
        text = json.dumps(value, ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source} must be a str or JSON-serializable: {exc}") from exc
    return ContextFiles(source, name="context.json", text=text)


def context_files(row: DatasetRow) -> ContextFiles:
    """The files of ``row``'s REPL: ``info["context_dir"]`` (a folder path, when truthy), else
    ``info["context"]`` (when present and not ``None``), else the row's ``context``.

    Raises:
        ValueError: the chosen value is neither a str nor JSON-serializable (NaN included).
    """
    folder = row.info.get("context_dir")
    if folder:
        return ContextFiles("context_dir", directory=os.fspath(str(folder)))
    if row.info.get("context") is not None:
        return _single(row.info["context"], "info.context")
    return _single(row.context, "row.context")


def file_name(row: DatasetRow) -> str | None:
    """The one context file :func:`context_files` writes for ``row`` (``context.txt`` or
    ``context.json``), without encoding it; ``None`` for a ``context_dir``."""
    if row.info.get("context_dir"):
        return None
    value = row.info["context"] if row.info.get("context") is not None else row.context
    return "context.txt" if isinstance(value, str) else "context.json"


def repl_context(row: DatasetRow) -> Any:
    """The REPL's ``context`` variable: the row's ``context``; a row whose ``context`` is ``""``
    and whose ``info`` has a ``context`` (the reference's place for it) gets that one."""
    if row.context == "" and row.info.get("context") is not None:
        return row.info["context"]
    return row.context


def _check_dir(src: str, limit: int, max_entries: int) -> int:
    """The reference's checks of a ``context_dir``; returns the bytes of its files.

    Raises:
        ValueError: not a folder, a symlink (itself or anything under it), over ``limit`` bytes,
            or more than ``max_entries`` files and folders (rlmq's: the scratch space's inodes).
    """
    if os.path.islink(src):
        raise ValueError(f"context_dir cannot be a symlink: {src}")
    if not os.path.isdir(src):
        raise ValueError(f"context_dir must be a directory: {src}")
    total = entries = 0
    for root, dirs, names in os.walk(src, followlinks=False):
        entries += len(dirs) + len(names)
        if entries > max_entries:
            raise ValueError(f"context_dir has more than {max_entries} files and folders: {src}")
        for name in (*dirs, *names):
            path = os.path.join(root, name)
            if os.path.islink(path):
                raise ValueError(f"context_dir contains a symlink, which is not allowed: {path}")
        for name in names:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                continue
    if total > limit:
        raise ValueError(f"context_dir exceeds the size limit: {total} bytes > {limit} bytes")
    return total


def prepare_files(files: ContextFiles, dest: str, scratch_bytes: int) -> int:
    """Write ``files`` into ``dest`` (a new folder, the producer's own), readable by every uid.

    Args:
        files: what to write (:func:`context_files`).
        dest: a folder path that does not exist yet.
        scratch_bytes: the REPL's scratch space (bytes); the files must fit in it, with room
            to spare (a tenth of it), as the REPL copies them there.

    Returns:
        Bytes written.

    Raises:
        ValueError: a ``context_dir`` the reference refuses, or files that do not fit the
            scratch space.
    """
    room = scratch_bytes - scratch_bytes // 10
    if files.directory is not None:
        inodes = max(1024, scratch_bytes // 4096) - 64  # as the REPL's tmpfs is made, less its own few
        total = _check_dir(files.directory, min(CONTEXT_DIR_MAX_BYTES, room), inodes)
        # symlinks=True: a link that appeared since the check is copied as a link, never followed
        shutil.copytree(files.directory, dest, symlinks=True, copy_function=shutil.copyfile)
    else:
        assert files.name is not None and files.text is not None
        data = files.text.encode("utf-8")
        total = len(data)
        if total > room:
            raise ValueError(f"{files.name} is {total} bytes; the REPL's scratch space holds {room}")
        os.mkdir(dest, 0o755)
        fd = os.open(os.path.join(dest, files.name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with open(fd, "wb") as f:
            f.write(data)
    for root, _dirs, names in os.walk(dest):
        os.chmod(root, 0o755)
        for name in names:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o644)
    return total


def retain_working_directory(pid: int, private_fs: bool, workdir: str, home: str) -> tuple[str, list[str]]:
    """Copy a running REPL's working directory out of its sandbox (``retain_filesystem_after_rollout``).

    Args:
        pid: the REPL child's process id (its mount namespace is read through ``/proc/<pid>/root``).
        private_fs: whether it has a private file system (then ``home`` is a path inside it).
        workdir: the REPL's host folder (without a private file system, ``<workdir>/home`` is it).
        home: the working directory's path inside the sandbox.

    Returns:
        ``(the new host folder holding the copy, what was not copied)``: links are copied as
        links, never followed; pipes, sockets and unreadable files are left out and named.
    """
    src = os.path.join(f"/proc/{pid}/root", home.lstrip("/")) if private_fs else os.path.join(workdir, "home")
    dest = tempfile.mkdtemp(prefix="rlmq-files-")
    skipped: list[str] = []
    if os.path.islink(src):  # the cell swapped its working directory for a link: never followed
        return dest, [f"{home}: a symlink"]
    try:
        shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True, copy_function=shutil.copyfile)
    except shutil.Error as exc:  # the rest was copied; these were not
        skipped = [str(item[0]) for item in exc.args[0]]
    except OSError as exc:
        skipped = [f"{src}: {exc}"]
    return dest, skipped
