"""``rlmq.common.settings``: the one settings object of rlmq.

Built once at start-up from command-line flags (passed as keyword arguments) over
``RLMQ_*`` environment variables over the defaults below, then passed down. Nothing
in rlmq reads the environment anywhere else. ``REDIS_URL`` is accepted as well as
``RLMQ_REDIS_URL``; ``OPENAI_API_KEY`` as well as ``RLMQ_API_KEY``.

What it owns: the declaration (here: :class:`Settings`, :class:`RolloutOptions`,
:func:`load_settings`, :func:`setting_default`), a worker's own fields (:mod:`.worker`), the
field metadata and error lines (:mod:`.fields`) and every setting as one record, for flags and
docs (:mod:`.schema`; ``python -m rlmq.common.settings.schema`` writes ``docs/settings.md``).

What it may import (held by ``tests/unit/test_layout.py``): the flat modules of
:mod:`rlmq.common` only; never :mod:`rlmq.common.budget` or :mod:`rlmq.common.jobs` (both read
their defaults from here), ``producer`` or ``workers``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rlmq.common.errors import ConfigError
from rlmq.common.keys import queue_name_for_model, tenant_queue
from rlmq.common.sampling import DEFAULT_CALL_MAX_TOKENS
from rlmq.common.schemas import SUB_LLM_MAX_TURNS_DEFAULT, SUB_LLM_MAX_TURNS_LIMIT, normalize_sampling
from rlmq.common.settings.fields import field_env_vars, meta, validated
from rlmq.common.settings.worker import WorkerOptions
from rlmq.common.token_servers import TokenApi, TokenIdsApi
from rlmq.common.tree import MAX_DEPTH, MAX_DEPTH_DEFAULT

Verbosity = Literal["light", "medium", "heavy"]
SystemPromptMode = Literal["prepend", "append", "replace"]
ReplLanguage = Literal["python", "bash"]

_CAP_TEXT = f"the sub-sampling, else the sampling max_tokens, else {DEFAULT_CALL_MAX_TOKENS}"
BUDGET_ZERO = "must be >= 1: a budget of 0 would refuse every sub-LLM call; leave it unset for no budget"


class RolloutOptions(BaseModel):
    """What one rollout needs, and may carry to another host: no connection, no secret.

    Owned by the producer that starts the rollout. A value here that a worker must honour
    (the key TTL, the budget, the cap) travels with the rollout, in its ledger or its job,
    and is never read from the worker's own environment. Times in seconds, sizes in
    completion tokens or characters as named. :meth:`Settings.rollout_options` builds one.

    Each field is a flag of ``rlmq run`` / ``rlmq demo``, an ``RLMEnv`` argument, a
    ``--env.agent.harness.*`` knob of the verifiers harness and an ``RLMQ_*`` variable
    (``docs/settings.md``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True, allow_inf_nan=False)
    """No ``inf`` or ``nan``: an endless timeout would silently switch its bound off (and a
    socket timeout derived from it overflows); give a large number instead."""

    sub_model: str | None = Field(
        default=None,
        description="model the sub-LLM workers serve; it names the queue",
        json_schema_extra=meta(group="common", commands=("run",), metavar="NAME", default_text="the root model"),
    )
    max_turns: int = Field(
        default=50,
        description="root-model turns per rollout; 0 or less: no turn limit (rollout_timeout still applies)",
        json_schema_extra=meta(group="common", unit="turns"),
    )
    sub_llm_max_turns: int = Field(
        default=SUB_LLM_MAX_TURNS_DEFAULT,
        ge=1,
        le=SUB_LLM_MAX_TURNS_LIMIT,
        description="turns of one sub-LLM's own tool loop",
        json_schema_extra=meta(group="repl", unit="turns"),
    )
    sub_llm_max_completion_tokens: int | None = Field(
        default=None,
        ge=1,
        description=(
            "the rollout's sub-LLM budget, hard across all workers; 0 is refused (it would refuse "
            "every sub-LLM call): leave it unset for no budget"
        ),
        json_schema_extra=meta(group="common", unit="completion tokens", default_text="no budget"),
    )
    sub_llm_per_call_max_tokens: int | None = Field(
        default=None,
        ge=1,
        description="max_tokens of every sub-LLM call and child root turn (the budget's whole grant); overrides "
        "the sampling and sub-sampling arguments' max_tokens",
        json_schema_extra=meta(group="budget", unit="completion tokens", default_text=_CAP_TEXT),
    )
    child_root_min_grant_tokens: int = Field(
        default=256,
        ge=1,
        description=(
            "a child rollout's root turn takes its whole max_tokens from the tree budget when free, else waits "
            "while calls of the tree run, else the budget's last remainder; a remainder below this (and below "
            "1.25 x the tree's longest root turn that ended, at least 64) ends the child (its best answer, stop "
            "reason budget_spent); the tree's root cap is at least twice this"
        ),
        json_schema_extra=meta(group="recursion", unit="completion tokens"),
    )
    root_max_completion_tokens: int | None = Field(
        default=None,
        ge=1,
        description=(
            "the root model's own completion tokens per rollout, told to the root in its system prompt; a "
            f"root turn (max_tokens: the sampling max_tokens, else {DEFAULT_CALL_MAX_TOKENS}) starts only when "
            "its whole max_tokens is left, else the rollout stops with its current answer"
        ),
        json_schema_extra=meta(group="budget", unit="completion tokens", default_text="no limit"),
    )
    max_sub_llm_parallelism: int = Field(
        default=64,
        ge=1,
        description="sub-calls of one rollout queued or running at once",
        json_schema_extra=meta(unit="sub-calls"),
    )
    max_depth: int = Field(
        default=MAX_DEPTH_DEFAULT,
        ge=1,
        le=MAX_DEPTH,
        description=(
            "depth of the rollout tree: below it, rlm_batch in a rollout's REPL starts child rollouts (each "
            "with its own REPL and root model, the sub-model) on the fleet; at it, rlm_batch runs plain "
            f"sub-LLM calls; 1: no child rollouts; at most {MAX_DEPTH} (the deepest child queue a REPL host serves)"
        ),
        json_schema_extra=meta(group="common", flag="--max-depth", unit="levels", metavar="N"),
    )
    max_output_length: int = Field(
        default=8192,
        ge=100,
        description="characters of a REPL cell's output shown to the root model",
        json_schema_extra=meta(group="repl", unit="characters"),
    )
    code_execution_timeout: float = Field(
        default=120.0,
        gt=0,
        description="how long a REPL cell may run before the REPL is restarted",
        json_schema_extra=meta(group="repl", unit="seconds"),
    )
    max_startup_wait_seconds: float = Field(
        default=120.0,
        gt=0,
        description="how long a rollout's REPL may take to start (package installs included)",
        json_schema_extra=meta(group="repl", unit="seconds"),
    )
    repl_language: ReplLanguage = Field(
        default="python",
        description="the root model's REPL: python (call_python_repl; `context`, `answer` dict) or bash "
        "(call_bash_repl; ANSWER_CONTENT / ANSWER_READY, llm_batch as a command), both with the context as "
        "files in the working directory; the verifiers RLMEnv's default is bash",
        json_schema_extra=meta(group="repl"),
    )
    expose_message_history: bool = Field(
        default=False,
        description="before each cell, write the conversation so far to .messages (JSON lines, one message "
        "per line) in the REPL's working directory, and tell the root model so",
        json_schema_extra=meta(group="repl"),
    )
    enable_sub_llms: bool = Field(
        default=True,
        description="offer sub-LLMs: llm_batch (and rlm_batch) in the REPL and in the root model's system "
        "message; false: the REPL has neither and the root works alone (verifiers 0.1.14's enable_sub_llms)",
        json_schema_extra=meta(group="repl"),
    )
    repl_output_format: Literal["rlmq", "reference"] = Field(
        default="rlmq",
        description="how a Python cell's output reads to the root model: rlmq (the streams as printed, a last "
        "expression's repr after them) or reference (verifiers 0.1.14's RLMEnv: the cell's Python-level stderr "
        "after a 'stderr:' line, the last expression as 'Out[n]: repr', '(no output)' for an empty cell)",
        json_schema_extra=meta(group="repl"),
    )
    retain_filesystem_after_rollout: bool = Field(
        default=False,
        description="when a rollout ends, copy the REPL's working directory to a new host folder, named by a "
        '{"type": "files", "path": ...} event in the trajectory',
        json_schema_extra=meta(group="repl"),
    )
    abort_on_code_timeout: bool = Field(
        default=False,
        description="end the rollout (stop reason code_timeout) when a REPL cell runs past "
        "code_execution_timeout, instead of telling the root model and going on",
        json_schema_extra=meta(group="repl"),
    )
    root_context_tokens: int | None = Field(
        default=None,
        ge=1,
        description="the root model's context window; a root reply whose prompt reaches "
        "context_warning_threshold of it makes the next tool message tell the model to finish",
        json_schema_extra=meta(group="repl", unit="tokens", default_text="unknown: no warning"),
    )
    context_warning_threshold: float = Field(
        default=0.80,
        gt=0,
        le=1,
        description="share of root_context_tokens at which the root model is told to finish (once)",
        json_schema_extra=meta(group="repl", unit="share, (0, 1]", metavar="SHARE"),
    )
    rollout_timeout: float = Field(default=3600.0, gt=0, description="wall-clock deadline of one whole rollout; "
        "past it the rollout ends in error", json_schema_extra=meta(unit="seconds"))  # fmt: skip
    sub_call_timeout: float = Field(
        default=300.0,
        gt=0,
        description="deadline of one sub-call, from enqueue to result",
        json_schema_extra=meta(unit="seconds"),
    )
    root_prompt_verbosity: Verbosity = Field(
        default="light",
        description="how much the root model's system prompt explains",
        json_schema_extra=meta(group="repl"),
    )
    sub_prompt_verbosity: Verbosity = Field(
        default="light", description="how much a sub-LLM's system prompt explains", json_schema_extra=meta(group="repl")
    )
    sub_tools: list[str] = Field(
        default_factory=list,
        description=(
            "a tool the sub-LLMs may call, as a dotted import path (repeatable); local workers allow it, "
            "remote ones need --allow-tool"
        ),
        json_schema_extra=meta(
            group="repl", commands=("run",), flag="--sub-tool", metavar="DOTTED.PATH", default_text="none"
        ),
    )
    pip_install_packages: list[str] = Field(
        default_factory=list,
        description="a package (requirement or wheel path) pip installs into each top rollout's REPL (repeatable; "
        "a str of space-separated packages, the verifiers RLMEnv's form, is split); "
        "child rollouts (max_depth > 1) get none: their REPL hosts never pip install for a job",
        json_schema_extra=meta(group="repl", flag="--pip-install-packages", metavar="PACKAGE", default_text="none"),
    )
    include_sub_llm_in_trajectory: bool = Field(
        default=False,
        description="every model turn of the tree is a trainable step (verifiers' RLMEnv): its served prompt "
        "ids, completion ids and logprobs (vLLM's return_token_ids), and each sub-LLM's conversation, are kept",
        json_schema_extra=meta(group="repl"),
    )
    trajectory_token_max_bytes: int = Field(default=16 * 2**20, ge=0, description="token payload one rollout keeps; "
        "then turns are untrainable (payload_cap)", json_schema_extra=meta(group="repl", unit="bytes"))  # fmt: skip
    sampling_args: dict[str, Any] = Field(
        default_factory=dict,
        description="sampling arguments of every root-model call, a JSON object: temperature, top_p, "
        "max_tokens (completion tokens per call), extra_body (a server's own keys, merged in); sub-LLM "
        "calls and child root turns sample with them too, unless the sub-sampling arguments say otherwise",
        json_schema_extra=meta(
            group="sampling", flag="--sampling-args", aliases=("-S",), metavar="JSON", default_text="{}"
        ),
    )
    sub_sampling_args: dict[str, Any] = Field(
        default_factory=dict,
        description="sampling arguments of every sub-LLM model call and child root turn, a JSON object: "
        "temperature, top_p, max_tokens, extra_body; each key overrides the sampling arguments' own "
        "(--sub-llm-per-call-max-tokens overrides max_tokens)",
        json_schema_extra=meta(group="sampling", metavar="JSON", default_text="{}"),
    )
    rollout_key_ttl: int = Field(default=3600, ge=10, description="how long a rollout's Redis keys live without "
        "a refresh (refreshed while it runs)", json_schema_extra=meta(unit="seconds"))  # fmt: skip
    max_batch_prompts: int = Field(
        default=10_000, ge=1, description="prompts in one llm_batch call", json_schema_extra=meta(unit="prompts")
    )
    max_batch_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1024,
        description="size of one llm_batch request from the REPL",
        json_schema_extra=meta(unit="bytes"),
    )
    tools: list[str] = Field(
        default_factory=list,
        description="dotted import paths (pkg.mod:func) of tools for the root REPL and the sub-LLMs alike "
        "(the workers must allow-list them), as the verifiers RLMEnv's tools (repeatable)",
        json_schema_extra=meta(
            group="repl", commands=("run",), flag="--tool", metavar="MODULE:FUNCTION", default_text="none"
        ),
    )
    root_tools: list[str] = Field(
        default_factory=list,
        description="dotted import paths (pkg.mod:func) of tools callable from the root REPL only; each is a "
        "REPL global of its own name that runs in the producer (repeatable)",
        json_schema_extra=meta(
            group="repl", commands=("run",), flag="--root-tool", metavar="MODULE:FUNCTION", default_text="none"
        ),
    )
    root_tool_timeout: float = Field(
        default=60.0,
        gt=0,
        le=86_400,
        description="how long one call of a root (REPL) tool may run before it fails (at most a day: "
        "the REPL's socket timeout is derived from it)",
        json_schema_extra=meta(group="repl", unit="seconds"),
    )
    root_tool_max_args_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        description="largest JSON body of one root-tool call's arguments",
        json_schema_extra=meta(group="repl", unit="bytes"),
    )
    root_tool_max_result_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        description="largest JSON result a root-tool call may return",
        json_schema_extra=meta(group="repl", unit="bytes"),
    )
    hosted_tool_timeout: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="how long a sub-LLM's call of a shared tool that no worker allow-lists may run in the "
        "rollout's own process, where the callable lives (the worker waits 10 s more for the answer)",
        json_schema_extra=meta(group="repl", unit="seconds"),
    )
    sub_tool_max_result_chars: int = Field(
        default=20_000,
        ge=100,
        description="characters of a sub-LLM tool call's answer, its result or its error text (a worker's own "
        "tools and shared tools run for it); the rest is cut with a marker before it travels",
        json_schema_extra=meta(group="repl", unit="characters"),
    )
    system_prompt: str | None = Field(
        default=None,
        description="the environment author's own system prompt for the root model (see system_prompt_mode)",
        json_schema_extra=meta(group="repl", metavar="TEXT", default_text="none"),
    )
    system_prompt_mode: SystemPromptMode = Field(
        default="prepend",
        description="where system_prompt goes: before the scaffold's REPL and budget text (prepend), after it "
        "(append), or instead of it (replace: the author then explains the REPL)",
        json_schema_extra=meta(group="repl"),
    )
    sub_llm_final_answer_turn: bool = Field(
        default=True,
        description="when a sub-LLM's tool loop reaches sub_llm_max_turns, ask it for a final answer in one "
        "more turn without tools (budgeted like any turn; skipped when the budget is spent)",
        json_schema_extra=meta(group="repl"),
    )

    @field_validator("sampling_args", mode="before")
    @classmethod
    def _root_sampling(cls, value: Any) -> dict[str, Any]:
        return normalize_sampling(value, sub=False)

    @field_validator("sub_sampling_args", mode="before")
    @classmethod
    def _sub_sampling(cls, value: Any) -> dict[str, Any]:
        flat = normalize_sampling(value, sub=False)  # max_tokens allowed here: it is the per-call cap
        cap = flat.pop("max_tokens", None)
        normalize_sampling(flat, sub=True)  # the rest as a sub-call's body: no user, n, ...
        return flat if cap is None else {**flat, "max_tokens": cap}

    @field_validator("sub_tools", mode="before")
    @classmethod
    def _no_sub_tools(cls, value: Any) -> Any:
        return [] if value is None else value  # the verifiers RLMEnv's default, sub_tools=None

    @field_validator("pip_install_packages", mode="before")
    @classmethod
    def _packages_string(cls, value: Any) -> Any:
        # the verifiers RLMEnv's form: one str of space-separated packages ("" for none)
        return value.split() if isinstance(value, str) else value

    @field_validator("sub_llm_max_completion_tokens", mode="before")
    @classmethod
    def _no_zero_budget(cls, value: Any) -> Any:
        if value is not None and str(value).strip() == "0":
            raise ValueError(BUDGET_ZERO)
        return value


class Settings(BaseSettings, RolloutOptions, WorkerOptions):
    """Every knob of rlmq, for producer and worker alike: the process's own (connections,
    secrets, how many rollouts at once) declared here, the rest in :class:`RolloutOptions`
    (per rollout, travels) and :class:`WorkerOptions` (a worker's own), one flat object.
    Times in seconds, sizes in tokens (completion tokens) or characters as named.

    Precedence, the same on every path: an explicit value (flag, ``RLMEnv`` argument,
    harness knob) > its ``RLMQ_*`` variable > the default here."""

    model_config = SettingsConfigDict(
        env_prefix="RLMQ_", extra="forbid", populate_by_name=True, frozen=True, allow_inf_nan=False
    )
    """Frozen: built once and passed down; a changed value is a new object (:meth:`with_overrides`)."""

    # --- connections and secrets (the process's own; never travel) ------------------------
    redis_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("RLMQ_REDIS_URL", "REDIS_URL"),
        description="Redis URL of the fleet (also read from REDIS_URL)",
        json_schema_extra=meta(
            group="common",
            commands=("run", "worker", "status"),
            metavar="URL",
            default_text="run/demo start an embedded one; worker/status need one",
        ),
    )
    base_url: str | None = Field(
        default=None,
        description="OpenAI-compatible base URL: of the root model (run), of the model served (worker)",
        json_schema_extra=meta(group="common", commands=("run", "worker"), metavar="URL", required_by=("run",)),
    )
    model: str | None = Field(
        default=None,
        description="model name: the root model (run), the model served (worker; it names the queue)",
        json_schema_extra=meta(group="common", commands=("run", "worker"), metavar="NAME", required_by=("run",)),
    )
    api_key: SecretStr = Field(
        default=SecretStr("EMPTY"),
        validation_alias=AliasChoices("RLMQ_API_KEY", "OPENAI_API_KEY"),
        description="API key of the model server(s), also given to local workers (also read from OPENAI_API_KEY)",
        json_schema_extra=meta(group="common", commands=("run", "worker"), metavar="KEY", default_text="EMPTY"),
    )
    root_model_timeout: float = Field(
        default=600.0,
        gt=0,
        description="how long one HTTP call to the root model may take, for a top rollout (run) and a child "
        "rollout hosted by a worker (--repl-slots) alike",
        json_schema_extra=meta(commands=("run", "worker"), unit="seconds"),
    )
    sub_base_url: str | None = Field(
        default=None,
        description="model server that locally started workers call (rlmq run without a Redis URL)",
        json_schema_extra=meta(group="common", commands=("run",), metavar="URL", default_text="--base-url"),
    )
    queue: str | None = Field(
        default=None,
        description="RQ queue of the sub-LLM calls, the same on producer and worker",
        json_schema_extra=meta(
            group="common", commands=("run", "worker"), metavar="NAME", default_text="named from the (sub-)model"
        ),
    )
    tenant: str | None = Field(
        default=None,
        description="fair-share key of a producer: its jobs go to <queue>@<tenant>, served round-robin",
        json_schema_extra=meta(commands=("run",), metavar="NAME", default_text="this host's name"),
    )
    concurrency: int = Field(
        default=4,
        ge=1,
        description="rollouts run at once by rlmq run / rlmq demo",
        json_schema_extra=meta(group="common", commands=("run", "demo"), unit="rollouts"),
    )
    allow_evicting_redis: bool = Field(
        default=False,
        description="start even when Redis may evict keys (a maxmemory-policy other than noeviction): "
        "budget ledgers, jobs and results may then vanish",
        json_schema_extra=meta(commands=("run", "worker")),
    )
    redis_replica_acks: int | None = Field(
        default=None,
        ge=0,
        le=16,
        description="Redis replicas that must acknowledge (WAIT) every budget grant before its model call "
        "runs, so a replica promoted by a failover holds it; 0: none (asynchronous replication)",
        json_schema_extra=meta(
            commands=("run", "worker"), unit="replicas", default_text="1 with a Sentinel URL, else 0"
        ),
    )
    redis_replica_ack_timeout: float = Field(
        default=0.5,
        gt=0,
        le=5,
        description="how long a grant waits for the replicas' acknowledgement; unacknowledged, it is not "
        "used and is asked for again (until the call's deadline)",
        json_schema_extra=meta(commands=("run", "worker"), unit="seconds"),
    )

    num_examples: int | None = Field(
        default=None,
        ge=1,
        description="run only the first N rows of the dataset",
        json_schema_extra=meta(group="common", commands=("run",), aliases=("-n",), unit="rows", default_text="all"),
    )
    rollouts_per_example: int = Field(
        default=1,
        ge=1,
        description="rollouts of each dataset row",
        json_schema_extra=meta(group="common", commands=("run", "demo"), aliases=("-r",), unit="rollouts"),
    )
    preflight: bool = Field(
        default=True,
        description="before any rollout, check that the model servers answer and a worker serves the queue",
        json_schema_extra=meta(commands=("run",)),
    )
    preflight_timeout: float = Field(
        default=30.0,
        gt=0,
        description="how long each preflight check may take (a model server, the queue's workers: a worker "
        "started just before, say in the background of the same shell, takes seconds to register)",
        json_schema_extra=meta(commands=("run",), unit="seconds"),
    )
    token_ids_api: TokenIdsApi = Field(
        default="vllm",
        description="the model server's API for served token ids (include_sub_llm_in_trajectory): vllm (vLLM "
        ">= 0.10.2) or sglang (SGLang's chat shape since it answers response_token_ids); which fields are asked "
        "for and read: of the root model (run), of the model served (worker)",
        json_schema_extra=meta(commands=("run", "worker"), metavar="API"),
    )
    weight_versions: bool = Field(
        default=False,
        description="with include_sub_llm_in_trajectory, ask the model server which weight version sampled each "
        "completion token (vLLM's return_weight_versions) and keep the spans with each trainable turn",
        json_schema_extra=meta(commands=("run", "worker")),
    )
    max_sub_call_error_rate: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="fraction of sub-LLM calls (0..1) that may end in error before rlmq run exits 6",
        json_schema_extra=meta(commands=("run", "demo"), unit="fraction of sub-calls", metavar="FRACTION"),
    )

    def token_api(self) -> TokenApi:
        """How this process asks its model server for served tokens (``token_ids_api``, ``weight_versions``)."""
        return TokenApi(self.token_ids_api, self.weight_versions)

    def rollout_options(self) -> RolloutOptions:
        """This process's rollout options: the :class:`RolloutOptions` fields of these settings."""
        return RolloutOptions.model_validate(self.model_dump(include=set(RolloutOptions.model_fields)))

    def with_overrides(self, **overrides: Any) -> Settings:
        """A copy with ``overrides`` (field name -> value) applied and the whole validated again.

        Raises:
            ConfigError: an override names no field, or a value is invalid.
        """
        return self.with_values(overrides)

    def with_values(self, overrides: Mapping[str, Any], label: Callable[[str], str] = str) -> Settings:
        """:meth:`with_overrides`, an error naming a field as ``label(field)`` (an argument).

        Raises:
            ConfigError: an override names no field, or a value is invalid.
        """
        if not overrides:
            return self
        return validated(type(self), overrides, label, base=self.model_dump())

    def sub_queue(self) -> str:
        """The queue the producer enqueues sub-LLM jobs on.

        Raises:
            ConfigError: neither ``queue`` nor a model is set.
        """
        if self.queue:
            return self.queue
        model = self.sub_model or self.model
        if not model:
            raise ConfigError("set --queue or --model / --sub-model to name the sub-LLM queue")
        return queue_name_for_model(model)

    def producer_queue(self, sub_model: str | None = None) -> str:
        """The tenant queue this producer enqueues on (``<queue>@<tenant>``).

        Raises:
            ConfigError: no queue and no model.
        """
        import socket

        base = self.queue or (queue_name_for_model(sub_model) if sub_model else self.sub_queue())
        return tenant_queue(base, self.tenant if self.tenant is not None else socket.gethostname())

    def worker_queue(self) -> str:
        """The queue a worker serves (``--queue`` or derived from ``--model``).

        Raises:
            ConfigError: neither ``queue`` nor ``model`` is set.
        """
        if self.queue:
            return self.queue
        if not self.model:
            raise ConfigError("set --model (or --queue) for the worker")
        return queue_name_for_model(self.model)


def build_settings(values: Mapping[str, Any], label: Callable[[str], str] = str) -> Settings:
    """:class:`Settings` from explicit ``values`` (field name -> value) over the ``RLMQ_*``
    environment over the defaults: the one precedence of every path.

    Args:
        values: the explicit values; every key is used, ``None`` included (it means ``None``).
        label: how the caller names a field in an error (``--max-turns`` on the command line).

    Raises:
        ConfigError: one line naming each bad value as the user wrote it (``label(field)``,
            or the ``RLMQ_*`` variable it came from).
    """
    return validated(Settings, values, label)


def env_vars(name: str) -> list[str]:
    """The environment variables of the :class:`Settings` field ``name``, first one first."""
    return field_env_vars(Settings.model_fields, name)


def setting_default(name: str) -> Any:
    """The declared default of the setting ``name``, for a lower layer's signature to refer to
    (as httpx refers to ``DEFAULT_TIMEOUT_CONFIG``) instead of typing the value again.

    Raises:
        KeyError: ``name`` is no :class:`Settings` field.
    """
    return Settings.model_fields[name].get_default(call_default_factory=True)


def load_settings(**overrides: Any) -> Settings:
    """Build the settings from ``overrides`` (flags; ``None`` values are ignored) over the env.

    Raises:
        ConfigError: a value is invalid (named by its field, or its ``RLMQ_*`` variable).
    """
    return build_settings({k: v for k, v in overrides.items() if v is not None})
