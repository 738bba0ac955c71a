"""``rlmq.common.settings``: the one settings object of rlmq.

Built once at start-up from command-line flags (passed as keyword arguments) over
``RLMQ_*`` environment variables over the defaults below, then passed down. Nothing
in rlmq reads the environment anywhere else. ``REDIS_URL`` is accepted as well as
``RLMQ_REDIS_URL``; ``OPENAI_API_KEY`` as well as ``RLMQ_API_KEY``.

What it owns: the declaration (here: :class:`Settings`, :func:`load_settings`,
:func:`setting_default`), a rollout's own fields (:mod:`.rollout`, :class:`RolloutOptions`), a
worker's own (:mod:`.worker`), the field metadata and error lines (:mod:`.fields`) and every
setting as one record, for flags and docs (:mod:`.schema`; ``python -m rlmq.common.settings.schema``
writes ``docs/settings.md``).

What it may import (held by ``tests/unit/test_layout.py``): the flat modules of
:mod:`rlmq.common` only; never :mod:`rlmq.common.budget` or :mod:`rlmq.common.jobs` (both read
their defaults from here), ``producer`` or ``workers``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from rlmq.common.errors import ConfigError
from rlmq.common.keys import queue_name_for_model, tenant_queue
from rlmq.common.settings.fields import field_env_vars, meta, validated
from rlmq.common.settings.rollout import BUDGET_ZERO as BUDGET_ZERO
from rlmq.common.settings.rollout import ReplLanguage as ReplLanguage
from rlmq.common.settings.rollout import RolloutOptions as RolloutOptions
from rlmq.common.settings.rollout import SystemPromptMode as SystemPromptMode
from rlmq.common.settings.rollout import Verbosity as Verbosity
from rlmq.common.settings.worker import WorkerOptions
from rlmq.common.token_servers import TokenApi, TokenIdsApi


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
