"""The ``rlmq`` taskset: rlmq's dataset rows as verifiers v1 tasks, with an exact-match reward.

A row is ``{"id", "question", "context", "answer"?, "info"?}`` (``shared/DESIGN.md``). The
task's prompt is the question, verbatim; ``context`` rides on the task data for the ``rlmq``
harness, which puts it in the REPL. Without ``--env.taskset.path`` the taskset is the
``rlmq demo`` set: needle-in-a-haystack rows over CPython's documentation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import verifiers.v1 as vf
from pydantic import Field
from verifiers.v1.runtimes import SubprocessConfig

from rlmq import DatasetRow, read_dataset
from rlmq.verifiers_plugin.adapter import exact_match
from rlmq.verifiers_plugin.harness import RlmqHarnessConfig

__all__ = ["RlmqEnv", "RlmqEnvConfig", "RlmqTask", "RlmqTaskData", "RlmqTaskset", "RlmqTasksetConfig"]


class RlmqTaskData(vf.TaskData):
    """One dataset row: ``prompt`` is the question; ``context`` the long input (any JSON)."""

    context: str | list[Any] | dict[str, Any] = ""
    answer: str | None = None
    info: dict[str, Any] = Field(default_factory=dict)


class RlmqTask(vf.Task[RlmqTaskData]):
    """A row's task: one reward, ``exact_match``."""

    @property
    def key(self) -> str:
        """The row's ``id`` (durable across runs; ids are unique within a dataset)."""
        key: str = self.data.id or self.hash
        return key

    @vf.reward(weight=1.0)
    async def exact_match(self, trace: vf.Trace) -> float:
        """1.0 when the final answer (``trace.last_reply``: rlmq's ``answer["content"]`` under
        the ``rlmq`` harness) equals the row's ``answer`` after case, whitespace and outer
        punctuation are normalised, else 0.0 (also when the row has no answer)."""
        return exact_match(trace.last_reply, self.data.answer)


class RlmqTasksetConfig(vf.TasksetConfig):
    """``--env.taskset.*``: which rows load."""

    path: Path | None = None
    """JSONL file of rows; ``None``: the demo's needle-in-a-haystack rows."""
    demo_rows: int = Field(8, ge=1)
    """Rows generated when no ``path`` is given."""
    demo_min_chars: int = Field(100_000, ge=1_000)
    """Characters of context per demo row (at least)."""


def task_of(row: DatasetRow, config: vf.TaskConfig | None = None) -> RlmqTask:
    """The task of one dataset row."""
    data = RlmqTaskData(id=row.id, prompt=row.question, context=row.context, answer=row.answer, info=row.info)
    return RlmqTask(data, config)


class RlmqTaskset(vf.Taskset[RlmqTask, RlmqTasksetConfig]):
    """rlmq's dataset rows (``--env.taskset.path rows.jsonl``) or the demo's rows."""

    def load(self) -> list[RlmqTask]:
        """Read the rows.

        Raises:
            PayloadError: a line of the file is not a dataset row.
            OSError: the file cannot be read.
        """
        if self.config.path is not None:
            rows = read_dataset(str(self.config.path))
        else:
            from rlmq.cli.demo import needle_rows

            rows = [
                DatasetRow.model_validate(r)
                for r in needle_rows(self.config.demo_rows, min_chars=self.config.demo_min_chars)
            ]
        return [task_of(row, self.config.task) for row in rows]


class RlmqEnvConfig(vf.SingleAgentEnvConfig):
    """The ``rlmq`` taskset's env: one ``agent`` seat, as a plain run, whose runtime defaults
    to ``subprocess``. The ``rlmq`` harness runs in-process and uses no runtime, so a remote
    sandbox (verifiers' default, ``prime``) would only cost a tunnel and an account."""

    agent: vf.AgentConfig = vf.AgentConfig(harness=RlmqHarnessConfig(), runtime=SubprocessConfig())


class RlmqEnv(vf.SingleAgentEnv, vf.Env[RlmqEnvConfig]):
    """``SingleAgentEnv`` with :class:`RlmqEnvConfig`'s defaults (``vf-eval rlmq`` needs no
    runtime flag; ``--env.agent.runtime.type`` still overrides it)."""
