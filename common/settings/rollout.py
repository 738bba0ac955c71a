"""What one rollout needs, and may carry to another host: the per-rollout half of the one settings object.

:class:`rlmq.common.settings.Settings` inherits these fields beside the process's own and a
worker's own (:class:`~rlmq.common.settings.worker.WorkerOptions`): one flat object, built once at
start-up. They are declared here only to keep each module short; import them from
:mod:`rlmq.common.settings`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlmq.common.sampling import DEFAULT_CALL_MAX_TOKENS
from rlmq.common.schemas import SUB_LLM_MAX_TURNS_DEFAULT, SUB_LLM_MAX_TURNS_LIMIT, normalize_sampling
from rlmq.common.settings.fields import meta
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
    rollout_key_ttl: int = Field(default=3600, ge=10, description="how long a rollout's Redis keys (its budget "
        "ledger, its batches' reply streams) live without a refresh (refreshed while it runs)",
        json_schema_extra=meta(unit="seconds"))  # fmt: skip
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
