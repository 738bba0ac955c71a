"""Trainable turns: the token ids and logprobs a model server served, on the wire and in the output.

With ``include_sub_llm_in_trajectory`` on (the meaning of verifiers' ``RLMEnv``, #966 / 0.1.14:
every sub-LLM turn is a trajectory step with its prompt ids, completion ids and logprobs), every
model turn of a tree carries what the server returned:

* **Asked for** with the fields of the process's server (:class:`~rlmq.common.token_servers.TokenApi`:
  vLLM's ``logprobs: true`` and ``return_token_ids: true``, SGLang's, and vLLM's
  ``return_weight_versions`` when weight versions are on). Nothing is asked for with the option off.
* **Read and checked** by :func:`served_tokens`: the three lists must be there, the completion's
  ids and logprobs must be as long as each other, and both lists as long as ``usage`` says. A
  turn that fails is kept, marked untrainable with a reason (:data:`UNTRAINABLE_REASONS`), and
  carries no token.
* **On the wire** as a :class:`TurnTokens`: ids as base64 of little-endian int32, logprobs as
  base64 of little-endian float32 (float64 when a value does not survive float32 exactly), and a
  later turn of one conversation sends only the prompt ids past what it shares with the previous
  turn's prompt and completion (``prefix``). :class:`TurnEncoder` writes them,
  :class:`TurnDecoder` reads them back and checks them again (a worker's payload is not trusted).
* **In ``trajectories.jsonl``** as JSON lists named as vLLM and verifiers name them
  (``prompt_token_ids``, ``completion_token_ids``, ``completion_logprobs``):
  :func:`expand_trajectory`.

This module is the one place of this wire format.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import sys
from array import array
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlmq.common.token_servers import TokenApi, VersionSpan, check_versions

__all__ = [
    "UNTRAINABLE_REASONS", "ServedTokens", "TokenCap", "TurnDecoder", "TurnEncoder", "TurnTokens",
    "completion_id_count", "decode_ids", "decode_logprobs", "encode_ids", "encode_logprobs", "expand_trajectory",
    "served_tokens", "served_unless_frozen", "tokens_asked", "turn_counts", "validate_served",
]  # fmt: skip

UNTRAINABLE_REASONS: tuple[str, ...] = (
    "no_token_ids", "length_mismatch", "usage_mismatch", "payload_cap", "bad_payload", "spill_lost", "frozen_fleet",
    "version_mismatch",
    "bad_logprob", "over_max_tokens", "too_many_ids",
    "continuation_boundary",
)  # fmt: skip
"""Why a turn carries no tokens: the server returned none (``no_token_ids``: llama.cpp, OpenAI),
its completion ids and logprobs differ in length (``length_mismatch``), a list disagrees with
``usage`` (``usage_mismatch``), the rollout's byte cap was passed (``payload_cap``), a worker's
payload did not decode (``bad_payload``), a spilled payload expired before it was read
(``spill_lost``), the queue's servers declare that they are not the policy (``frozen_fleet``), the
weight-version spans the server sent do not cover its completion ids (``version_mismatch``), a
logprob is ``NaN``, infinite or above 0 (``bad_logprob``), the completion is longer than the
request's ``max_tokens`` (``over_max_tokens``), the reply carries more ids than a worker keeps
for one turn (``too_many_ids``, :func:`validate_served`), or a continued answer's next segment was
prompted with ids other than those sampled so far (``continuation_boundary``:
:mod:`rlmq.workers.continuation`)."""

MAX_TOKEN_ID = 2**31 - 1
"""Largest token id the wire carries (int32)."""


# ---------------------------------------------------------------------------- binary forms


def _b64(data: array[Any]) -> str:
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        data = array(data.typecode, data)
        data.byteswap()
    return base64.b64encode(data.tobytes()).decode("ascii")


def _unb64(text: str, typecode: str) -> array[Any]:
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    out = array(typecode)
    if len(raw) % out.itemsize:
        raise ValueError(f"{len(raw)} bytes is no whole number of {out.itemsize}-byte items")
    out.frombytes(raw)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        out.byteswap()
    return out


def encode_ids(ids: list[int]) -> str:
    """Token ids as base64 of little-endian int32 (4 bytes per id before base64).

    Raises:
        ValueError: an id outside ``[0, 2**31 - 1]``.
    """
    if any(i < 0 or i > MAX_TOKEN_ID for i in ids):
        raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]")
    return _b64(array("i", ids))


def decode_ids(text: str) -> list[int]:
    """The ids :func:`encode_ids` wrote.

    Raises:
        ValueError: not base64 of whole int32 items, or a negative id.
    """
    ids = _unb64(text, "i").tolist()
    if any(i < 0 for i in ids):
        raise ValueError("a negative token id")
    return ids


def encode_logprobs(values: list[float]) -> tuple[str, Literal["f4", "f8"]]:
    """Logprobs as base64 of little-endian float32 when every value survives float32 exactly (vLLM's
    do: it computes them in float32), else float64; returns (text, ``"f4"`` or ``"f8"``)."""
    narrow = array("f", values)
    if narrow.tolist() == values:
        return _b64(narrow), "f4"
    return _b64(array("d", values)), "f8"


def decode_logprobs(text: str, dtype: Literal["f4", "f8"]) -> list[float]:
    """The logprobs :func:`encode_logprobs` wrote.

    Raises:
        ValueError: not base64 of whole items of ``dtype``.
    """
    return _unb64(text, "f" if dtype == "f4" else "d").tolist()


# ---------------------------------------------------------------------------- a server's reply


@dataclass
class ServedTokens:
    """One turn's tokens as a server served them: prompt ids, completion ids, one logprob per
    completion id (natural log, as the server reported), and the weight-version spans over the
    completion ids when asked for and sent (``None`` otherwise)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[VersionSpan] | None = None


def _id_list(value: Any) -> list[int] | None:
    if not isinstance(value, list):
        return None
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOKEN_ID:
            return None
    return value


def _logprob_list(choice: Mapping[str, Any]) -> list[float] | None:
    block = choice.get("logprobs")
    content = block.get("content") if isinstance(block, dict) else None
    if not isinstance(content, list):
        return None
    out: list[float] = []
    for item in content:
        value = item.get("logprob") if isinstance(item, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        out.append(float(value))
    return out


def served_tokens(
    body: Mapping[str, Any], usage: tuple[int, int] | None, api: TokenApi | None = None
) -> tuple[ServedTokens | None, str | None]:
    """Read and check the token fields of a chat completion ``body`` (a parsed JSON object).

    Args:
        body: the whole completion, its fields where ``api``'s server writes them
            (:meth:`TokenApi.fields`: vLLM's ``prompt_token_ids``, ``choices[0].token_ids``;
            SGLang's ``choices[0].prompt_token_ids``, ``choices[0].response_token_ids``; both
            ``choices[0].logprobs.content[i].logprob``).
        usage: ``(prompt_tokens, completion_tokens)`` the server reported, ``None`` when it sent none.
        api: the server's API (default vLLM, no weight versions).

    Returns:
        ``(tokens, None)`` for a trainable turn, else ``(None, reason)``: ``no_token_ids`` (a list
        is missing or not a list of int32 ids / numbers), ``length_mismatch`` (completion ids and
        logprobs differ in length), ``usage_mismatch`` (a list's length is not ``usage``'s count),
        ``version_mismatch`` (weight-version spans were sent that do not cover the completion ids).
        A turn asked for weight versions and sent none is trainable without them.
    """
    fields = (api or TokenApi()).fields(body)
    prompt, completion = _id_list(fields.prompt), _id_list(fields.completion)
    logprobs = _logprob_list(fields.choice)
    if prompt is None or completion is None or logprobs is None:
        return None, "no_token_ids"
    if len(completion) != len(logprobs):
        return None, "length_mismatch"
    if usage is not None and (len(prompt), len(completion)) != usage:
        return None, "usage_mismatch"
    versions = None if fields.versions is None else check_versions(fields.versions, len(completion))
    if fields.versions is not None and versions is None:
        return None, "version_mismatch"
    return ServedTokens(prompt, completion, logprobs, versions), None


def _bad_logprob(values: list[float]) -> bool:
    """A logprob no sampler gives: ``NaN``, infinite, or above 0 (a probability above 1)."""
    return any(not (math.isfinite(v) and v <= 0.0) for v in values)


def tokens_asked(include_sub_llm_in_trajectory: bool, frozen: bool) -> bool:
    """Whether a model call asks its server for the served tokens: with the rollout's
    ``include_sub_llm_in_trajectory`` on, unless the server is a frozen fleet's (``frozen_fleet``:
    not the policy being trained, its turns are never trainable)."""
    return include_sub_llm_in_trajectory and not frozen


def served_unless_frozen(
    frozen: bool, read: Callable[[], tuple[ServedTokens | None, str | None]]
) -> tuple[ServedTokens | None, str | None]:
    """A turn's served tokens and why it is untrainable: ``read()`` (as :func:`served_tokens`
    answers), or, when a frozen fleet served it, ``(None, "frozen_fleet")`` without reading
    (whatever the server sent)."""
    return (None, "frozen_fleet") if frozen else read()


def validate_served(
    served: ServedTokens | None, reason: str | None, *, max_tokens: int | None, max_ids: int | None
) -> tuple[ServedTokens | None, str | None]:
    """What :func:`served_tokens` read, checked against what no training may take: a server that
    lies or ignores the request. Called once per turn, before the turn is encoded for the wire.

    Args:
        served: the turn's tokens (``None`` when already untrainable).
        reason: why it is untrainable (kept when ``served`` is ``None``).
        max_tokens: the ``max_tokens`` the request sent (``None``: none sent).
        max_ids: most ids (prompt + completion) one turn's record may carry (``None``: no bound).

    Returns:
        ``(served, None)`` when it holds, else ``(None, reason)``: ``too_many_ids`` (more than
        ``max_ids``: the payload would be its size in Redis), ``over_max_tokens`` (more completion
        ids than ``max_tokens``), ``bad_logprob`` (``NaN``, ``±inf`` or above 0: invalid JSON for
        many readers, a probability above 1).
    """
    if served is None:
        return None, reason
    if max_ids is not None and len(served.prompt_ids) + len(served.completion_ids) > max_ids:
        return None, "too_many_ids"
    if max_tokens is not None and len(served.completion_ids) > max_tokens:
        return None, "over_max_tokens"
    if _bad_logprob(served.logprobs):
        return None, "bad_logprob"
    return served, None


def completion_id_count(body: Mapping[str, Any], api: TokenApi | None = None) -> int | None:
    """How many completion ids a chat completion ``body`` carries where ``api``'s server writes
    them (:meth:`TokenApi.fields`: vLLM's ``choices[0].token_ids``, SGLang's
    ``choices[0].response_token_ids``; a list whatever its items), ``None`` when it carries none:
    the count a charge is at least."""
    ids = (api or TokenApi()).fields(body).completion
    return len(ids) if isinstance(ids, list) else None


# ---------------------------------------------------------------------------- the wire record


class TurnTokens(BaseModel):
    """One model turn on the wire: its tokens in binary form, or why it has none.

    A turn of a conversation (a sub-call's turns; a rollout's root turns) shares the prompt ids
    of its previous turn's prompt and completion up to ``prefix``; only the rest travels.
    ``sampling`` is what the request sent (``max_tokens``, ``temperature``, the sampling
    arguments); ``sampled_with`` the ``temperature`` and ``top_p`` the tokens were sampled at, each
    with its source (:func:`rlmq.common.token_servers.sampled_with`); ``versions`` the weight-version
    spans ``[label, start, end]`` over the completion ids, when asked for and sent.
    """

    model_config = ConfigDict(extra="forbid")

    turn: int = Field(ge=1)
    prefix: int = Field(default=0, ge=0)
    prompt: str = ""
    completion: str = ""
    logprobs: str = ""
    dtype: Literal["f4", "f8"] = "f4"
    sampling: dict[str, Any] = Field(default_factory=dict)
    sampled_with: dict[str, Any] = Field(default_factory=dict)
    versions: list[tuple[str, int, int]] | None = None
    untrainable: str | None = None

    @field_validator("sampled_with")
    @classmethod
    def _sampled_with(cls, value: dict[str, Any]) -> dict[str, Any]:
        """Only what :func:`~rlmq.common.token_servers.sampled_with` writes: a worker's record is not trusted."""
        for key, item in value.items():
            if key in ("temperature", "top_p"):
                ok = isinstance(item, (int, float)) and not isinstance(item, bool)
            else:
                ok = key in ("temperature_source", "top_p_source") and item in ("request", "server_default")
            if not ok:
                raise ValueError(f"sampled_with: {key!r} is not a sampling value rlmq records")
        return value

    @property
    def nbytes(self) -> int:
        """Bytes of its payload on the wire: the base64 texts, its sampling's and versions' JSON."""
        extra = json.dumps(self.sampling) + json.dumps(self.sampled_with) + json.dumps(self.versions)
        return len(self.prompt) + len(self.completion) + len(self.logprobs) + len(extra)


class TurnEncoder:
    """Writes the turns of one conversation as :class:`TurnTokens` (prefix-shared prompts)."""

    def __init__(self) -> None:
        self._previous: list[int] = []

    def encode(
        self,
        turn: int,
        served: ServedTokens | None,
        reason: str | None,
        sampling: Mapping[str, Any],
        sampled_with: Mapping[str, Any] | None = None,
    ) -> TurnTokens:
        """The record of turn ``turn`` (1-based): ``served``, or no tokens and ``reason``;
        ``sampled_with``: the temperature and top-p its tokens were sampled at."""
        drawn = dict(sampled_with or {})
        if served is None:
            self._previous = []
            return TurnTokens(
                turn=turn, sampling=dict(sampling), sampled_with=drawn, untrainable=reason or "no_token_ids"
            )
        prev, ids = self._previous, served.prompt_ids
        shared = 0
        for a, b in zip(prev, ids, strict=False):
            if a != b:
                break
            shared += 1
        logprobs, dtype = encode_logprobs(served.logprobs)
        self._previous = ids + served.completion_ids
        return TurnTokens(
            turn=turn, prefix=shared, prompt=encode_ids(ids[shared:]), completion=encode_ids(served.completion_ids),
            logprobs=logprobs, dtype=dtype, sampling=dict(sampling), sampled_with=drawn, versions=served.versions,
        )  # fmt: skip


class TurnDecoder:
    """Reads the :class:`TurnTokens` of one conversation back, in order, checking them again."""

    def __init__(self) -> None:
        self._previous: list[int] = []

    def decode(self, record: Mapping[str, Any] | TurnTokens) -> dict[str, Any]:
        """One turn as JSON lists: ``turn``, ``prompt_token_ids``, ``completion_token_ids``,
        ``completion_logprobs``, ``sampling``, ``trainable`` (and ``untrainable_reason`` when not).
        A record that does not decode or check is an untrainable turn (``bad_payload``)."""
        try:
            rec = record if isinstance(record, TurnTokens) else TurnTokens.model_validate(record)
        except ValueError:
            self._previous = []
            turn = record.get("turn") if isinstance(record, Mapping) else None
            return _untrainable(turn if isinstance(turn, int) else 0, {}, "bad_payload")
        if rec.untrainable is not None:
            self._previous = []
            return _untrainable(rec.turn, rec.sampling, rec.untrainable, rec.sampled_with)
        try:
            if rec.prefix > len(self._previous):
                raise ValueError("prefix past the previous turn")
            prompt = self._previous[: rec.prefix] + decode_ids(rec.prompt)
            completion = decode_ids(rec.completion)
            logprobs = decode_logprobs(rec.logprobs, rec.dtype)
            if len(completion) != len(logprobs):
                raise ValueError("completion ids and logprobs differ in length")
            versions = _versions_out(rec.versions, len(completion))
            if _bad_logprob(logprobs):
                raise ValueError("a logprob that is NaN, infinite or above 0")
        except (ValueError, binascii.Error):
            self._previous = []
            return _untrainable(rec.turn, rec.sampling, "bad_payload", rec.sampled_with)
        self._previous = prompt + completion
        out = {
            "turn": rec.turn, "prompt_token_ids": prompt, "completion_token_ids": completion,
            "completion_logprobs": logprobs, "sampling": rec.sampling, "trainable": True,
        }  # fmt: skip
        if rec.sampled_with:
            out["sampled_with"] = rec.sampled_with
        if versions is not None:
            out["weight_versions"] = versions
        return out


def _versions_out(versions: list[tuple[str, int, int]] | None, completion_length: int) -> list[dict[str, Any]] | None:
    """A record's weight-version spans as ``trajectories.jsonl`` keeps them (vLLM's shape: ``version``,
    ``start``, ``end``), checked again. Raises ValueError when they do not cover the completion ids."""
    if versions is None:
        return None
    spans = [{"version": v, "start": a, "end": b} for v, a, b in versions]
    if check_versions(spans, completion_length) is None:
        raise ValueError("weight-version spans do not cover the completion ids")
    return spans


def _untrainable(
    turn: int, sampling: dict[str, Any], reason: str, sampled_with: dict[str, Any] | None = None
) -> dict[str, Any]:
    out = {"turn": turn, "sampling": sampling, "trainable": False, "untrainable_reason": reason}
    if sampled_with:
        out["sampled_with"] = sampled_with
    return out


def _stripped(record: TurnTokens, reason: str) -> TurnTokens:
    """``record`` without its payload (ids, logprobs, versions), untrainable for ``reason``."""
    return TurnTokens(turn=record.turn, sampling=record.sampling, sampled_with=record.sampled_with, untrainable=reason)


class TokenCap:
    """A rollout's byte cap on the token payloads it records (``trajectory_token_max_bytes``):
    past it, a turn keeps its place, loses its tokens and is marked ``payload_cap``.

    Args:
        limit: bytes of base64 token payload (``None``: no cap).
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.used = 0

    def admit(self, record: TurnTokens) -> TurnTokens:
        """``record`` as it may be kept: itself while the cap holds, else stripped (``payload_cap``).
        An untrainable record keeps no payload, whatever it came with (a worker's is not trusted)."""
        if record.untrainable is not None:
            return _stripped(record, record.untrainable[:64])
        if self.limit is not None and self.used + record.nbytes > self.limit:
            self.limit = 0  # past the cap once, every later turn too: a branch never resumes mid-way
            return _stripped(record, "payload_cap")
        self.used += record.nbytes
        return record


# ---------------------------------------------------------------------------- the output


def _dicts(items: Any) -> Iterator[dict[str, Any]]:
    if isinstance(items, list):
        yield from (i for i in items if isinstance(i, dict))


def expand_trajectory(trajectory: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A copy of a rollout's trajectory with every token record as JSON lists, for
    ``trajectories.jsonl``: a root event's ``tokens`` becomes its ``prompt_token_ids``,
    ``completion_token_ids``, ``completion_logprobs`` (+ ``sampling``, ``sampled_with``,
    ``weight_versions`` when asked for, ``trainable``); a sub-call
    result's ``turn_tokens`` becomes ``steps`` (one such dict per model turn, as verifiers names a
    trajectory's steps); a child's
    trajectory (``rlm_batch`` results' ``child.trajectory``) is expanded the same way. A trajectory
    without token records comes back equal to itself."""
    roots = TurnDecoder()
    out: list[dict[str, Any]] = []
    for event in trajectory:
        if not isinstance(event, dict):
            out.append(event)
            continue
        ev = dict(event)
        if ev.get("type") == "root" and "tokens" in ev:
            ev.update(roots.decode(ev.pop("tokens")))
        elif ev.get("type") in ("llm_batch", "rlm_batch") and isinstance(ev.get("results"), list):
            ev["results"] = [_expand_result(r) if isinstance(r, dict) else r for r in ev["results"]]
        out.append(ev)
    return out


def _expand_result(result: dict[str, Any]) -> dict[str, Any]:
    res = dict(result)
    if "turn_tokens" in res:
        decoder = TurnDecoder()
        res["steps"] = [decoder.decode(t) for t in _dicts(res.pop("turn_tokens"))]
    child = res.get("child")
    if isinstance(child, dict) and isinstance(child.get("trajectory"), list):
        res["child"] = {**child, "trajectory": expand_trajectory(child["trajectory"])}
    return res


def turn_counts(trajectory: list[dict[str, Any]]) -> dict[str, int]:
    """Trainable and untrainable turns of a trajectory and its children's, by reason:
    ``trainable_turn_count``, ``untrainable_turn_count``, ``untrainable_turns_<reason>``.
    Empty when no turn carries a token record (the option off)."""
    counts: dict[str, int] = {}

    def add(record: Any) -> None:
        if not isinstance(record, dict):
            return
        reason = record.get("untrainable")
        key = "trainable_turn_count" if reason is None else "untrainable_turn_count"
        counts[key] = counts.get(key, 0) + 1
        if reason is not None:
            name = f"untrainable_turns_{reason if reason in UNTRAINABLE_REASONS else 'bad_payload'}"
            counts[name] = counts.get(name, 0) + 1

    def walk(events: Any) -> None:
        for ev in _dicts(events):
            if ev.get("type") == "root" and "tokens" in ev:
                add(ev["tokens"])
            for res in _dicts(ev.get("results")) if ev.get("type") in ("llm_batch", "rlm_batch") else ():
                for rec in _dicts(res.get("turn_tokens")):
                    add(rec)
                child = res.get("child")
                if isinstance(child, dict):
                    walk(child.get("trajectory"))

    walk(trajectory)
    if counts:
        counts.setdefault("trainable_turn_count", 0)
        counts.setdefault("untrainable_turn_count", 0)
    return counts
