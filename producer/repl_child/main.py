"""The REPL child's start-up and its loop: contain, drop privileges, limit, then run cells.

See the package's docstring for the protocol with the parent.
"""

from __future__ import annotations

import builtins
import json
import os
import sys
import types
from typing import Any, BinaryIO

from .cells import CellRunner, write_history
from .containment import contain
from .endpoint import make_llm_batch, make_rlm_batch, make_root_tool
from .helper import bash_runner, command, helper_env, load_bash, probe_helper
from .privileges import apply_limits, copy_files, drop_privileges, hand_over, host_home, own_uid, share_read_only
from .process import _Channel, close_other_descriptors, die_with_the_producer, stdio
from .seccomp import forbid_user_namespaces
from .shared import HOME

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """The child's program: ``argv`` is ``[program, cmd_fd, reply_fd]``, or a bash cell's command
    (``[program, "--command", NAME, ARGS...]``), or the check that such a command can start
    (``[program, "--probe"]``). Returns the exit status."""
    if len(argv) > 2 and argv[1] == "--command":
        return command(argv[2:])
    if argv[1:] == ["--probe"]:  # the child's check that its bash commands can start (see probe_helper)
        load_bash()
        print("ok")
        return 0
    cmd_fd, reply_fd = int(argv[1]), int(argv[2])
    close_other_descriptors((cmd_fd, reply_fd))  # first: before anything else runs here
    for fd in (cmd_fd, reply_fd):
        os.set_inheritable(fd, False)  # not leaked to processes the cell starts
    commands = open(cmd_fd, "rb")  # noqa: SIM115
    channel = _Channel(reply_fd)

    line = commands.readline()
    if not line:
        return 0
    init = json.loads(line)
    bash = load_bash() if init.get("language") == "bash" else None  # before the privileges go
    uid, contained, paths = _settle(init, cmd_fd, bash is not None)
    runner, home = _runner(init, paths, bash)
    del init  # the token: out of this frame's sight, which a cell can walk to

    channel.send({"type": "ready", "pid": os.getpid(), "uid": uid, **contained})
    return _serve(commands, channel, runner, home)


def _settle(init: dict[str, Any], cmd_fd: int, bash: bool) -> tuple[int | None, dict[str, Any], dict[str, Any]]:
    """Contain this process, give it its own uid and limits (in that order), and, for a ``bash``
    REPL, check that its commands can start. Returns (the uid or ``None``, the containment
    report less its paths, the paths as seen from inside)."""
    uid = own_uid(init.get("run_as"))
    share_read_only(uid, init["workdir"])  # context and packages: readable, never writable
    if init.get("unix_socket"):  # the rollout's own socket: no other REPL's uid may connect to it
        try:
            share_read_only(uid, os.path.dirname(init["unix_socket"]))
        except OSError:
            pass  # no such folder: llm_batch will say it cannot reach the service
    contained = contain(init)
    paths: dict[str, Any] = contained.pop("paths")
    if contained["fs_private"]:
        hand_over(uid, (HOME,))
    else:
        host_home(init["workdir"], uid)
    drop_privileges(uid)
    if paths["files_dir"]:  # as its own uid, into its own (private) working directory
        copy_files(paths["files_dir"], os.getcwd())
    refuse_shared_memory = bool(init.get("refuse_shared_memory"))
    contained["no_user_namespaces"] = forbid_user_namespaces(refuse_shared_memory)
    contained["shared_memory_refused"] = refuse_shared_memory and contained["no_user_namespaces"]
    die_with_the_producer(cmd_fd, uid is not None)
    apply_limits(
        init.get("cpu_seconds"),
        init.get("memory_bytes"),
        init.get("max_processes"),
        uid is not None,
        init.get("scratch_bytes"),
        init.get("max_open_files"),
    )
    if bash:  # as a cell's command will run: after containment, privileges and limits
        contained["helper_error"] = probe_helper(helper_env(init, paths["unix_socket"]))
    for path in reversed(paths["sys_path"]):
        sys.path.insert(0, path)
    return uid, contained, paths


def _runner(init: dict[str, Any], paths: dict[str, Any], bash: types.ModuleType | None) -> tuple[Any, str]:
    """The cell runner (Python, or ``bash``'s) over this process's fd 1 and 2, and the working
    directory the context files are in (``.messages`` goes there too)."""
    out, err = stdio(1), stdio(2)
    sys.stdout = sys.__stdout__ = out  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = err  # type: ignore[misc]
    sys.argv = [""]
    sys.dont_write_bytecode = True  # -I ignores PYTHONDONTWRITEBYTECODE
    main_module = _main_module(init, paths)
    sys.modules["__main__"] = main_module
    max_answer = int(init.get("max_answer_length", 1_000_000))
    if bash is not None:
        return bash_runner(bash, init, paths["unix_socket"], err, max_answer), os.getcwd()
    reference = init.get("output_format") == "reference"
    return CellRunner(main_module.__dict__, out, err, max_answer, reference), os.getcwd()


def _main_module(init: dict[str, Any], paths: dict[str, Any]) -> types.ModuleType:
    """The cells' fresh ``__main__`` module, so objects they define pickle normally
    (multiprocessing) and this program's own names stay out of their sight: ``context`` (from
    the JSON file), ``llm_batch``, ``rlm_batch``, ``answer`` and the root tools."""
    with open(paths["context_path"], encoding="utf-8") as f:
        context = json.load(f)
    batch = (float(init["llm_batch_timeout"]), paths["unix_socket"], int(init["max_batch_bytes"]),
             int(init["max_batch_prompts"]))  # fmt: skip
    module = types.ModuleType("__main__")
    module.__dict__.update(
        {
            "__builtins__": builtins,
            "context": context,
            "llm_batch": make_llm_batch(init["url"], init["token"], *batch),
            "rlm_batch": make_rlm_batch(init["url"], init["token"], *batch),
            "answer": {"content": "", "ready": False},
        }
    )
    for spec in init.get("tools") or []:  # root tools: run in the producer, reached like llm_batch
        module.__dict__[str(spec["name"])] = make_root_tool(
            spec,
            init["url"],
            init["token"],
            # the producer times the tool (and the wait for the rollout's call before it); a backstop
            2 * float(init.get("tool_timeout") or 60.0) + 30.0,
            paths["unix_socket"],
            int(init.get("max_tool_bytes") or 1024 * 1024),
        )
    if init.get("sub_llms") is False:  # enable_sub_llms off: no sub-LLMs to call
        del module.__dict__["llm_batch"], module.__dict__["rlm_batch"]
    return module


def _serve(commands: BinaryIO, channel: _Channel, runner: Any, home: str) -> int:
    """Run each ``exec`` command's cell (writing its ``history`` to ``<home>/.messages`` first)
    and send its result, until EOF on the command pipe; returns 0."""
    while True:
        line = commands.readline()
        if not line:
            return 0
        message = json.loads(line)
        if message.get("op") == "exec":
            if isinstance(message.get("history"), str):
                write_history(home, message["history"])
            channel.send(runner.run(message["code"]))
