"""``RLMEnv`` for verifiers 0.1.14: the reference's constructor, rlmq's fleet underneath.

An environment module written for verifiers' own ``RLMEnv`` changes one line::

    from verifiers.envs.experimental.rlm_env import RLMEnv   # before
    from rlmq.verifiers_legacy import RLMEnv                 # after

and runs through ``env.evaluate(...)`` and ``vf-eval`` as before. The constructor takes every
argument of the reference (pull request #966 and verifiers 0.1.14, same defaults), and the
base ``Environment``'s (``dataset``, ``eval_dataset``, ``rubric``, ``parser``, ``max_seq_len``,
...) pass through. Each rollout is an rlmq rollout (:class:`rlmq.RLMEnv`): the
root model's calls go through the client verifiers hands to ``rollout`` (so verifiers counts
them and records them in ``state["trajectory"]``), the sub-LLM calls run as jobs on the rlmq
worker fleet under the hard budget, and Redis is found through ``REDIS_URL`` (or
``RLMQ_REDIS_URL``), as by every rlmq entry point. What each argument means here:
``docs/verifiers-rlmenv.md`` ("The verifiers 0.1.14 module").
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any, Literal

import verifiers as vf
from redis.exceptions import RedisError

from rlmq import (
    ROOT_RESERVED_SAMPLING,
    TOOL_ERROR,
    ArgumentError,
    ConfigError,
    DatasetRow,
    RlmqError,
    RolloutOptions,
)
from rlmq import RLMEnv as RlmqEnv
from rlmq.verifiers_legacy.hooks import ReferenceHooks
from rlmq.verifiers_legacy.root_turns import CURRENT, RootDispatch, RootTurns
from rlmq.verifiers_legacy.state import LegacyMonitorRubric, fill_state
from rlmq.verifiers_legacy.sub_steps import interleave_sub_steps
from rlmq.verifiers_legacy.summarize import SUMMARY_FIGURES

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


class RLMEnv(ReferenceHooks, vf.StatefulToolEnv):
    """A verifiers 0.1.14 ``StatefulToolEnv`` with the reference ``RLMEnv``'s constructor,
    public attributes and hooks (see the module docstring); the rollouts are rlmq's. Arguments
    not listed here go to ``vf.Environment`` (``dataset``, ``eval_dataset``, ``rubric``,
    ``parser``, ``max_seq_len``, ``sampling_args``, ...).

    Hooks a rollout calls: ``setup_state`` (before it runs), ``add_model_response`` (each root
    turn, as the root call returns), ``summarize_turns`` (when the model calls it),
    ``render_completion`` and the ``@vf.cleanup`` handlers (at its end). The REPL cells run in
    rlmq's engine: ``call_python_repl`` / ``call_bash_repl``, ``env_response`` and
    ``get_prompt_messages`` are the reference's for a subclass or a test to call, not called by
    rlmq's rollouts.

    Args (the reference's, same defaults; units as there):
        max_turns: root-model turns (50); ``<= 0``: no limit.
        tools: callables or ``pkg.mod:func`` paths for the REPL and the sub-LLMs (#966's
            meaning; 0.1.14 gave them to the root model as function-calling tools instead:
            here the root model has one tool, the REPL).
        root_tools / sub_tools: REPL-only / sub-LLM-only tools; a sub-tool is an import path
            or any named callable, nested functions included (one no worker can import runs in
            the rollout's process, as a hosted tool).
        sub_llm_max_turns: tool-calling turns of one sub-LLM call (5).
        sub_max_completion_tokens / sub_llm_max_completion_tokens: the sub-LLM completion-token
            budget of a rollout (0.1.14's / #966's name; give one, or both equal); hard here.
        root_max_completion_tokens: root turns run while the root model's completion tokens
            are below it (the reference's meaning; :mod:`~rlmq.verifiers_legacy.root_turns`).
        enable_sub_llms: ``False``: no ``llm_batch`` (nor ``rlm_batch``) in the REPL and nothing of
            sub-LLMs in the root's system message, as in the reference.
        enable_summarization / min_turns_in_context: the ``summarize_turns`` tool
            (:mod:`~rlmq.verifiers_legacy.summarize`).
        max_turns_in_context: turns in the model's context at most; without summarization a
            second ``max_turns`` (the state gets ``max_turns_in_context_stopped``).
        max_sub_llm_parallelism: sub-calls of one rollout at once (5).
        code_execution_timeout: seconds per REPL cell (120); a sub-call may take
            ``max(1, code_execution_timeout - 5)`` seconds, as in the reference.
        expose_message_history: ``.messages`` in the REPL's working directory (``True``: 0.1.14
            always wrote it).
        repl_language / pip_install_packages / retain_filesystem_after_rollout: passed to rlmq
            by name when it has them; otherwise a value other than one rlmq can honour is
            refused (``ArgumentError``).
        sandbox_*: see :data:`SANDBOX_ARGUMENTS`.

    Raises:
        ArgumentError: (a ``ValueError`` and a ``ConfigError``) a refused value (above), both
            budget names with different values, a value rlmq's settings refuse (named as the
            argument), a tool name that collides.
        ConfigError: no ``REDIS_URL``.
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
        expose_message_history: bool = True,
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
        _check_choices(repl_language, sub_prompt_verbosity, root_prompt_verbosity)
        _log_sandbox({k: given[k] for k in _SANDBOX_DEFAULTS})
        capped = (
            not enable_summarization
            and max_turns_in_context is not None
            and (max_turns <= 0 or max_turns_in_context < max_turns)
        )
        turns = max_turns_in_context if capped and max_turns_in_context is not None else max_turns
        self.turn_cap = max_turns_in_context if capped else None
        try:
            self.rlmq_args: dict[str, Any] = {**_rlmq_arguments(given), "max_turns": turns}
            if kwargs.get("max_seq_len") is not None:
                self.rlmq_args["root_context_tokens"] = kwargs["max_seq_len"]
            self._rlmq_check = RlmqEnv(**self._env_args())  # refuses bad values now, at construction
        except ArgumentError:
            raise
        except ConfigError as exc:
            raise ArgumentError(str(exc)) from exc
        if not self._rlmq_check.settings.redis_url:
            raise ConfigError("RLMEnv: no Redis for the sub-LLM fleet: set REDIS_URL (or RLMQ_REDIS_URL)")
        _set_reference_attributes(self, given)
        super().__init__(tools=[], max_turns=max_turns, **kwargs)
        self.add_tool(self.call_bash_repl if repl_language == "bash" else self.call_python_repl, args_to_skip=["state"])
        if enable_summarization:
            self.add_tool(self.summarize_turns, args_to_skip=["state"])
        names = list(self._rlmq_check.toolbox.names)
        self.root_tool_names: list[str] = ["llm_batch", *names] if enable_sub_llms else names
        self.add_rubric(LegacyMonitorRubric(root_tool_names=names, extra=_RLMQ_METRICS))
        self._rlmq: RlmqEnv | None = None
        self._rlmq_loop: asyncio.AbstractEventLoop | None = None
        self._start_lock: asyncio.Lock | None = None
        self._empty_dir: str | None = None

    async def setup_state(self, state: Any, **kwargs: Any) -> None:
        """The reference's per-rollout state keys, before the rollout runs (a subclass that
        overrides this hook and calls ``super()`` sees them set): ``rollout_id``,
        ``context_warning_sent``, ``rlm_root_tools`` / ``rlm_sub_tools`` (tool names),
        ``_keep_from_assistant_index`` and ``_summary_text`` (summarization),
        ``_observable_messages`` (``.messages``), the ``summarize_*`` figures at 0."""
        state["rollout_id"] = state.get("trajectory_id", "")  # rlmq's rollout id, as fill_state keeps it
        state["context_warning_sent"] = False
        state["rlm_root_tools"] = list(self.root_tool_names)
        state["rlm_sub_tools"] = [str(t) if isinstance(t, str) else getattr(t, "__name__", "") for t in self.sub_tools]
        state["_keep_from_assistant_index"], state["_summary_text"] = 0, ""
        state["_observable_messages"] = []
        for name, value in SUMMARY_FIGURES.items():
            state.setdefault(name, value)

    async def _call_sub_tool(self, tool_name: str, tool_args: dict[str, Any], tool_call_id: str) -> dict[str, Any]:
        """One sub-LLM tool call (a sub-tool given as a callable), run as rlmq runs a hosted
        one for a worker: arguments checked against the tool's schema, the result as text; a
        failure's text starts with ``Error:``. Returns the tool message (``role``, ``content``,
        ``tool_call_id``), as the reference's ``_call_sub_tool``."""
        hosted = self._rlmq_check.hosted
        text = await hosted.registry.call(tool_name, json.dumps(tool_args), timeout=hosted.timeout)
        if text.startswith(TOOL_ERROR):
            text = f"Error: {text}"
        return {"role": "tool", "content": text, "tool_call_id": tool_call_id}

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
    def _empty_context_dir(self) -> str:
        """An empty folder, readable by the REPL, that rows without a context get as their
        ``context_dir`` (made on first use, removed at teardown)."""
        if self._empty_dir is None or not os.path.isdir(self._empty_dir):
            self._empty_dir = tempfile.mkdtemp(prefix="rlmq-legacy-empty-context-")
            os.chmod(self._empty_dir, 0o755)  # the REPL runs as its own uid
        return self._empty_dir

    async def _close_rlmq(self) -> None:
        """Close the rlmq environment (Redis connection, interception server) at teardown."""
        if self._empty_dir is not None:
            shutil.rmtree(self._empty_dir, ignore_errors=True)
            self._empty_dir = None
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
        await self.setup_state(state)
        turns = RootTurns(env=self, state=state)
        token = CURRENT.set(turns)
        try:
            env = await self._started()
            sampling = _rollout_sampling(state.get("sampling_args"))
            result = await env.rollout(
                _row(state, self._empty_context_dir),
                model=model,
                rollout_id=state["trajectory_id"],
                sampling_args=sampling,
            )
            fill_state(state, result, first_prompt=turns.first_prompt, turn_cap=self.turn_cap)
            # .messages: the conversation as rlmq kept it, with the summarize exchanges answered
            # outside rlmq's engine put back, and the summary on the turn where the context starts
            state["_observable_messages"] = turns._with_hidden([*state["prompt"], *state["completion"]])
            self._refresh_observable_summary_insertion(state)
            if self.include_sub_llm_in_trajectory:
                state["trajectory"] = interleave_sub_steps(state["trajectory"], result.trajectory)
        except (vf.Error, RlmqError, RedisError, OSError, ValueError) as exc:
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
        ConfigError: both budget names with different values; a REPL argument rlmq cannot honour.
        ArgumentError: a sub-tool without a name a model can call (a lambda).
    """
    timeout = given["code_execution_timeout"]
    same = (
        "sub_llm_max_turns", "sub_model", "sub_prompt_verbosity", "root_prompt_verbosity", "max_output_length",
        "max_sub_llm_parallelism", "system_prompt", "include_sub_llm_in_trajectory", "context_warning_threshold",
        "abort_on_code_timeout",
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
        "repl_output_format": "reference",  # Out[n], stderr:, (no output), as the reference's REPL
        "enable_sub_llms": bool(given["enable_sub_llms"]),
        "tools": list(given["tools"] or []),
        "root_tools": list(given["root_tools"] or []),
        "sub_tools": [t for t in given["sub_tools"] or [] if isinstance(t, str)],
        "hosted_sub_tools": [_named(t) for t in given["sub_tools"] or [] if not isinstance(t, str)],
        **_repl_arguments(given),
    }


_RLMQ_METRICS: tuple[str, ...] = (
    "main_rlm_turns", "main_rlm_prompt_tokens", "main_rlm_completion_tokens", "sub_llm_rejected_count",
    "sub_llm_error_count", "sub_llm_truncated_count", "sub_llm_segment_count", "sub_llm_queue_wait_seconds_mean",
    "sub_llm_budget_limit",
    "sub_llm_budget_charged", "sub_llm_budget_used",
)  # fmt: skip
"""rlmq's own metrics reported beside the reference's (0 when a rollout has none, e.g. no budget)."""


def _rollout_sampling(args: Any) -> dict[str, Any]:
    """The verifiers rollout's sampling arguments as rlmq takes them for its root turns and
    sub-calls: unset (``None``) values and the fields rlmq sets itself (``n``, ``stream``, ...;
    verifiers fills ``n=1``) left out."""
    given = args if isinstance(args, dict) else {}
    return {k: v for k, v in given.items() if v is not None and k not in ROOT_RESERVED_SAMPLING}


def _row(state: Any, empty_dir: Callable[[], str]) -> DatasetRow:
    """rlmq's row of a verifiers rollout. A row with neither ``info["context"]`` nor
    ``info["context_dir"]`` gets an empty ``context_dir`` (``empty_dir()``): its REPL starts in
    an empty working directory, as the reference's does, not with an empty ``context.txt``."""
    info = state.get("info")
    info = dict(info) if isinstance(info, dict) else {}
    if info.get("context") is None and not info.get("context_dir"):
        info["context_dir"] = empty_dir()
    messages = list(state["prompt"])
    users = [m for m in messages if getattr(m, "role", None) == "user"] or messages  # a plain-text prompt
    content = getattr(users[-1], "content", "") if users else ""
    question = content if isinstance(content, str) else " ".join(_text(part) for part in content or [])
    answer = state.get("answer")
    return DatasetRow(
        id=str(state.get("example_id", "0")),
        question=question,
        context="" if info.get("context") is None else info["context"],
        answer=answer if isinstance(answer, str) and answer else None,
        info=info,
    )


def _text(part: Any) -> str:
    """The text of one content part (a pydantic part or a dict); ``""`` for an image or audio part."""
    text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
    return text if isinstance(text, str) else ""


def _named(tool: Any) -> Any:
    """``tool`` when its name can be a tool's name for the model.

    Raises:
        ArgumentError: a lambda or another callable without such a ``__name__``.
    """
    if not callable(tool) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", str(getattr(tool, "__name__", ""))):
        raise ArgumentError(f"RLMEnv(sub_tools=[{tool!r}]): a sub-tool needs a name a model can call (def name(...))")
    return tool


def _check_choices(repl_language: str, sub_verbosity: str, root_verbosity: str) -> None:
    """Raises ArgumentError for a REPL language or a prompt verbosity the reference does not know."""
    if repl_language not in {"bash", "python"}:
        raise ArgumentError(f"RLMEnv(repl_language={repl_language!r}): expected 'bash' or 'python'")
    for name, value in (("sub_prompt_verbosity", sub_verbosity), ("root_prompt_verbosity", root_verbosity)):
        if value not in {"light", "medium", "heavy"}:
            raise ArgumentError(f"RLMEnv({name}={value!r}): expected 'light', 'medium' or 'heavy'")


_SAME_NAME = (
    "sub_prompt_verbosity", "root_prompt_verbosity", "enable_sub_llms", "repl_language", "sub_model",
    "sub_llm_max_turns", "root_max_completion_tokens", "max_output_length", "max_sub_llm_parallelism",
    "pip_install_packages", "max_startup_wait_seconds", "include_sub_llm_in_trajectory", "context_warning_threshold",
    "code_execution_timeout", "abort_on_code_timeout", "enable_summarization", "min_turns_in_context",
    "max_turns_in_context", "retain_filesystem_after_rollout", "expose_message_history", *_SANDBOX_DEFAULTS,
)  # fmt: skip
"""Constructor arguments kept as attributes of the same name, as the reference keeps them."""


def _set_reference_attributes(env: Any, given: dict[str, Any]) -> None:
    """The reference's public attributes on ``env``, from the constructor's arguments ``given``."""
    for name in _SAME_NAME:
        setattr(env, name, given[name])
    env.standard_tools = list(given["tools"] or [])
    env.repl_tools = list(given["root_tools"] or [])
    env.sub_only_tools = list(given["sub_tools"] or [])
    env.sub_tools = list(env.sub_only_tools)
    env.sub_max_completion_tokens = env.rlmq_args["sub_llm_max_completion_tokens"]
    env.custom_system_prompt = given["system_prompt"]
    env.sub_llm_timeout = max(1, given["code_execution_timeout"] - 5)


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
