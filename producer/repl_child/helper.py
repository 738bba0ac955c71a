"""The glue between a bash REPL and the endpoint: its cells' commands (``llm_batch``,
``rlm_batch``, root tools) run this package again as a helper process,
``python -I -S __main__.py --command NAME ARGS...``, with the endpoint in their ``RLMQ_*``
environment; the child checks once, as a cell would, that they can start (``--probe``)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any, TextIO

from .cells import runner_note
from .containment import PACKAGE_DIR, helper_python
from .endpoint import make_llm_batch, make_rlm_batch, make_root_tool

__all__ = ["bash_runner", "command", "helper_env", "load_bash", "probe_helper"]

HELPER = os.path.join(PACKAGE_DIR, "__main__.py")
"""The program a bash cell's commands run, as the host (and the sandbox, which carries it) sees it."""


def load_bash() -> ModuleType:
    """The bash cell runner's module (:mod:`.bash`), imported on demand: only a bash REPL and its
    commands need it, and the child imports it before it drops its privileges."""
    return importlib.import_module(".bash", __package__)


_HELPER_ENV = ("RLMQ_URL", "RLMQ_TOKEN", "RLMQ_SOCKET", "RLMQ_BATCH_TIMEOUT", "RLMQ_MAX_BATCH_BYTES",
               "RLMQ_MAX_BATCH_PROMPTS", "RLMQ_TOOL_TIMEOUT", "RLMQ_MAX_TOOL_BYTES")  # fmt: skip


def helper_env(init: dict[str, Any], unix_socket: str | None) -> dict[str, str]:
    """What a bash cell's commands need to reach the rollout's endpoint (see :func:`command`)."""
    values = (init["url"], init["token"], unix_socket or "", init["llm_batch_timeout"], init["max_batch_bytes"],
              init["max_batch_prompts"], 2 * float(init.get("tool_timeout") or 60.0) + 30.0,
              init.get("max_tool_bytes") or 1024 * 1024)  # fmt: skip
    return {
        **dict(zip(_HELPER_ENV, map(str, values), strict=True)),
        "RLMQ_PYTHON": helper_python(),
        "RLMQ_HELPER": HELPER,
    }


def probe_helper(env: dict[str, str]) -> str | None:
    """Run a bash cell's command once as a cell would (this uid, these limits, this sandbox):
    ``None`` when it started and loaded :mod:`.bash`, else one line saying why not."""
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


def bash_runner(bash: Any, init: dict[str, Any], unix_socket: str | None, err: TextIO, max_answer: int) -> Any:
    """The bash cell runner (:class:`.bash.BashRunner`), its commands reaching the rollout's endpoint."""
    batches = ["llm_batch", "rlm_batch"] if init.get("sub_llms") is not False else []
    names = [*batches, *(str(t["name"]) for t in init.get("tools") or [])]
    env = {**os.environ, **helper_env(init, unix_socket)}
    return bash.BashRunner(os.getcwd(), env, names, max_answer, lambda text: runner_note(err, text))


def command(argv: list[str]) -> int:
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
            return make_llm_batch(url, token, *limits)
        if name == "rlm_batch":
            return make_rlm_batch(url, token, *limits)
        tool_limits = (float(env["RLMQ_TOOL_TIMEOUT"]), sock, int(env["RLMQ_MAX_TOOL_BYTES"]))
        return make_root_tool({"name": name}, url, token, *tool_limits)

    return int(load_bash().command(argv, make))
