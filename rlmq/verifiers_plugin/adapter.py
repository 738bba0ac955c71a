"""The one place the verifiers plug-in touches rlmq's rollout API.

Everything verifiers-specific lives in :mod:`rlmq.verifiers_plugin.harness` and
:mod:`rlmq.verifiers_plugin.taskset`; this module imports nothing from verifiers, so it is
the thin seam between the two. It relies on exactly these rlmq calls:

* from the public API (``rlmq/__init__.py``): ``load_settings`` (keyword overrides over
  ``RLMQ_*`` / ``REDIS_URL``), ``DatasetRow``, ``ResultRow``, ``ConfigError``,
* ``RLMEnv(settings=..., max_turns=..., ...)`` with the reference's keyword arguments,
  used as ``async with`` (``start()`` / ``close()``),
* ``RLMEnv.rollout(row, model=..., rollout_id=...)`` returning a ``RolloutResult`` whose
  ``row`` is a :class:`~rlmq.ResultRow` and whose ``trajectory`` is a list of
  JSON-able event dicts,
* :func:`rlmq.normalize_answer` (the exact-match rule of ``correct``).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from rlmq import ConfigError, DatasetRow, ResultRow, RLMEnv, load_settings, normalize_answer

__all__ = [
    "RolloutKnobs", "RolloutOutcome", "exact_match", "rollout_env", "rollout_id_for", "run_rollout", "STOP_CONDITIONS",
]  # fmt: skip

_ROLLOUT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")

STOP_CONDITIONS: dict[str, str | None] = {
    "answer_ready": None,  # the normal end: verifiers stamps its own ``agent_completed``
    "max_turns": "max_turns",  # verifiers' truncation name (``Trace.is_truncated``)
    "no_tool_call": "no_tool_call",  # the root answered without code; like a ``@stop`` name
    "prompt_too_long": "prompt_too_long",  # the reference RLMEnv's name for a refused long prompt
    "code_timeout": "code_timeout",  # a timed-out cell ended it (abort_on_code_timeout)
    "error": None,  # reported as a failed program instead (the trace records the error)
}
"""rlmq ``stop_reason`` -> the verifiers trace's ``stop_condition`` set by the harness."""


@dataclass
class RolloutKnobs:
    """What one rollout needs besides the row: the rlmq settings and ``RLMEnv`` arguments.

    Attributes:
        settings: keyword overrides for :func:`~rlmq.load_settings`
            (``None`` values are ignored, so ``RLMQ_*`` / ``REDIS_URL`` fill them).
        env_args: keyword arguments of ``RLMEnv`` (``max_turns``, ``sub_model``, ...): only
            those given, so that the ``RLMQ_*`` variables and rlmq's defaults fill the rest.
    """

    settings: dict[str, Any] = field(default_factory=dict)
    env_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutOutcome:
    """A finished rlmq rollout, as the harness hands it to verifiers.

    Attributes:
        row: rlmq's result row (``final_answer``, ``stop_reason``, ``metrics``, ``error``).
        metrics: the row's metrics as floats (verifiers' ``Trace.metrics`` are floats).
        trajectory: rlmq's events (root turns, REPL cells, ``llm_batch`` summaries).
    """

    row: ResultRow
    metrics: dict[str, float]
    trajectory: list[dict[str, Any]]


async def run_rollout(
    row: DatasetRow,
    *,
    model: str,
    base_url: str,
    api_key: str,
    rollout_id: str,
    knobs: RolloutKnobs,
) -> RolloutOutcome:
    """Run one rlmq rollout of ``row`` whose root-model calls go to ``base_url`` with ``api_key``.

    One ``RLMEnv`` per rollout: the root endpoint's bearer token differs per rollout under
    verifiers, and an ``RLMEnv`` holds one root client. Starting one costs a Redis
    connection and a local interception server (milliseconds).

    Args:
        row: the dataset row (``question`` becomes the first user message, verbatim).
        model: the root model name sent to ``base_url``.
        base_url: OpenAI-compatible base URL of the root model (verifiers' ``endpoint``).
        api_key: bearer token for ``base_url`` (verifiers' ``secret``).
        rollout_id: rlmq's rollout id (``[A-Za-z0-9_-]{1,64}``); sub-calls carry it as their
            session id (the ``X-Session-ID`` header the workers send).
        knobs: settings and ``RLMEnv`` arguments.

    Returns:
        The outcome; a failure inside the rollout is ``row.stop_reason == "error"``.

    Raises:
        ConfigError: a setting is invalid or the Redis URL is missing.
        redis.exceptions.RedisError, OSError: Redis cannot be reached at start.
    """
    async with rollout_env(knobs, model=model, base_url=base_url, api_key=api_key) as env:
        result = await env.rollout(row, model=model, rollout_id=rollout_id)
    metrics = {k: float(v) for k, v in result.row.metrics.items() if isinstance(v, int | float)}
    return RolloutOutcome(row=result.row, metrics=metrics, trajectory=result.trajectory)


def rollout_env(knobs: RolloutKnobs, *, model: str, base_url: str, api_key: str) -> RLMEnv:
    """The (unstarted) ``RLMEnv`` of one harness rollout: ``knobs`` over the ``RLMQ_*``
    variables over rlmq's defaults, the root model at ``base_url``.

    Raises:
        ConfigError: a setting is invalid or no Redis URL is set.
    """
    settings = load_settings(**{**knobs.settings, "base_url": base_url, "api_key": api_key, "model": model})
    if not settings.redis_url:
        raise ConfigError(
            "no Redis for the sub-LLM fleet: set REDIS_URL (or RLMQ_REDIS_URL), "
            "or --env.agent.harness.redis-url under verifiers"
        )
    return RLMEnv(settings=settings, **knobs.env_args)


def rollout_id_for(trace_id: str) -> str:
    """rlmq's rollout id for a verifiers trace: the trace id itself (a uuid4 hex by default),
    or a fresh uuid4 hex when the trace id is not a valid rollout id (``[A-Za-z0-9_-]{1,64}``;
    then the sub-calls' session id differs from verifiers' own)."""
    return trace_id if _ROLLOUT_ID.fullmatch(trace_id) else uuid.uuid4().hex


def exact_match(reply: str | None, answer: str | None) -> float:
    """1.0 when ``reply`` equals ``answer`` after rlmq's normalisation (case, whitespace,
    outer punctuation), else 0.0; 0.0 when either is missing. Same rule as rlmq's ``correct``."""
    if reply is None or answer is None:
        return 0.0
    return 1.0 if normalize_answer(reply) == normalize_answer(answer) else 0.0
