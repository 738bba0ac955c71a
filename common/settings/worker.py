"""What only a sub-LLM worker process reads: the ``rlmq worker`` half of the one settings object.

:class:`rlmq.common.settings.Settings` inherits these fields beside the rollout's own
(:class:`~rlmq.common.settings.RolloutOptions`): one flat object, built once at start-up. They
are declared here only to keep each module short; nothing reads them from here but
:mod:`rlmq.common.settings`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rlmq.common.settings.fields import meta


class WorkerOptions(BaseModel):
    """What only a sub-LLM worker process reads (flags of ``rlmq worker``). Times in seconds."""

    model_config = ConfigDict(allow_inf_nan=False)

    worker_concurrency: int = Field(
        default=256,
        ge=1,
        description="sub-calls in flight in one worker process",
        json_schema_extra=meta(group="common", unit="sub-calls", flag="--concurrency"),
    )
    model_timeout: float = Field(
        default=120.0,
        gt=0,
        description="how long one HTTP call to the model server may take",
        json_schema_extra=meta(unit="seconds"),
    )
    model_retries: int = Field(
        default=3,
        ge=0,
        description="retries of a failed model call (429, 5xx, timeouts, resets)",
        json_schema_extra=meta(unit="retries"),
    )
    heartbeat_interval: float = Field(
        default=1.0, gt=0, description="how often a worker heartbeats", json_schema_extra=meta(unit="seconds")
    )
    job_heartbeat_ttl: int = Field(
        default=10,
        ge=2,
        description="a started job whose worker has not heartbeated for this long is taken back; a worker "
        "heartbeats at least 4 times per this TTL (every min(heartbeat_interval, TTL / 4) s, on a fixed rate), so "
        "only a host whose event loop stalled for 3/4 of it is declared dead",
        json_schema_extra=meta(unit="seconds", flag="--heartbeat-ttl"),
    )
    job_max_attempts: int = Field(
        default=2,
        ge=1,
        description="attempts of a sub-call job whose worker died",
        json_schema_extra=meta(unit="attempts"),
    )
    result_ttl: int = Field(
        default=600,
        ge=0,
        description="how long RQ keeps finished jobs (rq info and rq-dashboard show them)",
        json_schema_extra=meta(unit="seconds"),
    )
    sub_llm_budget_max_parked: int | None = Field(
        default=None,
        ge=0,
        description=(
            "budgeted calls waiting for a release that a worker does not count against its concurrency; "
            "past that, waiters hold slots (a parked call costs memory only, never a model call)"
        ),
        json_schema_extra=meta(group="budget", unit="sub-calls", default_text="4 x --concurrency"),
    )
    sub_llm_budget_grant_lease: float = Field(
        default=5.0,
        gt=0,
        le=300,
        description=(
            "a budget grant whose model call has not begun this long after it was granted (the job was "
            "cancelled or lost its START, or its worker died first) goes back to the budget"
        ),
        json_schema_extra=meta(unit="seconds"),
    )
    provider_rpm: int | None = Field(
        default=None,
        ge=1,
        description="requests per window (--provider-window, a minute by default) the upstream allows this whole "
        "fleet: every worker of the upstream on every host shares it, counted in Redis by Redis's clock",
        json_schema_extra=meta(group="provider", unit="requests per window", default_text="no limit"),
    )
    provider_tpm: int | None = Field(
        default=None,
        ge=1,
        description="tokens per window the upstream allows this whole fleet: a call counts its prompt (estimated, "
        "characters / 4) and its max_tokens before it starts, corrected to the usage it reported after",
        json_schema_extra=meta(group="provider", unit="tokens per window", default_text="no limit"),
    )
    provider_max_concurrent: int | None = Field(
        default=None,
        ge=1,
        description="requests the upstream runs at once for this whole fleet",
        json_schema_extra=meta(group="provider", unit="requests", default_text="no limit"),
    )
    provider_upstream: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9._@+-]{1,64}$",
        description="the name the limits are counted under: give the same name to the workers of several queues "
        "that share one API key or deployment",
        json_schema_extra=meta(group="provider", metavar="NAME", default_text="the worker's model queue"),
    )
    provider_window: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="the window of --provider-rpm and --provider-tpm (a minute for per-minute limits)",
        json_schema_extra=meta(group="provider", unit="seconds"),
    )
    provider_window_margin: float = Field(
        default=0.5,
        ge=0,
        le=60,
        description="how much longer than the window a grant is counted, so that the provider (whose clock and "
        "arrival times differ by network delays) never sees more than its limit in its own window",
        json_schema_extra=meta(group="provider", unit="seconds"),
    )
    allowed_sub_tools: list[str] = Field(
        default_factory=list,
        description="a sub-tool this worker may run, a dotted import path (repeatable; a job asking for others fails)",
        json_schema_extra=meta(group="repl", flag="--allow-tool", metavar="DOTTED.PATH", default_text="none"),
    )
    lane_early_calls: bool = Field(
        default=True,
        description="start the calls a lane entry carries (and their budget reservations) before START "
        "confirms the jobs; turn off when producers of different tenants share the fleet (the lane is not "
        "confined to a tenant)",
    )
    repl_slots: int = Field(
        default=0,
        ge=0,
        description="child rollouts (rlm_batch) this worker hosts at once PER DEPTH, each with its own REPL; "
        "0: it hosts none. A host needs a contained REPL (own uid, no network, private file system: run it as "
        "root with namespaces) or --allow-uncontained-repl",
        json_schema_extra=meta(group="common", unit="child rollouts per depth"),
    )
    turn_token_max_ids: int = Field(
        default=262_144,
        ge=1,
        description="token ids (prompt + completion) one model turn's record carries off a worker; a reply with "
        "more is untrainable (too_many_ids), its ids dropped before they reach Redis, its answer kept",
        json_schema_extra=meta(group="repl", unit="token ids"),
    )
    sub_llm_continuation: Literal["continue_final_message", "prefill", "none"] = Field(
        default="continue_final_message",
        description=(
            "how this worker's model server continues an answer past a budget segment: continue_final_message "
            "(vLLM, SGLang: the partial answer as the last assistant message, continue_final_message true, "
            "add_generation_prompt false), prefill (llama.cpp: a last assistant message is a prefill), or none "
            "(a server that cannot: every budgeted call is granted its whole cap before it starts)"
        ),
        json_schema_extra=meta(group="budget", flag="--continuation"),
    )
    frozen_fleet: bool = Field(default=False, description="this worker's server is not the trained policy: its "
        "turns are untrainable (frozen_fleet)", json_schema_extra=meta(group="common", flag="--frozen"))  # fmt: skip
    allow_uncontained_repl: bool = Field(
        default=False,
        description="host child rollouts even when the REPL sandbox is NOT fully contained on this host: code the "
        "models write then runs with this worker's network, files or user (which hold Redis write rights and "
        "model keys)",
        json_schema_extra=meta(group="recursion"),
    )
