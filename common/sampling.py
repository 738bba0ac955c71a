"""How a rollout's sub-calls and child root turns sample: its sampling arguments, overridden by its
sub-sampling arguments, and the per-call ``max_tokens`` (the budget's per-call cap).

As in the reference (verifiers' ``RLMEnv``, #966 / 0.1.14), sub-LLM calls sample with the
rollout's own sampling arguments (set by the trainer: ``temperature``, ``top_p``, ``max_tokens``,
``extra_body``); ``sub_sampling_args`` (``--sub-sampling-args``) overrides them key by key, and
``sub_llm_per_call_max_tokens`` overrides the ``max_tokens`` of both. A sub-call is never sent
without a ``max_tokens``: with none of them set it gets :data:`DEFAULT_CALL_MAX_TOKENS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlmq.common.schemas import SUB_RESERVED_SAMPLING

if TYPE_CHECKING:
    from rlmq.common.settings import RolloutOptions

__all__ = ["DEFAULT_CALL_MAX_TOKENS", "child_root_sampling", "root_turn_max_tokens", "sub_call_max_tokens",
           "sub_call_sampling"]  # fmt: skip

DEFAULT_CALL_MAX_TOKENS = 2048
"""Completion tokens of one sub-LLM call (and, under a root budget, of one root turn) when no
sampling argument sets ``max_tokens``. Fits the answers sub-calls give (a summary, an extraction,
a JSON object: hundreds to about 1,500 tokens), and is small enough that a budget of 20,000 runs
nine whole calls at once (a budget pays ``budget // cap`` whole calls at a time)."""


def _max_tokens(args: Mapping[str, Any]) -> int | None:
    value = args.get("max_tokens")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def sub_call_max_tokens(options: RolloutOptions) -> int:
    """The ``max_tokens`` of every sub-LLM call of a rollout, also its budget's per-call cap (tokens).

    The first set of: ``sub_llm_per_call_max_tokens``, the sub-sampling arguments' ``max_tokens``,
    the rollout's sampling arguments' ``max_tokens`` (the reference's: sub-calls inherit it),
    else :data:`DEFAULT_CALL_MAX_TOKENS`.
    """
    for value in (
        options.sub_llm_per_call_max_tokens,
        _max_tokens(options.sub_sampling_args),
        _max_tokens(options.sampling_args),
    ):
        if value is not None:
            return value
    return DEFAULT_CALL_MAX_TOKENS


def sub_call_sampling(options: RolloutOptions) -> dict[str, Any]:
    """The sampling fields every sub-LLM call of a rollout sends besides ``max_tokens``: the
    rollout's sampling arguments, overridden key by key by its sub-sampling arguments; fields a
    sub-call may not carry (:data:`~rlmq.common.schemas.SUB_RESERVED_SAMPLING`: ``max_tokens`` is
    :func:`sub_call_max_tokens`, ``user`` is the rollout's id) are left out."""
    merged = {k: v for k, v in options.sampling_args.items() if k not in SUB_RESERVED_SAMPLING}
    merged.update({k: v for k, v in options.sub_sampling_args.items() if k not in SUB_RESERVED_SAMPLING})
    return merged


def child_root_sampling(options: RolloutOptions) -> dict[str, Any]:
    """The sampling arguments of a child rollout's root turns (its ``sampling_args``): its
    parent's sub-call sampling, with ``max_tokens`` the sub-sampling arguments', else the
    parent's sampling arguments', else :data:`DEFAULT_CALL_MAX_TOKENS` (a root turn writes code:
    ``sub_llm_per_call_max_tokens``, the cap of one sub-LLM answer, is not a root turn's). The
    same again for a grandchild (the merge is idempotent)."""
    per_turn = _max_tokens(options.sub_sampling_args) or _max_tokens(options.sampling_args)
    return {**sub_call_sampling(options), "max_tokens": per_turn or DEFAULT_CALL_MAX_TOKENS}


def root_turn_max_tokens(options: RolloutOptions) -> int | None:
    """The ``max_tokens`` of one root turn (tokens): the sampling arguments' ``max_tokens``, else
    ``None`` (the server's own default); under ``root_max_completion_tokens``, that or
    :data:`DEFAULT_CALL_MAX_TOKENS`, at most the limit (so that a turn is granted whole or not
    started, and a limit below the sampling ``max_tokens`` still gets one whole turn)."""
    per_call = _max_tokens(options.sampling_args)
    limit = options.root_max_completion_tokens
    if limit is not None:
        per_call = min(per_call or DEFAULT_CALL_MAX_TOKENS, limit)
    return per_call
