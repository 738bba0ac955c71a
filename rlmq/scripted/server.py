"""The scripted model's HTTP server (aiohttp): a test double of an OpenAI-compatible server.

What it answers, its directives and its token accounting: :mod:`rlmq.scripted`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from aiohttp import web

from rlmq.common.errors import ConfigError
from rlmq.scripted.answerer import answer_from_chunk
from rlmq.scripted.completions import (
    _JSON,
    _STATE,
    _completion,
    _Counts,
    _error,
    _limit_of,
    _Reply,
    _root_reply,
    _State,
    _sub_reply,
    _text,
    _tool_names,
    _words,
)
from rlmq.scripted.continuation import continued_answer, rest_of_answer
from rlmq.scripted.markers import (
    DEFAULT_MAX_TOKENS,
    LISTEN_LINE,
    MODEL_FINGERPRINT,
    NOT_FOUND,
    ROOT_FOLLOW_UP,
    ROOT_TOOL_NAME,
    ROOT_TOOL_NAMES,
    _Faults,
    _parse_faults,
    answer_tokens,
    context_length_message,
    context_tokens,
    decode_seconds,
    root_code_directive,
    tag_of,
)
from rlmq.scripted.quota import ProviderQuota
from rlmq.scripted.recursion import is_rlm_format_root, recursion_of, rlm_format_reply
from rlmq.scripted.root_script import root_code_for
from rlmq.scripted.tokens import TOKEN_SHAPES, ServedLog, served_fields

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "MODEL_FINGERPRINT",
    "NOT_FOUND",
    "ROOT_FOLLOW_UP",
    "ROOT_TOOL_NAME",
    "ScriptedModelServer",
    "answer_from_chunk",
    "answer_tokens",
    "create_app",
    "main",
    "root_code_directive",
    "root_code_for",
    "serve",
]

log = logging.getLogger(__name__)

_QUOTA = web.AppKey("quota", ProviderQuota)
MAX_REQUEST_BYTES = 256 * 2**20
"""Largest request body taken (as a vLLM server takes large ones; ``/stats`` says the largest seen)."""


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[_STATE]
    try:
        raw = await request.read()
        state.largest_request_bytes = max(state.largest_request_bytes, len(raw))
        body = json.loads(raw)
    except ValueError:
        state.invalid += 1
        return _error(400, "the request body is not valid JSON")
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        state.invalid += 1
        return _error(400, "'messages' must be a non-empty list of message objects")
    if body.get("stream"):
        state.invalid += 1
        return _error(400, "stream is not supported by the rlmq scripted model")
    limit = _limit_of(body)
    if isinstance(limit, str):
        state.invalid += 1
        return _error(400, limit)
    quota = request.app.get(_QUOTA)
    entry = None
    if quota is not None:  # a provider's hard quota, counting every caller (rlmq.scripted.quota)
        entry, retry_after = quota.admit(sum(_words(_text(m.get("content"))) for m in messages) + limit)
        if entry is None:
            message = "[[mock:quota]] rate limit reached (test double)"
            return _error(429, message, kind="rate_limit_error", headers={"Retry-After": str(retry_after)})
    model = body.get("model")
    model = model if isinstance(model, str) else ""
    user = body.get("user")
    user = user if isinstance(user, str) else ""
    tool_names = _tool_names(body.get("tools"))
    rlm_root = not tool_names and messages[0].get("role") == "system"
    rlm_root = rlm_root and is_rlm_format_root(_text(messages[0].get("content")), offers_tools=False)
    repl = next((t for t in tool_names if t in ROOT_TOOL_NAMES), None)
    counted = state.counters(user, model, "root" if repl is not None or rlm_root else "sub")
    repeat = state.is_repeat(messages, body.get("tools"))
    for counts in counted:
        counts.requests += 1
        counts.repeats += repeat
    state.record(body)
    state.opened()
    try:
        response = await _answer(request, state, body, messages, limit, model, tool_names, rlm_root, counted)
    finally:
        state.closed()
    if quota is not None and entry is not None:
        quota.settle(entry, _tokens_served(response, limit))
    return response


def _tokens_served(response: web.StreamResponse, limit: int) -> int:
    """What an answer counts in a quota: its usage's total tokens; 0 for an error; ``limit`` when
    a completion came without usage."""
    if response.status != 200 or not isinstance(response, web.Response) or not isinstance(response.body, bytes):
        return 0
    usage = json.loads(response.body).get("usage")
    return int(usage["total_tokens"]) if isinstance(usage, dict) else limit


async def _answer(
    request: web.Request,
    state: _State,
    body: dict[str, Any],
    messages: list[dict[str, Any]],
    limit: int,
    model: str,
    tool_names: list[str],
    rlm_root: bool,
    counted: tuple[Any, ...],
) -> web.StreamResponse:

    if state.latency > 0:
        await asyncio.sleep(state.latency)
    partial = continued_answer(body, messages)
    if isinstance(partial, web.Response):
        return partial
    full_messages = messages
    if partial is not None:  # the reply is the same answer's, from where the partial one stops
        messages = messages[:-1]

    no_usage = False
    spend_all = False
    first_user = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
    repl = next((t for t in tool_names if t in ROOT_TOOL_NAMES), None)
    if repl is not None:
        first = messages[0]
        if first.get("role") == "system":  # what the root model was told, for tests (the last 64)
            system = _text(first.get("content"))
            state.system_prompts = [*state.system_prompts[-63:], system]
            depth = recursion_of(system).depth if "rlm_batch" in system else None
            key = "" if depth is None else str(depth)
            state.root_requests_by_depth[key] = state.root_requests_by_depth.get(key, 0) + 1
        window = context_tokens(first_user) if "[[mock:context-tokens:" in first_user else None
        if window is not None:
            used = sum(_words(_text(m.get("content"))) for m in messages)
            if used > window:
                for counts in counted:
                    counts.faults += 1
                return _error(400, context_length_message(window, used))
        try:
            reply = _root_reply(messages, repl)
        except ValueError as exc:  # a root-code directive that does not decode
            return _error(400, str(exc))
    elif rlm_root:
        reply = _Reply(content=rlm_format_reply(1 + sum(1 for m in messages if m.get("role") == "assistant")))
    else:
        prompt = next((_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
        if "[[mock:" in prompt:
            faults = _parse_faults(prompt)
            active = faults.any
            if active and faults.fail_times is not None:
                attempt = state.attempts[prompt] = state.attempts.get(prompt, 0) + 1
                active = attempt <= faults.fail_times
            if active:
                failed = await _apply_faults(request, faults)
                if failed is not None:
                    for counts in counted:
                        counts.faults += 1
                    return failed
                no_usage = faults.no_usage
            spend_all = "[[mock:spend-all]]" in prompt
        spend_all = spend_all or state.spend_all
        if "[[mock:ignore-max-tokens]]" in prompt:
            limit = 10**9  # a server that ignores max_tokens
        reply = _sub_reply(messages, prompt, bool(tool_names))
        length = answer_tokens(prompt) if "[[mock:tokens:" in prompt else None
        if length is not None and not reply.tool_calls:
            words = (reply.content or "").split()[:length]
            reply = _Reply(content=" ".join(words + ["tok"] * (length - len(words))))

    if partial is not None and not reply.tool_calls:
        reply = _Reply(content=rest_of_answer(reply.content or "", partial))
    messages = full_messages
    choice, completion_tokens = _completion(state, reply, limit, spend_all)
    prompt_tokens = sum(_words(_text(m.get("content"))) for m in messages)
    result: dict[str, Any] = {
        "id": f"chatcmpl-scripted-{next(state.ids)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": MODEL_FINGERPRINT,
        "choices": [{"index": 0, **choice, "logprobs": None}],
    }
    role = "root" if ROOT_TOOL_NAME in tool_names or rlm_root else "sub"
    completion_tokens = served_fields(state.served, body, result, messages, role) or completion_tokens
    if "[[mock:t" in first_user:  # paced like a real server, and counted per tag
        await asyncio.sleep(decode_seconds(first_user, completion_tokens))  # decoding time
        tag = tag_of(first_user)
        if tag is not None:
            tagged = state.per_tag.setdefault(tag, _Counts())
            tagged.requests += 1
            counted = (*counted, tagged)
    for counts in counted:
        counts.completions += 1
        counts.prompt_tokens += prompt_tokens
        counts.completion_tokens += completion_tokens  # what it served, whatever its usage says
    if not no_usage:
        reported = completion_tokens // 4 if "[[mock:usage-quarter]]" in first_user else completion_tokens
        result["usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": reported,
            "total_tokens": prompt_tokens + reported,
        }
    return web.Response(body=json.dumps(result).encode(), content_type=_JSON)


async def _apply_faults(request: web.Request, faults: _Faults) -> web.StreamResponse | None:
    """Sleep, then the failure response to send (None: answer normally)."""
    if faults.sleep is not None:
        await asyncio.sleep(faults.sleep)
    if faults.reset:
        transport = request.transport
        if transport is not None:
            transport.abort()
        return web.Response(status=499)  # never sent: the connection is gone
    if faults.status is not None:
        headers = {"Retry-After": faults.retry_after} if faults.retry_after is not None else None
        kind = "rate_limit_error" if faults.status == 429 else "server_error"
        return _error(faults.status, f"[[mock:status:{faults.status}]] scripted failure", kind=kind, headers=headers)
    if faults.malformed:
        return web.Response(body=b"{this is not JSON: [[mock:malformed]]", content_type=_JSON)
    return None


async def _models(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    names = [MODEL_FINGERPRINT, *(name for name in state.per_model if name and name != MODEL_FINGERPRINT)]
    created = int(state.started)
    data = [{"id": n, "object": "model", "created": created, "owned_by": "rlmq-test-double"} for n in names]
    return web.json_response({"object": "list", "data": data})


async def _stats(request: web.Request) -> web.Response:
    quota = request.app.get(_QUOTA)
    extra = {} if quota is None else {"quota": quota.snapshot()}
    return web.json_response({**request.app[_STATE].snapshot(), **extra})


async def _served(request: web.Request) -> web.Response:
    """``GET /served``: the replies served with token fields (:mod:`rlmq.scripted.tokens`)."""
    return web.json_response({"served": list(request.app[_STATE].served.items)})


async def _update_weight_version(request: web.Request) -> web.Response:
    """``POST /update_weight_version`` ``{"new_version": label}``: the label of its weights from now
    on (as vLLM's dev endpoint of that name sets it)."""
    try:
        label = (await request.json()).get("new_version")
    except (ValueError, AttributeError):
        label = None
    if not isinstance(label, str) or not 0 < len(label) <= 256:
        return _error(400, "new_version must be a label of 1 to 256 characters")
    request.app[_STATE].served.weight_version = label
    return web.json_response({"weight_version": label})


async def _reset_stats(request: web.Request) -> web.Response:
    request.app[_STATE].reset()
    return web.json_response(request.app[_STATE].snapshot())


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "server": f"{MODEL_FINGERPRINT} (test double)"})


def create_app(
    *, latency: float = 0.0, spend_all: bool = False, token_shape: str = "vllm", quota: ProviderQuota | None = None
) -> web.Application:
    """The aiohttp application of the scripted model.

    ``latency``: seconds slept before answering every chat completion (simulates a slow
    model). ``spend_all``: every sub-LLM completion is exactly its limit in tokens (words).
    ``token_shape``: the server whose token fields it answers in (``vllm``, ``sglang``:
    :mod:`rlmq.scripted.tokens`).
    ``quota``: a provider's hard quota over all callers (:mod:`rlmq.scripted.quota`).
    """
    if latency < 0:
        raise ConfigError("latency must be >= 0 seconds")
    try:
        served = ServedLog(token_shape)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
    app[_STATE] = _State(latency, spend_all)
    app[_STATE].served = served
    if quota is not None:
        app[_QUOTA] = quota
    for prefix in ("/v1", ""):
        app.router.add_post(f"{prefix}/chat/completions", _chat_completions)
        app.router.add_get(f"{prefix}/models", _models)
    app.router.add_get("/stats", _stats)
    app.router.add_get("/served", _served)
    app.router.add_post("/update_weight_version", _update_weight_version)
    app.router.add_delete("/stats", _reset_stats)
    app.router.add_get("/health", _health)
    return app


def _url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


class ScriptedModelServer:
    """Async context manager running the scripted server (a test double) in the current event loop.

    ``port=0`` lets the OS pick a free port; read it from :attr:`port` or :attr:`url`
    after :meth:`start`. ``latency`` is in seconds; ``spend_all`` makes every sub-LLM
    completion exactly its limit in tokens (words); ``token_shape`` is the server whose token
    fields it answers in (``vllm``, ``sglang``)::

        async with ScriptedModelServer() as server:
            client = openai.AsyncOpenAI(base_url=server.url, api_key="x", max_retries=0)
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        latency: float = 0.0,
        spend_all: bool = False,
        token_shape: str = "vllm",
        quota: ProviderQuota | None = None,
    ) -> None:
        self._host = host
        self._requested_port = port
        self._port: int | None = None
        self._app = create_app(latency=latency, spend_all=spend_all, token_shape=token_shape, quota=quota)
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Bind and serve; returns once the socket listens."""
        if self._runner is not None:
            return
        runner = web.AppRunner(self._app, access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, self._host, self._requested_port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._port = int(runner.addresses[0][1])
        log.info(LISTEN_LINE.format(url=self.url))

    async def stop(self) -> None:
        """Stop serving and close the socket (open requests are cancelled)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> ScriptedModelServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def port(self) -> int:
        """The bound TCP port (after :meth:`start`)."""
        if self._port is None:
            raise RuntimeError("the scripted model server is not started")
        return self._port

    @property
    def url(self) -> str:
        """The OpenAI ``base_url``: ``http://<host>:<port>/v1``."""
        return _url(self._host, self.port)

    @property
    def stats(self) -> dict[str, Any]:
        """A copy of the server's counters (the body of ``GET /stats``).

        Keys: ``requests`` (chat completions accepted, faults included), ``repeats`` (those of
        them whose conversation and tools an earlier request already had: a call sent again, by a
        retry, a re-run job or a lost race), ``completions``
        (200 answers with a completion), ``faults`` (scripted failures), ``prompt_tokens``
        and ``completion_tokens`` (tokens = words, of the completions served),
        ``invalid_requests`` (answered 400), and ``per_user`` / ``per_model``: the same six
        counters per ``user`` field value (``""`` when absent) and per requested model name;
        ``per_role``: the same per role, ``root`` (requests offering ``call_python_repl``) and ``sub``;
        ``per_tag``: the same per ``[[mock:tag:<name>]]`` of the first user message (counted
        when a completion is served: no faults);
        ``root_requests_by_depth``: root requests (with a system message) by the depth ``D`` of their
        scaffold line ``rlm_batch: ... (depth D of M)`` (:mod:`rlmq.scripted.recursion`; ``""``: no such line);
        ``root_system_prompts``: the system message of the last 64 root-model requests.
        ``in_flight``: chat completion requests accepted and not yet answered; ``in_flight_peak``: the
        most there were at once since the start (or the last reset, counting those still open then);
        ``last_request_at`` / ``last_answered_at``: Unix seconds of the last request accepted and of the
        last one that ended (answered, failed or abandoned by its client), ``None`` before any.
        ``params``: the last requests' fields besides ``messages`` and ``tools``.
        """
        return self._app[_STATE].snapshot()

    @property
    def served(self) -> list[dict[str, Any]]:
        """The replies served with token fields, oldest first (the body of ``GET /served``): ``id``,
        ``user``, ``role``, ``prompt_token_ids``, ``completion_token_ids``, ``completion_logprobs``."""
        return list(self._app[_STATE].served.items)

    def update_weight_version(self, label: str) -> None:
        """Label its weights ``label`` from now on (``POST /update_weight_version``)."""
        self._app[_STATE].served.weight_version = label

    def reset_stats(self) -> None:
        """Zero every counter (like ``DELETE /stats``), including fail-times attempt counts."""
        self._app[_STATE].reset()


async def _serve(
    host: str, port: int, latency: float, spend_all: bool, token_shape: str, quota: ProviderQuota | None = None
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-Unix
            pass
    async with ScriptedModelServer(
        host, port, latency=latency, spend_all=spend_all, token_shape=token_shape, quota=quota
    ) as server:
        print(LISTEN_LINE.format(url=server.url), flush=True)
        await stop.wait()


def serve(
    host: str,
    port: int,
    *,
    latency: float = 0.0,
    spend_all: bool = False,
    token_shape: str = "vllm",
    quota: ProviderQuota | None = None,
) -> None:
    """Run the scripted model (a test double) until SIGINT or SIGTERM; blocking.

    Prints ``rlmq scripted model (test double) listening on http://<host>:<port>/v1`` to
    stdout, flushed, with the port actually bound (so ``port=0`` works for a parent process
    reading that line). ``latency`` is in seconds; ``token_shape`` the server whose token fields it
    answers in (``vllm``, ``sglang``); ``quota``: a provider's hard quota.
    """
    try:
        asyncio.run(_serve(host, port, latency, spend_all, token_shape, quota))
    except KeyboardInterrupt:  # pragma: no cover - a second Ctrl-C
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rlmq.scripted.server [--host H] [--port P] [--latency S] [--spend-all] [--token-shape S]
    [--quota-rpm R] [--quota-tpm T] [--quota-window W]``."""
    parser = argparse.ArgumentParser(description="rlmq scripted OpenAI-compatible model (a test double)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed at start)")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds slept per chat completion")
    parser.add_argument("--spend-all", action="store_true", help="sub-LLM completions use their whole limit")
    parser.add_argument("--token-shape", choices=TOKEN_SHAPES, default="vllm", help="whose token fields it answers")
    parser.add_argument("--quota-rpm", type=int, default=None, help="answer 429 past this many requests per window")
    parser.add_argument("--quota-tpm", type=int, default=None, help="answer 429 past this many tokens per window")
    parser.add_argument("--quota-window", type=float, default=60.0, help="the quota's window in seconds")
    args = parser.parse_args(argv)
    quota = None
    if args.quota_rpm is not None or args.quota_tpm is not None:
        quota = ProviderQuota(args.quota_rpm, args.quota_tpm, args.quota_window)
    serve(
        args.host, args.port, latency=args.latency, spend_all=args.spend_all, token_shape=args.token_shape, quota=quota
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
