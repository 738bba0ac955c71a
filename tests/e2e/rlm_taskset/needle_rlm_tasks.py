"""A verifiers 0.4 Taskset written for the ``rlm`` harness (nano-rlm), with its own scorer.

The test's stand-in for an author's taskset: needle rows, the task's system prompt, a reward of
its own (``passphrase_found``, read from the agent's last reply) and a metric. Its TOML
(``needle_rlm.toml`` beside it) names ``harness.id = "rlm"`` with the ``rlm`` harness's keys; the
test runs it with that one id changed to ``rlmq``. The long context rides on the task data as
``context`` (the ``rlmq`` harness puts it in the REPL).
"""

from __future__ import annotations

import json
from pathlib import Path

import verifiers.v1 as vf

__all__ = ["NeedleData", "NeedleTask", "NeedleTaskset", "NeedleTasksetConfig"]

SYSTEM_PROMPT = "You are a careful archivist. [[taskset-system-prompt]]"


class NeedleData(vf.TaskData):
    """One row: the question as the prompt, the haystack, the passphrase."""

    context: str = ""
    passphrase: str = ""


class NeedleTask(vf.Task[NeedleData]):
    """Scored by the taskset itself."""

    @vf.reward(weight=1.0)
    async def passphrase_found(self, trace: vf.Trace) -> float:
        """1.0 when the agent's last reply is the passphrase (case and outer whitespace aside)."""
        reply = (trace.last_reply or "").strip().strip(".").lower()
        return 1.0 if reply == self.data.passphrase.lower() else 0.0

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        """Characters of the last reply."""
        return float(len(trace.last_reply or ""))


class NeedleTasksetConfig(vf.TasksetConfig):
    """``[env.taskset]``: the rows file."""

    path: str = ""


class NeedleTaskset(vf.Taskset[NeedleTask, NeedleTasksetConfig]):
    """Needle rows of a JSONL file (``id``, ``question``, ``context``, ``answer``)."""

    def load(self) -> list[NeedleTask]:
        rows = [json.loads(line) for line in Path(self.config.path).read_text().splitlines() if line.strip()]
        return [
            NeedleTask(
                NeedleData(
                    id=row["id"],
                    prompt=row["question"],
                    system_prompt=SYSTEM_PROMPT,
                    context=row["context"],
                    passphrase=row["answer"],
                ),
                self.config.task,
            )
            for row in rows
        ]
