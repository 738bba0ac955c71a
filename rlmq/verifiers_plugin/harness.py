"""The ``rlmq`` harness: rlmq's RLM rollout run in-process by a verifiers v1 agent.

verifiers' ``Harness.launch`` contract (``verifiers/v1/harness.py``, 0.4.0): "a harness may
run its loop in-process instead of launching a program, as long as every model call goes
through ``endpoint`` + ``secret``". Here the root model's calls go to ``endpoint`` with
``secret`` (so verifiers records them in the trace and trains on them); the sub-LLM calls
go through rlmq's queues to the worker fleet, under rlmq's hard token budget, and are not
part of the trace's message graph. The REPL runs on the host running the harness, in rlmq's
own sandbox, whatever verifiers runtime the agent is given (the runtime is not used).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import verifiers.v1 as vf
from pydantic import Field, SecretStr
from verifiers.v1.types import ID

from rlmq.common.schemas import DatasetRow
from rlmq.verifiers_plugin.adapter import STOP_CONDITIONS, RolloutKnobs, rollout_id_for, run_rollout

__all__ = ["RlmqHarness", "RlmqHarnessConfig", "dataset_row", "trace_events"]


class RlmqHarnessConfig(vf.HarnessConfig):
    """The ``rlmq`` harness's knobs, under ``--env.agent.harness.*``.

    Unset values fall back to rlmq's settings path (``RLMQ_*`` environment variables, then
    rlmq's defaults), the same as for ``rlmq run``.
    """

    id: ID = "rlmq"
    """The plug-in id (verifiers' base default is ``bash``)."""
    redis_url: SecretStr | None = None
    """Redis of the fleet; ``None``: ``RLMQ_REDIS_URL`` or ``REDIS_URL``. A secret: the saved
    config and the traces show ``**********`` (so a run re-read from its saved config needs
    the environment variable)."""
    sub_model: str | None = None
    """Model the workers serve (names the queue); ``None``: the run's model."""
    queue: str | None = None
    """RQ queue of the sub-LLM calls; ``None``: derived from the sub-model, as on the workers."""
    tenant: str | None = None
    """Fair-share tenant (``<queue>@<tenant>``); ``None``: this host's name."""
    max_turns: int = Field(50, ge=1)
    """Root-model turns per rollout (rlmq's own limit; ``--env.agent.max-turns`` also applies)."""
    sub_llm_max_turns: int = Field(5, ge=1)
    sub_llm_max_completion_tokens: int | None = Field(None, ge=0)
    """The rollout's sub-LLM budget in completion tokens, a hard limit across the fleet."""
    sub_llm_per_call_max_tokens: int | None = Field(None, ge=1)
    root_max_completion_tokens: int | None = Field(None, ge=1)
    max_sub_llm_parallelism: int = Field(64, ge=1)
    max_output_length: int = Field(8192, ge=100)
    code_execution_timeout: float = Field(120.0, gt=0)
    max_startup_wait_seconds: float = Field(120.0, gt=0)
    sub_call_timeout: float | None = Field(None, gt=0)
    """Seconds from enqueue to the result of one sub-call; ``None``: rlmq's default (300)."""
    sub_tools: list[str] = Field(default_factory=list)
    root_prompt_verbosity: Literal["light", "medium", "heavy"] = "light"
    sub_prompt_verbosity: Literal["light", "medium", "heavy"] = "light"
    include_trajectory: bool = True
    """Copy rlmq's events (root turns, REPL cells, ``llm_batch`` results) into
    ``trace.info["rlmq"]["trajectory"]``, each sub-LLM prompt cut to ``trajectory_prompt_chars``
    characters (they are slices of ``context``, which the trace already holds in full)."""
    trajectory_prompt_chars: int = Field(500, ge=0)

    def knobs(self, sub_model: str) -> RolloutKnobs:
        """The rlmq settings and ``RLMEnv`` arguments these knobs stand for."""
        return RolloutKnobs(
            settings={
                "redis_url": self.redis_url.get_secret_value() if self.redis_url is not None else None,
                "queue": self.queue,
                "tenant": self.tenant,
                "sub_call_timeout": self.sub_call_timeout,
            },
            env_args={
                "max_turns": self.max_turns,
                "sub_llm_max_turns": self.sub_llm_max_turns,
                "sub_llm_max_completion_tokens": self.sub_llm_max_completion_tokens,
                "sub_llm_per_call_max_tokens": self.sub_llm_per_call_max_tokens,
                "root_max_completion_tokens": self.root_max_completion_tokens,
                "max_sub_llm_parallelism": self.max_sub_llm_parallelism,
                "sub_model": sub_model,
                "sub_tools": list(self.sub_tools),
                "max_output_length": self.max_output_length,
                "code_execution_timeout": self.code_execution_timeout,
                "max_startup_wait_seconds": self.max_startup_wait_seconds,
                "root_prompt_verbosity": self.root_prompt_verbosity,
                "sub_prompt_verbosity": self.sub_prompt_verbosity,
            },
        )


def dataset_row(data: vf.TaskData, question: str) -> DatasetRow:
    """The rlmq dataset row of a verifiers task: ``context`` / ``answer`` / ``info`` fields
    when the task data has them (the ``rlmq`` taskset's do), else an empty context, so the
    harness also runs other tasksets' text prompts."""
    extra: dict[str, Any] = data.model_dump(include={"context", "answer", "info"}, exclude_none=True)
    extra.update({k: v for k, v in (data.model_extra or {}).items() if k in ("context", "answer", "info")})
    ident = data.id if data.id is not None else (str(data.idx) if data.idx is not None else "task")
    return DatasetRow(
        id=ident,
        question=question,
        context=extra.get("context", ""),
        **{k: v for k, v in extra.items() if k in ("answer", "info")},
    )


def trace_events(trajectory: list[dict[str, Any]], prompt_chars: int) -> list[dict[str, Any]]:
    """rlmq's trajectory as JSON for ``trace.info``: ``llm_batch`` prompts longer than
    ``prompt_chars`` characters are cut, with a marker saying how long they were."""
    events: list[dict[str, Any]] = json.loads(json.dumps(trajectory, default=str))
    for event in events:
        if event.get("type") == "llm_batch":
            event["prompts"] = [
                p if len(p) <= prompt_chars else f"{p[:prompt_chars]}[... {len(p)} characters in all]"
                for p in event.get("prompts", [])
            ]
    return events


class RlmqHarness(vf.Harness[RlmqHarnessConfig]):
    """rlmq's RLM loop, in-process: root calls through verifiers' interception, sub-calls on
    the rlmq fleet. Returns a synthetic ``ProgramResult`` (exit 0, or 1 with the error)."""

    NEEDS_CONTAINER = False  # nothing is installed or run in the runtime
    EXECUTES_CODE = False
    """Model-written code does run, but never in the verifiers runtime: in rlmq's own REPL
    sandbox on the host running the harness (``shared/DESIGN.md``, invariant 4). So
    verifiers' "code runs in the subprocess runtime on the local system" warning does not
    apply, and a container runtime would not isolate anything more."""

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
    ) -> vf.ProgramResult:
        """Run one rlmq rollout of ``data`` and record it on ``trace``.

        The rollout id is ``trace.id`` (one per attempt; see :func:`rollout_id_for`), which the sub-calls carry as their
        ``X-Session-ID``, the value verifiers sends on the root calls. Metrics (``sub_llm_*``,
        ``main_rlm_*``, ``repl_*``, the budget figures) go to ``trace.metrics``; the final
        answer to ``trace.root_reply``; rlmq's stop reason to ``trace.stop_condition``
        (``max_turns`` and ``no_tool_call`` as named; ``answer_ready`` leaves verifiers'
        ``agent_completed``; ``error`` is a failed program, exit code 1).

        Raises:
            ValueError: the task's prompt is a list of messages (rlmq needs one question).
            ConfigError: rlmq settings are invalid or no Redis URL is set.
        """
        _system, prompt = self.resolve_text_prompt(data)
        row = dataset_row(data, prompt or "")
        rollout_id = rollout_id_for(trace.id)
        outcome = await run_rollout(
            row,
            model=ctx.model,
            base_url=endpoint,
            api_key=secret,
            rollout_id=rollout_id,
            knobs=self.config.knobs(self.config.sub_model or ctx.model),
        )
        result = outcome.row
        trace.record_metrics(outcome.metrics)
        info: dict[str, Any] = {
            "rollout_id": rollout_id,
            "stop_reason": result.stop_reason,
            "final_answer": result.final_answer,
        }
        if self.config.include_trajectory:
            info["trajectory"] = trace_events(outcome.trajectory, self.config.trajectory_prompt_chars)
        trace.info["rlmq"] = info
        if result.final_answer is not None:
            trace.root_reply = result.final_answer
        if result.stop_reason == "error":
            return vf.ProgramResult(exit_code=1, stdout="", stderr=f"rlmq rollout failed: {result.error}")
        condition = STOP_CONDITIONS.get(result.stop_reason)
        if condition is not None:
            trace.stop(condition)
        return vf.ProgramResult(exit_code=0, stdout=result.final_answer or "", stderr="")
