"""The keys of verifiers' ``rlm`` harness (nano-rlm), accepted by the ``rlmq`` harness.

A Taskset written for ``harness.id = "rlm"`` moves to ``harness.id = "rlmq"`` with its other
harness keys unchanged. Each key of ``RLMHarnessConfig`` (verifiers 0.4.0,
``verifiers/v1/harnesses/rlm/harness.py``) either maps onto an rlmq setting with its meaning
(:data:`MAPPED`), or has no counterpart here and is logged once, in one line, when set
(:data:`IGNORED`). This module imports nothing from verifiers.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, Field

from rlmq import MAX_DEPTH

__all__ = ["IGNORED", "MAPPED", "RlmHarnessKeys", "log_ignored", "rlm_settings"]

log = logging.getLogger("rlmq.verifiers")

MAPPED: dict[str, str] = {
    "max_depth": "max_depth: levels of child rollouts below the root (0: none); rlmq's own max_depth counts "
    "the root as level 1, so it is this + 1",
    "max_total_tokens": "sub_llm_max_completion_tokens: a hard budget on the completion tokens of every call "
    "below the root, tree-wide, reserved before generation (0: no budget)",
    "max_total_turns": "max_turns: the root model's turns",
    "max_concurrent_subagents": "max_sub_llm_parallelism: sub-calls of one rollout queued or running at once",
    "exec_timeout": "code_execution_timeout: seconds a REPL cell may run",
    "max_tool_output_bytes": "max_output_length: characters of a cell's output shown to the root model",
    "append_to_system_prompt": "system_prompt with system_prompt_mode append: after rlmq's scaffold, after "
    "the taskset's system prompt",
}
"""rlm key -> the rlmq setting it sets, and what it means here."""

IGNORED: dict[str, str] = {
    "version": "no nano-rlm is installed: the rlmq harness runs its own loop in-process",
    "max_subagent_calls": "rlmq has no tree-wide cap on the number of calls; the hard token budget "
    "(max_total_tokens) bounds them",
    "builtin_skills": "the root model has one tool, the REPL; nano-rlm's skills are not there",
    "builtin_tools": "the root model has one tool, the REPL; nano-rlm's native tools are not there",
    "compaction": "rlmq does not compact the root model's context; a prompt too long ends the rollout as "
    "prompt_too_long",
    "delegation_prompt": "rlmq's scaffold always explains rlm_batch where a child level exists",
    "allow_git": "the REPL sandbox has no git history policy of its own",
    "subagent_append_to_system_prompt": "child rollouts get rlmq's scaffold only",
    "leaf_append_to_system_prompt": "child rollouts get rlmq's scaffold only",
}
"""rlm key -> why it has no effect under the ``rlmq`` harness (logged once when the key is set)."""


class RlmHarnessKeys(BaseModel):
    """The ``rlm`` harness's keys, every one optional (``None``: not given). Their types and
    bounds are the ``rlm`` harness's own; what each means here is in :data:`MAPPED` /
    :data:`IGNORED`."""

    max_depth: int | None = Field(
        default=None, ge=0, le=MAX_DEPTH - 1, description="rlm meaning: " + MAPPED["max_depth"]
    )
    max_total_tokens: int | None = Field(default=None, ge=0, description=MAPPED["max_total_tokens"])
    max_total_turns: int | None = Field(default=None, ge=1, description=MAPPED["max_total_turns"])
    max_concurrent_subagents: int | None = Field(default=None, ge=1, description=MAPPED["max_concurrent_subagents"])
    exec_timeout: int | None = Field(default=None, ge=1, description=MAPPED["exec_timeout"])
    max_tool_output_bytes: int | None = Field(default=None, ge=1, description=MAPPED["max_tool_output_bytes"])
    append_to_system_prompt: str | None = Field(default=None, description=MAPPED["append_to_system_prompt"])
    version: str | None = Field(default=None, description="ignored: " + IGNORED["version"])
    max_subagent_calls: int | None = Field(default=None, ge=1, description="ignored: " + IGNORED["max_subagent_calls"])
    builtin_skills: list[str] | None = Field(default=None, description="ignored: " + IGNORED["builtin_skills"])
    builtin_tools: list[str] | None = Field(default=None, description="ignored: " + IGNORED["builtin_tools"])
    compaction: dict[str, Any] | bool | None = Field(default=None, description="ignored: " + IGNORED["compaction"])
    delegation_prompt: bool | None = Field(default=None, description="ignored: " + IGNORED["delegation_prompt"])
    allow_git: bool | None = Field(default=None, description="ignored: " + IGNORED["allow_git"])
    subagent_append_to_system_prompt: str | None = Field(
        default=None, description="ignored: " + IGNORED["subagent_append_to_system_prompt"]
    )
    leaf_append_to_system_prompt: str | None = Field(
        default=None, description="ignored: " + IGNORED["leaf_append_to_system_prompt"]
    )


def rlm_settings(keys: RlmHarnessKeys, given: dict[str, Any], task_system_prompt: str | None = None) -> dict[str, Any]:
    """The rlmq settings that the ``rlm`` keys set, over ``given`` (the rlmq knobs given).

    Args:
        keys: the harness config (its ``rlm`` keys; ``None`` = not given).
        given: rlmq settings already given by their own names; an rlm key and the rlmq knob it
            maps onto must not both be given.
        task_system_prompt: the taskset's system prompt, which goes before
            ``append_to_system_prompt`` (as the ``rlm`` harness orders them).

    Returns:
        ``given`` with the mapped settings added.

    Raises:
        ValueError: an rlm key and the rlmq knob it maps onto are both given.
    """
    out = dict(given)
    mapped: dict[str, Any] = {}
    if keys.max_depth is not None:
        mapped["max_depth"] = keys.max_depth + 1
    if keys.max_total_tokens is not None:
        mapped["sub_llm_max_completion_tokens"] = keys.max_total_tokens or None
    for key, setting in (
        ("max_total_turns", "max_turns"),
        ("max_concurrent_subagents", "max_sub_llm_parallelism"),
        ("exec_timeout", "code_execution_timeout"),
        ("max_tool_output_bytes", "max_output_length"),
    ):
        if getattr(keys, key) is not None:
            mapped[setting] = getattr(keys, key)
    for setting in mapped:
        if setting in given:
            raise ValueError(f"give either the rlm key or the rlmq knob {setting!r}, not both")
    out.update(mapped)
    appends = [t for t in (given.get("system_prompt"), task_system_prompt, keys.append_to_system_prompt) if t]
    if appends and (task_system_prompt or keys.append_to_system_prompt):
        out["system_prompt"] = "\n\n".join(appends)
        out.setdefault("system_prompt_mode", "append")
    return out


_LOGGED: set[str] = set()
"""Lines already logged by this process (a config is validated more than once by vf-eval)."""


def log_ignored(keys: RlmHarnessKeys) -> list[str]:
    """Log one line per ``rlm`` key that is set but has no counterpart (once per process);
    return the lines for these keys."""
    lines = [
        f"rlmq harness: the rlm key {name!r} has no effect here: {why}"
        for name, why in IGNORED.items()
        if getattr(keys, name) is not None
    ]
    for line in lines:
        if line not in _LOGGED:
            _LOGGED.add(line)
            log.warning(line)
    return lines
