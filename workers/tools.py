"""Sub-tools: Python functions a sub-LLM may call during its tool loop, allow-listed per worker.

A worker is started with ``allowed_sub_tools`` (``Settings.allowed_sub_tools``), a list of
dotted import paths, ``pkg.mod:func`` or ``pkg.mod.func``. A job names the tools it wants
in ``SubLLMRequest.sub_tools`` (dotted paths too); a job asking for a tool outside the
worker's allow-list fails with a payload error before the model is called, unless the job's
rollout hosts it (``SubLLMRequest.hosted_tools``): then the call is sent to the rollout's
process (:mod:`rlmq.workers.hosted_tools`).

Schemas, validation and guarded calls are :class:`~rlmq.common.tool_registry.ToolRegistry`'s
(re-exported here).

Two small example tools live here, for the README and the tests (not offered unless
allow-listed): :func:`count_words` and :func:`grep`, i.e.
``--allowed-sub-tools workers.tools.count_words,workers.tools.grep``.
"""

from __future__ import annotations

import re

from rlmq.common.tool_registry import ToolRegistry

__all__ = ["ToolRegistry", "count_words", "grep"]


# --------------------------------------------------------------------------- example tools


def count_words(text: str) -> int:
    """Count the words (whitespace-separated) in a text.

    Args:
        text: the text to count.
    """
    return len(text.split())


def grep(text: str, pattern: str, max_lines: int = 20) -> str:
    """Find the lines of a text that match a regular expression (Python syntax).

    Args:
        text: the text to search, line by line.
        pattern: the regular expression; a line matches if the pattern occurs anywhere in it.
        max_lines: at most this many matching lines are returned, as "line_number: line".
    """
    if len(pattern) > 1000:
        raise ValueError("pattern longer than 1000 characters")
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"bad regular expression: {exc}") from None
    hits = [(i, line) for i, line in enumerate(text.splitlines(), 1) if regex.search(line)]
    if not hits:
        return "(no matching lines)"
    shown = [f"{i}: {line}" for i, line in hits[: max(0, max_lines)]]
    if len(hits) > len(shown):
        shown.append(f"... ({len(hits) - len(shown)} more matching lines)")
    return "\n".join(shown)
