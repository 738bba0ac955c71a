"""The REPL child: a standalone, stdlib-only program that runs model-written cells.

Started by :class:`rlmq.producer.repl.Repl` as::

    python -I <this folder>/__main__.py <cmd_fd> <reply_fd>

It must not import rlmq nor any third-party package: it runs model-written code, may run under
another interpreter than the producer's, and only needs the standard library. ``__main__.py``
loads this folder as a package of its own name; its modules import one another relatively and
nothing else of rlmq (``tests/unit/test_layout.py`` holds both rules). The producer imports
only what it shares with the child (:mod:`.shared`, re-exported here).

Modules, by concern:

- :mod:`.main`: the start-up (contain, drop privileges, limit) and the loop over commands.
- :mod:`.containment`: namespaces, the private scratch file system, host paths carried in;
  :mod:`.seccomp`: the seccomp filter; :mod:`.privileges`: the REPL's own uid, its folders and
  resource limits; :mod:`.process`: the reply pipe, stdio, descriptors, dying with the producer.
- :mod:`.endpoint`: the globals that reach the rollout's endpoint (``llm_batch``,
  ``rlm_batch``, root tools).
- :mod:`.cells`: the Python cell runner.
- :mod:`.bash`: the bash cell runner; :mod:`.helper`: its cells' commands, a helper process
  running this package again.

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
   ``language`` ``"bash"``: cells are bash (:mod:`.bash`), whose ``llm_batch``, ``rlm_batch``
   and root tools run this program as a helper, ``python -I -S __main__.py --command NAME
   ARGS...``, with the endpoint in its ``RLMQ_*`` environment (:mod:`.helper`).

   ``llm_batch`` posts ``{"prompts"}`` to ``url``; ``rlm_batch`` posts ``{"tasks": [{"prompt",
   "context"}, ...]}`` to ``<url's folder>/rlm_batch`` (child rollouts), both with
   the same limits (``max_batch_prompts`` items, ``max_batch_bytes`` bytes of JSON).

   Each of ``tools`` becomes a REPL global of its name (a root tool), which posts
   ``{"name", "args", "kwargs"}`` to ``<url's folder>/root_tool`` and returns the result
   or raises ``RuntimeError`` with the producer's message.

   The child contains itself (:func:`.containment.contain`: namespaces, private scratch space),
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

from .shared import HOME, PROGRAM, UID_BASE, reachable_by_others

__all__ = ["HOME", "PROGRAM", "UID_BASE", "reachable_by_others"]
