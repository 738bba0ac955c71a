"""Each model server's own fields for served token ids, weight versions and default sampling.

Trainable turns (``include_sub_llm_in_trajectory``) need what the server served: its prompt ids,
completion ids and logprobs. No two servers name them alike, and a name changes between releases,
so each is read exactly as that server's current release writes it (its OpenAI protocol module),
never by guessing among names:

* ``vllm`` (``vllm/entrypoints/openai/chat_completion/protocol.py``, vLLM >= 0.10.2): asked with
  ``logprobs: true`` and ``return_token_ids: true``; answers the prompt ids at the top of the
  reply (``prompt_token_ids``) and the completion ids on the choice (``choices[0].token_ids``).
  With ``return_weight_versions: true`` (vLLM's async-RL weight provenance) each choice also
  carries ``weight_versions``: ``[{"version": label, "start": i, "end": j}, ...]``, the
  completion tokens ``[i, j)`` sampled by the weights labelled ``label``, in order, covering them.
* ``sglang`` (``sglang/srt/entrypoints/openai/protocol.py``, ``ChatCompletionResponseChoice``,
  0.5.23): asked with ``logprobs``, ``return_token_ids`` and ``return_prompt_token_ids``
  (refused with ``stream``, which rlmq never sends); answers both lists on the choice:
  ``choices[0].prompt_token_ids`` and ``choices[0].response_token_ids`` (the name since SGLang
  renamed the chat choice's ``token_ids``; an older release's ``token_ids`` is not read). Its
  reply's ``metadata.weight_version`` is one label per reply, not spans: it is not read.

Both put the logprobs at ``choices[0].logprobs.content[i].logprob`` (OpenAI's shape). A reply
without the fields of its server gives an untrainable turn (``no_token_ids``), and the process
says so once (:class:`TokenFieldsLog`), naming the id fields the reply did have.

When a request sets no ``temperature`` or ``top_p``, the server samples at its default: both
servers take the served model's ``generation_config.json`` first (vLLM's
``--generation-config auto``, its default; SGLang's ``to_sampling_params``), else 1.0 and 1.0
(:data:`SERVER_SAMPLING_DEFAULTS`). :func:`sampled_with` records which applied.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

__all__ = [
    "SERVER_SAMPLING_DEFAULTS", "TokenApi", "TokenFields", "TokenFieldsLog", "TokenIdsApi", "VersionSpan",
    "check_versions", "id_fields", "sampled_with",
]  # fmt: skip

log = logging.getLogger("rlmq.model")

TokenIdsApi = Literal["vllm", "sglang"]
"""The servers whose token fields rlmq reads."""

TOKEN_IDS_APIS: tuple[str, ...] = get_args(TokenIdsApi)

VersionSpan = tuple[str, int, int]
"""``(label, start, end)``: completion tokens ``[start, end)`` sampled by the weights ``label``."""

MAX_VERSION_LABEL = 256
"""Longest weight-version label kept (characters)."""

SERVER_SAMPLING_DEFAULTS: dict[str, dict[str, float]] = {
    "vllm": {"temperature": 1.0, "top_p": 1.0},
    "sglang": {"temperature": 1.0, "top_p": 1.0},
}
"""What each server samples at when neither the request nor the model's generation config sets a
value: vLLM's ``SamplingParams`` defaults, SGLang's ``ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS``."""


@dataclass
class TokenFields:
    """The token fields of one reply as its server names them; ``None`` where it sent none.

    Attributes:
        prompt: the prompt ids (any JSON value; checked by the reader).
        completion: the completion ids.
        choice: the first choice (its ``logprobs`` are read from it); ``{}`` when there is none.
        versions: the weight-version spans as sent, ``None`` when not asked for or not sent.
    """

    prompt: Any
    completion: Any
    choice: Mapping[str, Any]
    versions: Any = None


@dataclass(frozen=True)
class TokenApi:
    """How one process asks its model server for served tokens and reads them back.

    Args:
        server: whose fields: ``"vllm"`` or ``"sglang"`` (the ``token_ids_api`` setting).
        versions: ask for the weight version of each completion token (vLLM's
            ``return_weight_versions``; the ``weight_versions`` setting); off, nothing is asked or kept.
    """

    server: TokenIdsApi = "vllm"
    versions: bool = False

    def request_fields(self) -> dict[str, Any]:
        """The request fields that ask this server for the served ids and logprobs (never ``stream``)."""
        if self.server == "sglang":
            return {"logprobs": True, "return_token_ids": True, "return_prompt_token_ids": True}
        fields: dict[str, Any] = {"logprobs": True, "return_token_ids": True}
        if self.versions:
            fields["return_weight_versions"] = True
        return fields

    def fields(self, body: Mapping[str, Any]) -> TokenFields:
        """The token fields of a chat completion ``body``, read where this server writes them."""
        choices = body.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        if self.server == "sglang":
            return TokenFields(choice.get("prompt_token_ids"), choice.get("response_token_ids"), choice)
        versions = choice.get("weight_versions") if self.versions else None
        return TokenFields(body.get("prompt_token_ids"), choice.get("token_ids"), choice, versions)

    @property
    def sampling_defaults(self) -> dict[str, float]:
        """The server's built-in ``temperature`` and ``top_p`` (:data:`SERVER_SAMPLING_DEFAULTS`)."""
        return SERVER_SAMPLING_DEFAULTS[self.server]


KNOWN_TOKEN_APIS: tuple[TokenApi, ...] = tuple(TokenApi(server) for server in get_args(TokenIdsApi))
"""One reader per server rlmq knows (:data:`TokenIdsApi`): where a charge floor must count the
completion ids a reply carried, whichever server's field names it used."""


def check_versions(value: Any, completion_length: int) -> list[VersionSpan] | None:
    """Weight-version spans as a server sent them, checked: a list of ``{"version": str, "start":
    int, "end": int}`` in order, each non-empty, the first starting at 0, each starting where the
    previous ended, the last ending at ``completion_length`` (``[]`` for an empty completion).

    Returns:
        The spans as ``(label, start, end)`` tuples, or ``None`` when they do not check.
    """
    if not isinstance(value, list):
        return None
    out: list[VersionSpan] = []
    at = 0
    for item in value:
        if not isinstance(item, Mapping):
            return None
        label, start, end = item.get("version"), item.get("start"), item.get("end")
        if not isinstance(label, str) or not 0 < len(label) <= MAX_VERSION_LABEL:
            return None
        if not isinstance(start, int) or not isinstance(end, int) or isinstance(start, bool) or isinstance(end, bool):
            return None
        if start != at or end <= start:
            return None
        out.append((label, start, end))
        at = end
    return out if at == completion_length else None


def sampled_with(sampling: Mapping[str, Any], api: TokenApi) -> dict[str, Any]:
    """The ``temperature`` and ``top_p`` a turn's tokens were sampled at: the request's (``sampling``,
    what it sent), else the server's default, each with its source: ``{"temperature": 1.0,
    "temperature_source": "server_default", "top_p": 0.9, "top_p_source": "request"}``.

    ``server_default`` is the server's built-in value (:data:`SERVER_SAMPLING_DEFAULTS`); a served
    model whose ``generation_config.json`` sets another is sampled at that one instead.
    """
    out: dict[str, Any] = {}
    for key, default in api.sampling_defaults.items():
        value = sampling.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key], out[f"{key}_source"] = float(value), "request"
        else:
            out[key], out[f"{key}_source"] = default, "server_default"
    return out


def _id_like(name: str) -> bool:
    return "token_id" in name or name.endswith("_ids") or name in ("ids", "tokens")


def id_fields(body: Mapping[str, Any]) -> list[str]:
    """The id-like fields a reply has (``choices[0].token_ids``, ``sglext.output_ids``, ...): names
    with ``token_id`` or ending in ``_ids``, at its top, on its first choice and its message, and
    in its ``sglext`` and ``metadata`` objects."""
    found = [k for k in body if isinstance(k, str) and _id_like(k)]
    choices = body.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    found += [f"choices[0].{k}" for k in choice if isinstance(k, str) and _id_like(k)]
    message = choice.get("message")
    if isinstance(message, dict):
        found += [f"choices[0].message.{k}" for k in message if isinstance(k, str) and _id_like(k)]
    for name in ("sglext", "metadata"):
        inner = body.get(name)
        if isinstance(inner, dict):
            found += [f"{name}.{k}" for k in inner if isinstance(k, str) and _id_like(k)]
    return found


@dataclass
class TokenFieldsLog:
    """Says once per process (one per worker, one per producer) that its server answers token fields
    rlmq does not read: the first reply asked for ids that had none of its server's fields, and the
    first asked for weight versions that had none."""

    ids_warned: bool = False
    versions_warned: bool = False

    def note(self, body: Mapping[str, Any], api: TokenApi, reason: str | None, versions_sent: bool) -> None:
        """Say what a reply read with ``api`` lacked, once each: its ids (``reason`` is
        ``no_token_ids``), or, of a trainable turn, the weight versions asked for."""
        if reason == "no_token_ids":
            self.missing_ids(body, api)
        elif reason is None and api.versions and not versions_sent:
            self.missing_versions()

    def missing_ids(self, body: Mapping[str, Any], api: TokenApi) -> None:
        """Log, the first time only, that a reply asked for ids had none where ``api`` reads them."""
        if self.ids_warned:
            return
        self.ids_warned = True
        where = ("choices[0].prompt_token_ids, choices[0].response_token_ids" if api.server == "sglang"
                 else "prompt_token_ids, choices[0].token_ids")  # fmt: skip
        found = ", ".join(id_fields(body)[:12]) or "none"
        line = (
            f"model server answered without the token fields of {api.server} ({where}); id fields it did "
            f"answer: {found}. Its turns are untrainable (no_token_ids): set token_ids_api to the server's "
            "API (logged once)"
        )
        log.warning("%s", line)

    def missing_versions(self) -> None:
        """Log, the first time only, that a reply asked for weight versions had none."""
        if self.versions_warned:
            return
        self.versions_warned = True
        line = (
            "model server answered without weight_versions though asked (return_weight_versions): its "
            "turns carry no weight versions (logged once)"
        )
        log.warning("%s", line)
