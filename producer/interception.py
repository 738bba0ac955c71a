"""The interception server: where ``llm_batch`` inside a rollout's REPL sends its prompts.

One aiohttp server per :class:`~producer.env.RLMEnv`, on 127.0.0.1 with an OS-assigned
port, as in the verifiers ``RLMEnv``, and on a Unix socket (``unix_path``): REPLs that run in
a network namespace of their own reach it only through that socket. Each rollout gets its own bearer token; a request
without a token, or with a token that belongs to no live rollout, is refused with 401, so
a REPL can reach only its own rollout. Bodies are validated (:class:`BatchRequest`) and
bounded (``max_batch_prompts`` prompts, ``max_batch_bytes`` bytes); a bad one gets a 4xx
with a message and nothing is enqueued.

``POST /llm_batch`` ``{"prompts": [str, ...]}`` ->
``200 {"results": [str, ...], "summary": str}``.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Awaitable, Callable

from aiohttp import web
from pydantic import ValidationError

from rlmq.common.schemas import BatchRequest

BatchHandler = Callable[[list[str]], Awaitable[tuple[list[str], str]]]
"""Runs a batch for one rollout: prompts -> (results in order, summary text)."""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class InterceptionServer:
    """Routes ``llm_batch`` requests to the rollout that owns the bearer token.

    Args:
        max_batch_prompts: most prompts one request may carry (default admits 10,000).
        max_batch_bytes: largest request body in bytes.
    """

    def __init__(self, *, max_batch_prompts: int = 10_000, max_batch_bytes: int = 64 * 1024 * 1024) -> None:
        self.max_batch_prompts = max_batch_prompts
        self.max_batch_bytes = max_batch_bytes
        self._handlers: dict[str, BatchHandler] = {}
        self._runner: web.AppRunner | None = None
        self._socket_dir: str | None = None
        self.port = 0
        self.unix_path: str | None = None

    @property
    def url(self) -> str:
        """The endpoint the REPL posts to."""
        return f"http://127.0.0.1:{self.port}/llm_batch"

    def register(self, handler: BatchHandler) -> str:
        """Register a rollout's batch handler; returns its fresh bearer token."""
        token = secrets.token_urlsafe(32)
        self._handlers[token] = handler
        return token

    def unregister(self, token: str) -> None:
        """Forget a rollout's token: its REPL can no longer send batches."""
        self._handlers.pop(token, None)

    def _lookup(self, request: web.Request) -> BatchHandler | None:
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            return None
        given = auth[7:].strip()
        for token, handler in self._handlers.items():
            if hmac.compare_digest(token, given):
                return handler
        return None

    async def _handle(self, request: web.Request) -> web.Response:
        handler = self._lookup(request)
        if handler is None:
            return _error(401, "missing or invalid rollout token")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body over {self.max_batch_bytes} bytes")
        try:
            body = BatchRequest.model_validate(json.loads(raw))
        except RecursionError:  # json.loads of deeply nested arrays/objects (100,000 levels)
            return _error(400, "body is nested too deeply")
        except (ValueError, ValidationError) as exc:
            detail = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else "body is not JSON"
            return _error(400, f'expected {{"prompts": [str, ...]}}: {detail}')
        if not body.prompts:
            return _error(400, "empty batch: give llm_batch at least one prompt")
        if len(body.prompts) > self.max_batch_prompts:
            return _error(413, f"batch of {len(body.prompts)} prompts is over the limit of {self.max_batch_prompts}")
        try:
            results, summary = await handler(body.prompts)
        except Exception as exc:  # e.g. Redis gone for good: a clear error, and the server stays up
            return _error(503, f"the sub-LLM service failed: {type(exc).__name__}: {exc}")
        return web.json_response({"results": results, "summary": summary})

    async def start(self) -> None:
        """Bind 127.0.0.1 on a free port."""
        app = web.Application(client_max_size=self.max_batch_bytes)
        app.router.add_post("/llm_batch", self._handle)
        # A short shutdown_timeout: stopping (a cancelled rollout, a verifiers agent timeout)
        # must not wait for an in-flight batch's sub-calls (up to sub_call_timeout).
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        self.port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
        # The socket must be reachable by REPLs running under uids of their own; the bearer
        # token, not the file mode, is what keeps one rollout out of another's batches.
        self._socket_dir = tempfile.mkdtemp(prefix="rlmq-icpt-")
        os.chmod(self._socket_dir, 0o755)
        self.unix_path = os.path.join(self._socket_dir, "llm_batch.sock")
        await web.UnixSite(self._runner, self.unix_path).start()
        os.chmod(self.unix_path, 0o666)

    async def stop(self) -> None:
        """Stop serving; idempotent."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
            self.unix_path = None
