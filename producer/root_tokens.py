"""The root model's turns as trainable steps (``include_sub_llm_in_trajectory``).

With the option on, each root call asks the server for the served token ids and logprobs with
its server's fields (:meth:`~rlmq.common.token_servers.TokenApi.request_fields`, in the request
body beside the sampling arguments) and each ``root`` trajectory event keeps them as a
:class:`~rlmq.common.token_wire.TurnTokens` (``tokens``), prefix-shared with the rollout's
previous root turn and under its byte cap. The same code runs a top rollout's root turns
(``rlmq run``) and a child rollout's, on its REPL host.
"""

from __future__ import annotations

from typing import Any

from rlmq.common.settings import setting_default
from rlmq.common.token_servers import KNOWN_TOKEN_APIS, sampled_with
from rlmq.common.token_wire import (
    completion_id_count,
    served_tokens,
    served_unless_frozen,
    tokens_asked,
    validate_served,
)
from rlmq.producer.rollout import Rollout

__all__ = ["ask_for_tokens", "root_turn_tokens", "served_completion_ids"]

ROOT_TURN_MAX_IDS: int = setting_default("turn_token_max_ids")
"""Most token ids one root turn's record keeps (the workers' default bound, ``turn_token_max_ids``)."""

_NOT_SAMPLING = frozenset({"model", "messages", "tools", "extra_body"})


def ask_for_tokens(rollout: Rollout, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` of a root call (``chat.completions.create``), asking for the served tokens when
    the rollout's option is on (merged into ``extra_body``); unchanged when it is off."""
    if not tokens_asked(rollout.options.include_sub_llm_in_trajectory, rollout.frozen):
        return kwargs
    return {**kwargs, "extra_body": {**(kwargs.get("extra_body") or {}), **rollout.token_api.request_fields()}}


def _body(resp: Any) -> dict[str, Any]:
    """A chat completion as a dict: an ``openai`` object (its extra fields, such as vLLM's
    ``prompt_token_ids``, included) or a dict."""
    if isinstance(resp, dict):
        return resp
    dump = getattr(resp, "model_dump", None)
    out = dump() if callable(dump) else None
    return out if isinstance(out, dict) else {}


def root_turn_tokens(
    rollout: Rollout, resp: Any, kwargs: dict[str, Any], usage: tuple[int, int] | None
) -> dict[str, Any] | None:
    """The ``tokens`` record of one root turn (a dumped ``TurnTokens``), ``None`` with the option off.

    Args:
        rollout: the rollout (its root-turn encoder, its byte cap).
        resp: the chat completion.
        kwargs: what the call sent (its sampling: ``max_tokens``, ``extra_body`` minus the token fields).
        usage: ``(prompt_tokens, completion_tokens)`` the server reported, ``None`` when it sent none.
    """
    if not rollout.options.include_sub_llm_in_trajectory:
        return None
    api = rollout.token_api
    sampling = {k: v for k, v in kwargs.items() if k not in _NOT_SAMPLING}
    extra = {k: v for k, v in (kwargs.get("extra_body") or {}).items() if k not in api.request_fields()}
    body = _body(resp)
    served, reason = served_unless_frozen(rollout.frozen, lambda: served_tokens(body, usage, api))
    rollout.token_fields_log.note(body, api, reason, served is not None and served.versions is not None)
    cap = kwargs.get("max_tokens", kwargs.get("max_completion_tokens"))
    cap = cap if isinstance(cap, int) and not isinstance(cap, bool) else None
    served, reason = validate_served(served, reason, max_tokens=cap, max_ids=ROOT_TURN_MAX_IDS)
    sent = {**extra, **sampling}
    record = rollout.root_tokens.encode(rollout.stats.root_turns, served, reason, sent, sampled_with(sent, api))
    return rollout.token_cap.admit(record).model_dump()


def served_completion_ids(resp: Any) -> int:
    """How many completion ids a root reply ``resp`` carried, read where any server rlmq knows
    writes them (vLLM's ``choices[0].token_ids``, SGLang's ``choices[0].response_token_ids``; the
    most of them, 0 when none): the least its turn is charged, whatever its ``usage`` says."""
    body = _body(resp)
    return max((completion_id_count(body, api) or 0 for api in KNOWN_TOKEN_APIS), default=0)
