"""The model client of a worker: OpenAI-compatible chat completions, retried, over a transport.

The retry layer of the sub-LLM calls: a failing server sees at most ``retries + 1``
attempts per call. (The root model's calls go through the ``openai`` client in
:mod:`rlmq.producer.root`, which has retries of its own; the two never wrap each other.)

HTTP goes through a :class:`Transport`, as httpx's transports do: :class:`AiohttpTransport`
in production, an in-memory one in tests (no HTTP server needed). The transport moves bytes;
status handling, retries, deadlines and parsing stay here.

Why not ``openai.AsyncOpenAI``: a worker runs hundreds of sub-calls at once in one
process, and on 2 cores ``AsyncOpenAI`` tops out at ~250 calls/s against a zero-latency
server while a bare aiohttp session does ~3,000/s. So the hot path is aiohttp + ``json``,
with no pydantic parsing of model responses.

Retries (with ``tenacity``):

* retried: HTTP 408, 409, 429 and 5xx; connection errors and resets; timeouts; bodies that
  are not a chat completion (malformed JSON, no ``choices``);
* not retried: every other 4xx (the request itself is wrong) and any other client error;
* wait: exponential backoff with full jitter (``uniform(0, backoff_base * 2**(n-1))``, the
  window capped at ``backoff_max``), except that a ``Retry-After`` header (seconds, or an
  HTTP date) is honoured, capped at ``backoff_max``;
* at most ``retries`` retries, and never a sleep past the call's ``deadline``: when the
  next wait would cross it, the client gives up at once;
* giving up raises :class:`rlmq.common.errors.ModelError` with the last HTTP status (``None``
  when no response came back) and a message saying what happened, e.g. ``"model server
  answered 503 Service Unavailable after 4 attempts"``.

``max_tokens``: the grant is sent as ``max_tokens`` only, not ``max_completion_tokens``.
vLLM, SGLang, llama.cpp and OpenAI all honour ``max_tokens`` for chat models (OpenAI's
reasoning models want ``max_completion_tokens``; vLLM and SGLang accept both), and sending
both makes some servers reject the request.
"""

from __future__ import annotations

import email.utils
import json
import logging
import math
import time
from dataclasses import dataclass
from http import HTTPStatus
from types import TracebackType
from typing import Any

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt
from tenacity.stop import stop_base
from tenacity.wait import wait_base, wait_random_exponential

from rlmq.common.connection import mask_url
from rlmq.common.errors import ConfigError, ModelError
from rlmq.common.settings import setting_default
from rlmq.common.token_servers import TokenApi, TokenFieldsLog
from rlmq.common.token_wire import ServedTokens, completion_id_count, served_tokens
from rlmq.workers.transport import AiohttpTransport, HttpReply, Transport

log = logging.getLogger("rlmq.model")

__all__ = ["AiohttpTransport", "ChatClient", "ChatResponse", "HttpReply", "Transport", "estimate_tokens"]
# The transport names are re-exported: a test builds ChatClient(..., transport=...) from here.

_RETRY_STATUSES = frozenset({408, 409, 429})
SESSION_ID_HEADER = "X-Session-ID"
"""verifiers' per-rollout routing header (``verifiers.v1.clients.client.SESSION_ID_HEADER``)."""
_SNIPPET = 300


@dataclass
class ChatResponse:
    """One chat completion, parsed without pydantic.

    Attributes:
        content: the assistant's text (``None`` when it only called tools).
        tool_calls: OpenAI-shaped tool calls,
            ``{"id", "type": "function", "function": {"name", "arguments"}}``.
        finish_reason: ``"stop"``, ``"length"``, ``"tool_calls"``, ... as the server said.
        prompt_tokens: prompt tokens (server's figure, or an estimate, see ``usage_reported``).
        completion_tokens: completion tokens (server's figure, or ``ceil(chars / 4)`` of the
            generated text and tool-call arguments when the server sent no ``usage``).
        usage_reported: False when the body had no ``usage.completion_tokens``.
        message: the assistant message exactly as returned.
        served: the served token ids and logprobs (asked for with ``tokens=True``), checked;
            ``None`` when not asked for or when the turn is untrainable.
        untrainable: why a turn asked for its tokens has none (see
            :data:`rlmq.common.token_wire.UNTRAINABLE_REASONS`); ``None`` otherwise.
        completion_ids: how many completion ids the reply carried (asked for with ``tokens=True``),
            ``None`` when it carried none; ``completion_tokens`` is never below it.
        underreported: completion ids beyond the ``usage.completion_tokens`` the server reported
            (``completion_tokens`` counts them: a charge is never below what was served).
    """

    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    usage_reported: bool
    message: dict[str, Any]
    served: ServedTokens | None = None
    untrainable: str | None = None
    completion_ids: int | None = None
    underreported: int = 0


MAX_COUNT = 100_000_000
"""Largest token count taken from a server's ``usage`` (no model writes this much in one reply)."""


def _valid_count(value: Any) -> bool:
    """A usage figure a server may report: an ``int`` (not ``bool``) in ``[0, MAX_COUNT]``."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def note_overrun(response: ChatResponse, max_tokens: int | None) -> ChatResponse:
    """Log a reported completion-token count above the ``max_tokens`` the call sent.

    A server that honours ``max_tokens`` never reports more; one that does (it ignores
    ``max_tokens``) is counted as it reported: charged to the budget in full, the excess
    recorded as an overrun (the ledger's ``overrun``, the result's ``overrun_tokens``).
    """
    if max_tokens is not None and response.completion_tokens > max_tokens:
        log.warning(
            "model server reported %d completion tokens for max_tokens=%d: it ignores max_tokens; "
            "charged in full, %d recorded as an overrun",
            response.completion_tokens, max_tokens, response.completion_tokens - max_tokens,
        )  # fmt: skip
    return response


def estimate_tokens(chars: int) -> int:
    """Estimate a token count from a character count: ``ceil(chars / 4)``."""
    return math.ceil(chars / 4) if chars > 0 else 0


class _Failure(Exception):
    """One failed attempt (internal to the retry loop)."""

    def __init__(
        self,
        message: str,
        status: int | None,
        retryable: bool,
        retry_after: float | None = None,
        detail: str = "",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.retryable = retryable
        self.retry_after = retry_after
        self.detail = detail


def _is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, _Failure) and exc.retryable


def _parse_retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or HTTP date), or None."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - time.time()
    if math.isnan(seconds):
        return None
    return max(0.0, seconds)


class _Wait(wait_base):
    """Full-jitter exponential backoff, but ``Retry-After`` (capped) when the server sent one."""

    def __init__(self, base: float, cap: float) -> None:
        self._cap = cap
        self._backoff = wait_random_exponential(multiplier=base, max=cap)

    def __call__(self, retry_state: RetryCallState) -> float:
        outcome = retry_state.outcome
        exc = outcome.exception() if outcome is not None else None
        if isinstance(exc, _Failure) and exc.retry_after is not None:
            return min(exc.retry_after, self._cap)
        return float(self._backoff(retry_state))


class _StopAtDeadline(stop_base):
    """Stop when the next sleep would end past ``deadline`` (Unix seconds)."""

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline
        self.hit = False

    def __call__(self, retry_state: RetryCallState) -> bool:
        if time.time() + retry_state.upcoming_sleep >= self._deadline:
            self.hit = True
            return True
        return False


def _status_text(status: int) -> str:
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return str(status)


def _snippet(body: bytes) -> str:
    text = body[:_SNIPPET].decode("utf-8", "replace").strip()
    return text + ("..." if len(body) > _SNIPPET else "")


_Asked = tuple[TokenApi, TokenFieldsLog]
"""The served tokens were asked for: the server's API, and the log that says once that it answered none."""


def _parse(body: bytes, status: int, messages: list[dict[str, Any]], tokens: _Asked | None = None) -> ChatResponse:
    """Parse a chat-completion body; raise a retryable ``_Failure`` when it is not one. ``tokens``:
    read and check its served token ids and logprobs (:func:`_with_tokens`)."""
    try:
        data = json.loads(body)
        choice = data["choices"][0]
        message = choice["message"]
        if not isinstance(message, dict):
            raise TypeError("message is not an object")
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise _Failure(
            f"model server answered {_status_text(status)} with a body that is not a chat completion "
            f"({type(exc).__name__}: {_snippet(body)!r})",
            status,
            retryable=True,
        ) from None
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        content = json.dumps(content)
    tool_calls = message.get("tool_calls") or []
    if not isinstance(tool_calls, list):
        tool_calls = []
    usage = data.get("usage")
    completion = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if completion is not None and not _valid_count(completion):
        # A lying or broken server: the count is not used (a budgeted call is then charged
        # its whole grant, see rlmq.workers.subllm), and the text length stands in for metrics.
        log.warning("model server reported usage.completion_tokens=%.60r: not a token count; ignored", completion)
    elif completion is not None:
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        counts = (prompt if isinstance(prompt, int) and _valid_count(prompt) else 0, completion, True)
        return _with_tokens(tokens, data, _response(choice, message, content, tool_calls, counts))
    chars = len(content or "")
    for call in tool_calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            chars += len(str(fn.get("name") or "")) + len(str(fn.get("arguments") or ""))
    prompt_chars = 0
    for m in messages:
        c = m.get("content")
        if isinstance(c, str):
            prompt_chars += len(c)
    counts = (estimate_tokens(prompt_chars), estimate_tokens(chars), False)
    return _with_tokens(tokens, data, _response(choice, message, content, tool_calls, counts))


def _response(
    choice: dict[str, Any],
    message: dict[str, Any],
    content: str | None,
    tool_calls: list[Any],
    counts: tuple[int, int, bool],
) -> ChatResponse:
    """A :class:`ChatResponse` of one choice with ``counts`` = (prompt tokens, completion tokens,
    whether the server reported them)."""
    prompt_tokens, completion_tokens, reported = counts
    return ChatResponse(
        content=content,
        tool_calls=tool_calls,
        finish_reason=choice.get("finish_reason"),
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        usage_reported=reported,
        message=message,
    )


def _with_tokens(asked: _Asked | None, data: dict[str, Any], response: ChatResponse) -> ChatResponse:
    """``response`` with the served tokens of ``data`` (checked against its ``usage`` when the
    server reported one) when they were ``asked`` for, read as the server's API writes them; untouched
    otherwise. A reply without the server's id fields is said in the log, once per client."""
    if asked is not None:
        api, fields_log = asked
        usage = (response.prompt_tokens, response.completion_tokens) if response.usage_reported else None
        response.served, response.untrainable = served_tokens(data, usage, api)
        sent = response.served is not None and response.served.versions is not None
        fields_log.note(data, api, response.untrainable, sent)
        _count_served_ids(response, completion_id_count(data, api))
    return response


def _count_served_ids(response: ChatResponse, ids: int | None) -> None:
    """Raise ``response.completion_tokens`` to the ``ids`` completion ids the reply carried: a
    server that reports a ``usage`` below what it served is charged what it served, and the
    difference is recorded (``underreported``)."""
    response.completion_ids = ids
    if ids is None or ids <= response.completion_tokens:
        return
    if response.usage_reported:
        response.underreported = ids - response.completion_tokens
        log.warning(
            "model server reported usage.completion_tokens=%d but served %d completion ids: charged %d",
            response.completion_tokens, ids, ids,
        )  # fmt: skip
    response.completion_tokens = ids


def with_token_fields(payload: dict[str, Any], api: TokenApi | None = None) -> dict[str, Any]:
    """``payload`` (a chat request body) asking for the served token ids and logprobs with the
    fields of ``api``'s server (:meth:`rlmq.common.token_servers.TokenApi.request_fields`; default
    vLLM's ``logprobs`` and ``return_token_ids``). The one place a worker's request gains fields for
    training; the sampling arguments keep their own values otherwise."""
    return {**payload, **(api or TokenApi()).request_fields()}


FAILURE_LOG_SECONDS = 30.0
"""At most one log line per this many seconds about a failing model server (per client)."""


class FailureLog:
    """Says in the log that a model server is failing: the first failed call at once, then at
    most one line every ``interval`` seconds with how many calls failed since the last line.

    Args:
        base_url: the server, named in the line.
        interval: seconds between two lines.
        clock: monotonic seconds (a seam for tests).
    """

    def __init__(self, base_url: str, interval: float = FAILURE_LOG_SECONDS, clock: Any = time.monotonic) -> None:
        self.base_url = base_url
        self.interval = interval
        self.clock = clock
        self.failed = 0
        self.succeeded = 0
        self._last: float | None = None

    def ok(self) -> None:
        """Count a call that the server answered."""
        self.succeeded += 1

    def failure(self, error: ModelError) -> None:
        """Count a call that failed past its retries; log when the last line is old enough."""
        self.failed += 1
        now = self.clock()
        if self._last is not None and now - self._last < self.interval:
            return
        since = "" if self._last is None else f" in the last {now - self._last:.0f} s"
        log.warning(
            "model server %s is failing: %d sub-LLM model call(s) failed%s, %d answered (last: %s)",
            mask_url(self.base_url), self.failed, since, self.succeeded, error,
        )  # fmt: skip
        self._last = now
        self.failed = self.succeeded = 0


class ChatClient:
    """OpenAI-compatible chat-completions client with retries, over a :class:`Transport`.

    One instance serves every concurrent sub-call of a worker process.

    Args:
        base_url: the server's OpenAI base URL, e.g. ``http://127.0.0.1:8000/v1``; requests go
            to ``{base_url}/chat/completions``.
        api_key: sent as ``Authorization: Bearer <api_key>`` when set.
        timeout: seconds one HTTP attempt may take (also capped by the call's deadline).
        retries: retries after the first attempt (so at most ``retries + 1`` attempts).
        max_connections: size of the connection pool of the default transport.
        backoff_base: seconds; the first retry waits ``uniform(0, backoff_base)``, the window
            doubling per retry.
        backoff_max: seconds; cap of any single wait, ``Retry-After`` included.
        transport: how requests are sent (default: an :class:`AiohttpTransport`); a test
            passes an in-memory one.
        token_api: the server's fields for served tokens (``token_ids_api``, ``weight_versions``;
            default vLLM's, without weight versions).

    Raises:
        ConfigError: ``retries`` is negative.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float = setting_default("model_timeout"),
        retries: int = setting_default("model_retries"),
        max_connections: int = 1024,
        backoff_base: float = 0.25,
        backoff_max: float = 10.0,
        transport: Transport | None = None,
        token_api: TokenApi | None = None,
    ) -> None:
        if retries < 0:
            raise ConfigError("retries must be >= 0")
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/chat/completions"
        self.timeout = timeout
        self.retries = retries
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.transport: Transport = transport if transport is not None else AiohttpTransport(max_connections)
        self.attempts = 0
        """HTTP attempts made by this client (for metrics and tests)."""
        self.failures = FailureLog(self.base_url)
        """Logs, rate-limited, that the server is failing."""
        self.token_api = token_api or TokenApi()
        """How the served tokens are asked for and read (the server's API)."""
        self.token_fields_log = TokenFieldsLog()
        """Says once that the server answers no token field rlmq reads."""

    async def chat(
        self,
        *,
        model: str,
        messages: list[dict[str, Any]],
        max_tokens: int | None = None,
        tools: list[dict[str, Any]] | None = None,
        temperature: float | None = None,
        sampling: dict[str, Any] | None = None,
        user: str | None = None,
        deadline: float | None = None,
        session_id: str | None = None,
        tokens: bool = False,
    ) -> ChatResponse:
        """Run one chat completion, retrying transient failures.

        Args:
            model: the served model name.
            messages: OpenAI chat messages.
            max_tokens: completion-token cap sent as ``max_tokens`` (omitted when ``None``).
            tools: OpenAI tool schemas (omitted when empty).
            temperature: sampling temperature (omitted when ``None``).
            sampling: more request fields (``top_p``, a server's own keys), sent as they are;
                the fields above win over any of the same name.
            user: the OpenAI ``user`` field (rlmq sends the rollout id).
            deadline: Unix time (seconds) after which no attempt starts and no retry waits.
            session_id: sent as the ``X-Session-ID`` header (omitted when ``None``).
            tokens: ask for the served token ids and logprobs (:func:`with_token_fields`) and
                read them into ``served`` (``include_sub_llm_in_trajectory``).

        Returns:
            The parsed response.

        Raises:
            ModelError: the server failed and the retry layer gave up (``status`` is the last
                HTTP status, ``None`` when no response came back), or the deadline passed.
        """
        payload: dict[str, Any] = {**(sampling or {}), "model": model, "messages": messages}
        if max_tokens is not None:
            payload["max_tokens"] = max_tokens
        if tools:
            payload["tools"] = tools
        if temperature is not None:
            payload["temperature"] = temperature
        if user is not None:
            payload["user"] = user
        if tokens:
            payload = with_token_fields(payload, self.token_api)
        data = json.dumps(payload).encode()
        send = {**self._headers, SESSION_ID_HEADER: session_id} if session_id else self._headers
        asked = (self.token_api, self.token_fields_log) if tokens else None
        # Fast path: the first attempt runs outside tenacity (whose bookkeeping costs tens
        # of microseconds per call). When it fails retryably, tenacity takes over from there:
        # its first "attempt" re-raises that failure without a request, so waits, Retry-After,
        # the attempt limit and the deadline are all tenacity's, counted from attempt 1.
        try:
            response = note_overrun(await self._attempt(data, messages, deadline, send, asked), max_tokens)
        except _Failure as exc:
            if not exc.retryable or self.retries == 0:
                raise self._give_up(exc, 1, False) from None
            first: _Failure | None = exc
        else:
            self.failures.ok()
            return response
        attempts = 0

        async def attempt() -> ChatResponse:
            nonlocal attempts, first
            attempts += 1
            if first is not None:
                failure, first = first, None
                raise failure
            return await self._attempt(data, messages, deadline, send, asked)

        stop: Any = stop_after_attempt(self.retries + 1)
        at_deadline: _StopAtDeadline | None = None
        if deadline is not None:
            at_deadline = _StopAtDeadline(deadline)
            stop = stop | at_deadline
        retrying = AsyncRetrying(
            stop=stop,
            wait=_Wait(self.backoff_base, self.backoff_max),
            retry=retry_if_exception(_is_retryable),
            reraise=True,
        )
        try:
            response = note_overrun(await retrying(attempt), max_tokens)
        except _Failure as exc:
            raise self._give_up(exc, attempts, at_deadline is not None and at_deadline.hit) from None
        self.failures.ok()
        return response

    def _give_up(self, exc: _Failure, attempts: int, deadline_hit: bool) -> ModelError:
        message = exc.message
        if exc.retryable:
            message += f" after {attempts} attempt{'s' if attempts != 1 else ''}"
            if deadline_hit:
                message += " (gave up: the next retry would pass the call's deadline)"
        if exc.detail:
            message += f": {exc.detail}"
        error = ModelError(message, exc.status)
        self.failures.failure(error)
        return error

    async def _attempt(
        self,
        data: bytes,
        messages: list[dict[str, Any]],
        deadline: float | None,
        send: dict[str, str],
        tokens: _Asked | None = None,
    ) -> ChatResponse:
        self.attempts += 1
        seconds = self.timeout
        if deadline is not None:
            left = deadline - time.time()
            if left <= 0:
                raise _Failure("the call's deadline passed before the model answered", None, retryable=False)
            seconds = min(seconds, left)
        try:
            reply = await self.transport.post(self.url, data, headers=send, timeout=seconds)
        except TimeoutError:
            raise _Failure(f"model call timed out after {seconds:.3g} s", None, retryable=True) from None
        except ConnectionError as exc:
            raise _Failure(
                f"connection to the model server at {self.url} failed ({exc})", None, retryable=True
            ) from None
        except ModelError as exc:
            raise _Failure(str(exc), None, retryable=False) from None
        status, body, headers = reply.status, reply.body, reply.headers
        if 200 <= status < 300:
            return _parse(body, status, messages, tokens)
        retryable = status in _RETRY_STATUSES or status >= 500
        retry_after = _parse_retry_after(headers.get("Retry-After")) if retryable else None
        raise _Failure(
            f"model server answered {_status_text(status)}",
            status,
            retryable=retryable,
            retry_after=retry_after,
            detail=_snippet(body),
        )

    async def close(self) -> None:
        """Close the transport (idempotent)."""
        await self.transport.close()

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
