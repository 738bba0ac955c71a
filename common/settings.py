"""The one settings object of rlmq.

Built once at start-up from command-line flags (passed as keyword arguments) over
``RLMQ_*`` environment variables over the defaults below, then passed down. Nothing
in rlmq reads the environment anywhere else. ``REDIS_URL`` is accepted as well as
``RLMQ_REDIS_URL``; ``OPENAI_API_KEY`` as well as ``RLMQ_API_KEY``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rlmq.common.errors import ConfigError, validation_summary
from rlmq.common.keys import queue_name_for_model, tenant_queue

Verbosity = Literal["light", "medium", "heavy"]

BUDGET_ZERO = (
    "sub_llm_max_completion_tokens (--sub-llm-max-completion-tokens) must be >= 1: a budget of 0 "
    "would refuse every sub-LLM call; leave it unset for no budget"
)


class Settings(BaseSettings):
    """Every knob of rlmq, for producer and worker alike. Times in seconds, sizes in tokens
    (completion tokens) or characters as named."""

    model_config = SettingsConfigDict(env_prefix="RLMQ_", extra="forbid", populate_by_name=True, frozen=True)
    """Frozen: built once and passed down; a changed value is a new object (:meth:`with_overrides`)."""

    # --- connections -------------------------------------------------------------------
    redis_url: str | None = None
    """Redis to use; ``None`` starts an embedded one (``rlmq demo`` / ``rlmq run``)."""
    base_url: str | None = None
    """OpenAI-compatible base URL of the root model (producer) or the served model (worker)."""
    model: str | None = None
    api_key: SecretStr = Field(
        default=SecretStr("EMPTY"), validation_alias=AliasChoices("api_key", "RLMQ_API_KEY", "OPENAI_API_KEY")
    )
    sub_model: str | None = None
    sub_base_url: str | None = None
    """Where locally started workers send sub-LLM calls (``rlmq run`` without REDIS_URL)."""
    queue: str | None = None
    """RQ queue name; by default derived from the (sub-)model name, the same on both sides."""
    tenant: str | None = None
    """Fair-share key of a producer: its jobs go to ``<queue>@<tenant>``, which workers serve
    round-robin with the other tenants of the same queue. ``None``: this host's name."""

    # --- rollout (producer) ------------------------------------------------------------
    max_turns: int = Field(default=50, ge=1)
    sub_llm_max_turns: int = Field(default=5, ge=1)
    sub_llm_max_completion_tokens: int | None = Field(default=None, ge=1)
    """The rollout's sub-LLM budget (completion tokens), hard across all workers; ``None``: none.
    0 is refused (it would refuse every sub-LLM call): leave it unset for no budget."""
    sub_llm_per_call_max_tokens: int | None = Field(default=None, ge=1)
    """``max_tokens`` of every sub-LLM model call; with a budget, also the largest grant."""
    sub_llm_budget_grant_tokens: int = Field(default=512, ge=1)
    """With a budget and no ``sub_llm_per_call_max_tokens``: the largest grant of one model call
    (tokens); the cap of a rollout is :func:`rlmq.common.ledger.default_cap` of its budget (an
    eighth of it, at least 128, at most this). A call waits while less than half its cap is free
    and running calls may give tokens back."""
    root_max_completion_tokens: int | None = Field(default=None, ge=1)
    max_sub_llm_parallelism: int = Field(default=64, ge=1)
    max_output_length: int = Field(default=8192, ge=100)
    code_execution_timeout: float = Field(default=120.0, gt=0)
    max_startup_wait_seconds: float = Field(default=120.0, gt=0)
    rollout_timeout: float = Field(default=3600.0, gt=0)
    """Wall-clock deadline of one whole rollout (seconds); past it the rollout ends in ``error``."""
    sub_call_timeout: float = Field(default=300.0, gt=0)
    """Deadline of one sub-call, from enqueue to result (seconds)."""
    concurrency: int = Field(default=4, ge=1)
    """Rollouts run at once by ``rlmq run`` / ``rlmq demo`` (a worker's in-flight sub-calls are
    ``worker_concurrency``; ``rlmq worker --concurrency`` sets that one)."""
    root_prompt_verbosity: Verbosity = "light"
    sub_prompt_verbosity: Verbosity = "light"
    sub_tools: list[str] = Field(default_factory=list)
    """Dotted import paths of tools the sub-LLMs may call (the workers must allow-list them)."""
    pip_install_packages: list[str] = Field(default_factory=list)
    """Packages installed into each rollout's REPL."""
    include_sub_llm_in_trajectory: bool = False
    """Keep every sub-LLM's own conversation in the trajectory."""
    rollout_key_ttl: int = Field(default=3600, ge=10)
    max_batch_prompts: int = Field(default=10_000, ge=1)
    max_batch_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)

    # --- worker --------------------------------------------------------------------------
    worker_concurrency: int = Field(default=256, ge=1)
    model_timeout: float = Field(default=120.0, gt=0)
    """Seconds one HTTP call to the model server may take."""
    model_retries: int = Field(default=3, ge=0)
    """Retries of a failed model call (429, 5xx, timeouts, resets) by rlmq's one retry layer."""
    heartbeat_interval: float = Field(default=1.0, gt=0)
    job_heartbeat_ttl: int = Field(default=10, ge=2)
    """A started job whose worker has not heartbeated for this long is abandoned (seconds)."""
    job_max_attempts: int = Field(default=2, ge=1)
    result_ttl: int = Field(default=600, ge=0)
    """How long RQ keeps finished jobs (seconds); ``rq info`` and rq-dashboard show them."""
    sub_llm_budget_max_parked: int | None = Field(default=None, ge=0)
    """Budgeted calls waiting for a release that a worker does not count against its in-flight
    concurrency (default: 4 x ``worker_concurrency``); past that, waiters hold slots. A parked
    call costs memory only (its request), never a model call."""
    allowed_sub_tools: list[str] = Field(default_factory=list)
    """Dotted import paths of sub-tools this worker may run (a job asking for others fails)."""

    def with_overrides(self, **overrides: Any) -> Settings:
        """A copy with ``overrides`` (field name -> value) applied and the whole validated again.

        Raises:
            ConfigError: an override names no field, or a value is invalid.
        """
        from pydantic import ValidationError

        unknown = sorted(set(overrides) - set(type(self).model_fields))
        if unknown:
            raise ConfigError(f"unknown setting(s): {', '.join(unknown)}")
        if not overrides:
            return self
        try:
            return type(self).model_validate({**self.model_dump(), **overrides})
        except ValidationError as exc:
            raise ConfigError(invalid_settings(exc)) from exc

    @field_validator("sub_llm_max_completion_tokens", mode="before")
    @classmethod
    def _no_zero_budget(cls, value: Any) -> Any:
        if value is not None and str(value).strip() == "0":
            raise ValueError(BUDGET_ZERO)
        return value

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


def invalid_settings(exc: Any) -> str:
    """One line for a pydantic ``ValidationError`` of :class:`Settings`: ``field: message; ...``."""
    return f"invalid setting(s): {validation_summary(exc, 'settings')}"


def load_settings(**overrides: Any) -> Settings:
    """Build the settings from ``overrides`` (flags; ``None`` values are ignored) over the env.

    Raises:
        ConfigError: a value is invalid.
    """
    import os

    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    values = {k: v for k, v in overrides.items() if v is not None}
    if "redis_url" not in values and "RLMQ_REDIS_URL" not in os.environ and os.environ.get("REDIS_URL"):
        values["redis_url"] = os.environ["REDIS_URL"]
    try:
        return Settings(**values)
    except ValidationError as exc:  # a bad flag value
        raise ConfigError(invalid_settings(exc)) from exc
    except SettingsError as exc:  # an RLMQ_* variable that is not JSON
        raise ConfigError(str(exc)) from exc
