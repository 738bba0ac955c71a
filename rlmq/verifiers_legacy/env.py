"""``RLMEnv`` for verifiers 0.1.14: the reference's constructor, rlmq's fleet underneath.

An environment module written for verifiers' own ``RLMEnv`` changes one line::

    from verifiers.envs.experimental.rlm_env import RLMEnv   # before
    from rlmq.verifiers_legacy import RLMEnv                 # after

and runs through ``env.evaluate(...)`` and ``vf-eval`` as before. The constructor takes every
argument of the reference (pull request #966 and verifiers 0.1.14, same defaults), and the
base ``Environment``'s (``dataset``, ``eval_dataset``, ``rubric``, ``parser``, ``max_seq_len``,
...) pass through. Each rollout is an rlmq rollout (:class:`rlmq.producer.env.RLMEnv`): the
root model's calls go through the client verifiers hands to ``rollout`` (so verifiers counts
them and records them in ``state["trajectory"]``), the sub-LLM calls run as jobs on the rlmq
worker fleet under the hard budget, and Redis is found through ``REDIS_URL`` (or
``RLMQ_REDIS_URL``), as by every rlmq entry point. What each argument means here:
``docs/verifiers-rlmenv.md`` ("The verifiers 0.1.14 module").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Literal

import verifiers as vf
from redis.exceptions import RedisError

from rlmq.common.errors import ConfigError, RlmqError
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import RolloutOptions
from rlmq.producer.env import RLMEnv as RlmqEnv
from rlmq.producer.root_tools import shared_tool_paths
from rlmq.verifiers_legacy.root_turns import CURRENT, RootDispatch, RootTurns
from rlmq.verifiers_legacy.state import LegacyMonitorRubric, fill_state

__all__ = ["RLMEnv", "SANDBOX_ARGUMENTS"]

log = logging.getLogger("rlmq.verifiers_legacy")

SANDBOX_ARGUMENTS: dict[str, str] = {
    "sandbox_timeout_minutes": "mapped: rollout_timeout = minutes x 60 (the rollout's wall-clock deadline)",
    "sandbox_docker_image": "no effect: the REPL runs in rlmq's own sandbox on the host, with its Python",
    "sandbox_cpu_cores": "no effect: rlmq's sandbox has fixed limits (docs/sandbox.md)",
    "sandbox_memory_gb": "no effect: rlmq's sandbox has fixed limits (docs/sandbox.md)",
    "sandbox_disk_size_gb": "no effect: rlmq's sandbox has fixed limits (docs/sandbox.md)",
    "sandbox_gpu_count": "no effect: the REPL has no GPU",
    "sandbox_environment_vars": "no effect: the REPL's environment is rlmq's own (no secrets reach it)",
    "sandbox_labels": "no effect: there is no Prime sandbox to label",
    "sandbox_client_max_workers": "no effect: there is no Prime sandbox client",
    "sandbox_client_max_connections": "no effect: there is no Prime sandbox client",
    "sandbox_client_max_keepalive_connections": "no effect: there is no Prime sandbox client",
    "sandbox_transfer_max_retries": "no effect: files are written locally, not uploaded",
}
"""The reference's ``sandbox_*`` arguments (a Prime sandbox per rollout) and what each does here;
one set to other than its default is logged once, in one line, at construction."""

_SANDBOX_DEFAULTS: dict[str, Any] = {
    "sandbox_docker_image": "python:3.11-slim", "sandbox_cpu_cores": 1, "sandbox_memory_gb": 2,
    "sandbox_disk_size_gb": 5, "sandbox_gpu_count": 0, "sandbox_timeout_minutes": 60,
    "sandbox_environment_vars": None, "sandbox_labels": None, "sandbox_client_max_workers": 50,
    "sandbox_client_max_connections": 100, "sandbox_client_max_keepalive_connections": 50,
    "sandbox_transfer_max_retries": 3,
}  # fmt: skip

Verbosity = Literal["light", "medium", "heavy"]


class RLMEnv(vf.Environment):
    """A verifiers 0.1.14 ``Environment`` with the reference ``RLMEnv``'s constructor (see the
    module docstring). Arguments not listed here go to ``vf.Environment`` (``dataset``,
    ``eval_dataset``, ``rubric``, ``parser``, ``max_seq_len``, ``sampling_args``, ...).

    Args (the reference's, same defaults; units as there):
        max_turns: root-model turns (50); ``<= 0``: no limit.
        tools: callables or ``pkg.mod:func`` paths for the REPL and the sub-LLMs (#966's
            meaning; 0.1.14 gave them to the root model as function-calling tools instead:
            here the root model has one tool, the REPL).
        root_tools / sub_tools: REPL-only / sub-LLM-only tools.
        sub_llm_max_turns: tool-calling turns of one sub-LLM call (5).
        sub_max_completion_tokens / sub_llm_max_completion_tokens: the sub-LLM completion-token
            budget of a rollout (0.1.14's / #966's name; give one, or both equal); hard here.
        root_max_completion_tokens: the root model's completion tokens per rollout.
        enable_sub_llms: ``False`` is refused (``ConfigError``): rlmq always offers ``llm_batch``.
        enable_summarization: ``True`` is refused (``ConfigError``): no ``summarize_turns`` here.
        min_turns_in_context: accepted; it only matters with summarization.
        max_turns_in_context: without summarization the reference treats it as a second
            ``max_turns``; so here (the state gets ``max_turns_in_context_stopped``).
        max_sub_llm_parallelism: sub-calls of one rollout at once (5).
        code_execution_timeout: seconds per REPL cell (120); a sub-call may take
            ``max(1, code_execution_timeout - 5)`` seconds, as in the reference.
        repl_language / pip_install_packages / expose_message_history /
        retain_filesystem_after_rollout: passed to rlmq by name when it has them; otherwise a
            value other than one rlmq can honour is refused (``ConfigError``).
        sandbox_*: see :data:`SANDBOX_ARGUMENTS`.

    Raises:
        ConfigError: a refused value (above), both budget names with different values, a
            value rlmq's settings refuse (named as the argument), or no ``REDIS_URL``.
    """

    def __init__(
        self,
        max_turns: int = 50,
        tools: list[Callable[..., Any] | str] | None = None,
        root_tools: list[Callable[..., Any] | str] | None = None,
        sub_tools: list[Callable[..., Any] | str] | None = None,
        sub_llm_max_turns: int = 5,
        sub_max_completion_tokens: int | None = None,
        root_max_completion_tokens: int | None = None,
        sub_model: str | None = None,
        sub_prompt_verbosity: Verbosity = "light",
        root_prompt_verbosity: Verbosity = "light",
        enable_sub_llms: bool = True,
        enable_summarization: bool = False,
        min_turns_in_context: int = 3,
        max_turns_in_context: int | None = None,
        max_output_length: int = 8192,
        max_sub_llm_parallelism: int = 5,
        system_prompt: str | None = None,
        repl_language: Literal["bash", "python"] = "bash",
        pip_install_packages: str = "",
        include_sub_llm_in_trajectory: bool = False,
        context_warning_threshold: float = 0.80,
        max_startup_wait_seconds: int = 120,
        code_execution_timeout: int = 120,
        abort_on_code_timeout: bool = False,
        expose_message_history: bool = False,
        retain_filesystem_after_rollout: bool = False,
        sub_llm_max_completion_tokens: int | None = None,
        sandbox_docker_image: str = "python:3.11-slim",
        sandbox_cpu_cores: int = 1,
        sandbox_memory_gb: int = 2,
        sandbox_disk_size_gb: int = 5,
        sandbox_gpu_count: int = 0,
        sandbox_timeout_minutes: int = 60,
        sandbox_environment_vars: dict[str, str] | None = None,
        sandbox_labels: list[str] | None = None,
        sandbox_client_max_workers: int = 50,
        sandbox_client_max_connections: int = 100,
        sandbox_client_max_keepalive_connections: int = 50,
        sandbox_transfer_max_retries: int = 3,
        **kwargs: Any,
    ) -> None:
        given = dict(locals())
        _refuse_unsupported(enable_sub_llms=enable_sub_llms, enable_summarization=enable_summarization)
        _log_sandbox({k: given[k] for k in _SANDBOX_DEFAULTS})
        capped = max_turns_in_context is not None and (max_turns <= 0 or max_turns_in_context < max_turns)
        turns = max_turns_in_context if capped and max_turns_in_context is not None else max_turns
        self.turn_cap = max_turns_in_context if capped else None
        self.rlmq_args: dict[str, Any] = {**_rlmq_arguments(given), "max_turns": turns}
        if kwargs.get("max_seq_len") is not None:
            self.rlmq_args["root_context_tokens"] = kwargs["max_seq_len"]
        self.max_turns = max_turns
        self.repl_language = repl_language
        self.sub_model = sub_model
        self._rlmq_check = RlmqEnv(**self._env_args())  # refuses bad values now, at construction
        if not self._rlmq_check.settings.redis_url:
            raise ConfigError("RLMEnv: no Redis for the sub-LLM fleet: set REDIS_URL (or RLMQ_REDIS_URL)")
        super().__init__(**kwargs)
        names = list(self._rlmq_check.toolbox.names)
        self.add_rubric(LegacyMonitorRubric(root_tool_names=names, extra=_RLMQ_METRICS))
        self._rlmq: RlmqEnv | None = None
        self._rlmq_loop: asyncio.AbstractEventLoop | None = None
        self._start_lock: asyncio.Lock | None = None

    def _env_args(self) -> dict[str, Any]:
        """rlmq ``RLMEnv`` arguments: the mapped ones, and the root client that sends each root
        call through the verifiers rollout it belongs to."""
        return {**self.rlmq_args, "root": RootDispatch()}

    async def _started(self) -> RlmqEnv:
        """The rlmq environment of the running event loop, started on first use (a new loop,
        as each ``evaluate_sync`` makes, gets its own)."""
        loop = asyncio.get_running_loop()
        if self._rlmq is not None and self._rlmq_loop is loop:
            return self._rlmq
        if self._start_lock is None or self._rlmq_loop is not loop:
            self._start_lock, self._rlmq_loop, self._rlmq = asyncio.Lock(), loop, None
        async with self._start_lock:
            if self._rlmq is None:
                env = RlmqEnv(**self._env_args())
                await env.start()
                self._rlmq = env
        return self._rlmq

    @vf.teardown
    async def _close_rlmq(self) -> None:
        """Close the rlmq environment (Redis connection, interception server) at teardown."""
        env, self._rlmq = self._rlmq, None
        if env is not None and self._rlmq_loop is asyncio.get_running_loop():
            await env.close()

    async def rollout(
        self,
        input: Any,
        client: Any,
        model: str,
        sampling_args: dict[str, Any] | None = None,
    ) -> Any:
        """Run one rollout of ``input`` (a dataset row: ``prompt``, ``answer``, ``info``) as an
        rlmq rollout, root calls through ``client``; return the filled verifiers ``State``
        (:func:`~rlmq.verifiers_legacy.state.fill_state`).

        The row's question is the text of its last user message; the context is
        ``info["context"]`` (``""`` when absent); ``info`` goes along as the rlmq row's ``info``.
        """
        state = await self.init_state(input, client, model, sampling_args)
        state["timing"].generation.start = time.time()
        turns = RootTurns(env=self, state=state)
        token = CURRENT.set(turns)
        try:
            env = await self._started()
            result = await env.rollout(_row(state), model=model, rollout_id=state["trajectory_id"])
            fill_state(state, result, first_prompt=turns.first_prompt, turn_cap=self.turn_cap)
        except (vf.Error, RlmqError, RedisError, OSError) as exc:
            state["error"] = exc if isinstance(exc, vf.Error) else vf.Error(f"{type(exc).__name__}: {exc}")
            state["is_completed"], state["stop_condition"] = True, "has_error"
            state["completion"] = state.get("completion") or []
        finally:
            CURRENT.reset(token)
        await self.cleanup(state)
        return state


def _rlmq_arguments(given: dict[str, Any]) -> dict[str, Any]:
    """rlmq ``RLMEnv`` arguments from the reference's (``given``: the constructor's locals).

    Raises:
        ConfigError: both budget names with different values; a sub-tool without an import
            path; a REPL argument rlmq cannot honour.
    """
    timeout = given["code_execution_timeout"]
    same = (
        "sub_llm_max_turns", "root_max_completion_tokens", "sub_model", "sub_prompt_verbosity",
        "root_prompt_verbosity", "max_output_length", "max_sub_llm_parallelism", "system_prompt",
        "include_sub_llm_in_trajectory", "context_warning_threshold", "abort_on_code_timeout",
    )  # fmt: skip
    return {
        **{name: given[name] for name in same},
        "sub_llm_max_completion_tokens": _one_budget(
            given["sub_max_completion_tokens"], given["sub_llm_max_completion_tokens"]
        ),
        "max_startup_wait_seconds": float(given["max_startup_wait_seconds"]),
        "code_execution_timeout": float(timeout),
        "sub_call_timeout": float(max(1, timeout - 5)),  # the reference's sub-call timeout
        "rollout_timeout": float(given["sandbox_timeout_minutes"]) * 60.0,
        "tools": list(given["tools"] or []),
        "root_tools": list(given["root_tools"] or []),
        "sub_tools": shared_tool_paths(given["sub_tools"] or [], _sub_tool_refusal),
        **_repl_arguments(given),
    }


_RLMQ_METRICS: tuple[str, ...] = (
    "main_rlm_turns", "main_rlm_prompt_tokens", "main_rlm_completion_tokens", "sub_llm_rejected_count",
    "sub_llm_error_count", "sub_llm_truncated_count", "sub_llm_segment_count", "sub_llm_queue_wait_seconds_mean",
    "sub_llm_budget_limit",
    "sub_llm_budget_charged", "sub_llm_budget_used",
)  # fmt: skip
"""rlmq's own metrics reported beside the reference's (0 when a rollout has none, e.g. no budget)."""


def _row(state: Any) -> DatasetRow:
    info = state.get("info")
    info = dict(info) if isinstance(info, dict) else {}
    messages = list(state["prompt"])
    users = [m for m in messages if getattr(m, "role", None) == "user"] or messages  # a plain-text prompt
    content = getattr(users[-1], "content", "") if users else ""
    question = content if isinstance(content, str) else " ".join(_text(part) for part in content or [])
    answer = state.get("answer")
    return DatasetRow(
        id=str(state.get("example_id", "0")),
        question=question,
        context=info.get("context", ""),
        answer=answer if isinstance(answer, str) and answer else None,
        info=info,
    )


def _text(part: Any) -> str:
    """The text of one content part (a pydantic part or a dict); ``""`` for an image or audio part."""
    text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
    return text if isinstance(text, str) else ""


def _sub_tool_refusal(tool: Any) -> str:
    """The one line for a ``sub_tools`` callable without an import path (a lambda, a nested function)."""
    return (
        f"RLMEnv(sub_tools=[{tool!r}]): the sub-LLMs run on rlmq workers, which import a sub-tool by its path; "
        "give a module-level function (root_tools take any callable)"
    )


def _refuse_unsupported(*, enable_sub_llms: bool, enable_summarization: bool) -> None:
    if not enable_sub_llms:
        raise ConfigError("RLMEnv(enable_sub_llms=False) is not supported by rlmq: llm_batch is always offered")
    if enable_summarization:
        raise ConfigError("RLMEnv(enable_summarization=True) is not supported by rlmq: there is no summarize_turns")


def _log_sandbox(values: dict[str, Any]) -> None:
    for name, value in values.items():
        if value != _SANDBOX_DEFAULTS[name] and name != "sandbox_timeout_minutes":
            log.warning("RLMEnv(%s=%r): %s", name, value, SANDBOX_ARGUMENTS[name])


def _one_budget(new: int | None, old: int | None) -> int | None:
    if new is not None and old is not None and new != old:
        raise ConfigError(
            f"RLMEnv: sub_max_completion_tokens={new} and sub_llm_max_completion_tokens={old} name one "
            "budget (0.1.14's and #966's name); give one"
        )
    return new if new is not None else old


_REPL_ARGUMENTS: dict[str, tuple[Any, ...]] = {
    "repl_language": ("python",),
    "pip_install_packages": ("",),
    "expose_message_history": (False,),
    "retain_filesystem_after_rollout": (False,),
}
"""REPL arguments rlmq may not have (yet) -> the values it honours without them."""


def _repl_arguments(given: dict[str, Any]) -> dict[str, Any]:
    """The REPL arguments as rlmq takes them: by name where ``RolloutOptions`` has the field,
    else dropped when rlmq honours the value anyway, else refused."""
    out: dict[str, Any] = {}
    for name, honoured in _REPL_ARGUMENTS.items():
        value = given[name]
        if name == "pip_install_packages" and isinstance(value, str):
            out[name] = value.split()  # the reference's space-separated string
        elif name in RolloutOptions.model_fields:
            out[name] = value
        elif value not in honoured:
            raise ConfigError(
                f"RLMEnv({name}={value!r}) is not supported by this rlmq (it supports {name}={honoured[0]!r} only)"
            )
    return out
