"""The interception server: where ``llm_batch`` inside a rollout's REPL sends its prompts.

One aiohttp server per :class:`~producer.env.RLMEnv`, on 127.0.0.1 with an OS-assigned
port, as in the verifiers ``RLMEnv``, and on one Unix socket per rollout
(:meth:`InterceptionServer.unix_path_of`): REPLs that run in a network namespace of their own
reach it only through that socket. Each rollout gets its own bearer token; a request
without a token, or with a token that belongs to no live rollout, is refused with 401, so
a REPL can reach only its own rollout. Bodies are validated (:class:`BatchRequest`) and
bounded (``max_batch_prompts`` prompts, ``max_batch_bytes`` bytes); a bad one gets a 4xx
with a message at once (a declared ``Content-Length`` over the limit before any byte of the
body is read; a body not in full within ``body_timeout`` seconds: 408; a prompt that is not
valid Unicode: 400 naming it) and nothing is enqueued.

One rollout's cell cannot starve another rollout or the producer of descriptors: each
rollout's socket has its own listen backlog and keeps at most ``max_connections_per_rollout``
connections open (extras are closed as soon as they are accepted), the TCP endpoint at most
``max_tcp_connections`` in all, and :meth:`InterceptionServer.start` raises the producer's own
``RLIMIT_NOFILE`` to its hard limit.

``POST /llm_batch`` ``{"prompts": [str, ...]}`` ->
``200 {"results": [str, ...], "summary": str}``.

``POST /rlm_batch`` ``{"tasks": [{"prompt": str, "context": JSON}, ...]}`` (child
rollouts, :mod:`rlmq.producer.rlm_batch`) -> ``200 {"results": [str, ...], "summary": str}``;
bounded and refused as ``/llm_batch`` is (tasks count as prompts, contexts count in the bytes).

``POST /root_tool`` ``{"name": str, "args": [...], "kwargs": {...}}`` (a root tool's stub in
the REPL; :mod:`rlmq.producer.root_tools`) -> ``200 {"result": <JSON value>}``, or
``200 {"error": str}`` when the tool failed (raised, timed out, returned too much). A body
over ``max_tool_bytes``, malformed, or naming a tool the rollout does not have gets a 4xx.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import resource
import secrets
import shutil
import socket
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from pydantic import BaseModel, ValidationError
from pydantic_core import to_json

from rlmq.common.schemas import BatchRequest, RlmBatchRequest, RlmTask, RootToolRequest
from rlmq.common.settings import setting_default

BatchHandler = Callable[[list[str]], Awaitable[tuple[list[str], str]]]
"""Runs a batch for one rollout: prompts -> (results in order, summary text)."""
RlmBatchHandler = Callable[[list[RlmTask]], Awaitable[tuple[list[str], str]]]
"""Runs an ``rlm_batch`` for one rollout: tasks -> (results in order, summary text)."""
ToolHandler = Callable[[str, list[Any], dict[str, Any]], Awaitable[tuple[bool, str]]]
"""Runs a root-tool call for one rollout: (name, args, kwargs) -> (ok, result JSON or error message);
raises ``LookupError`` for a name the rollout has no tool of."""


def _error(status: int, message: str) -> web.Response:
    response = web.json_response({"error": message}, status=status)
    response.force_close()  # no keep-alive after a refusal: the rest of a body is never waited for
    return response


_FD_RESERVE = 256
"""Descriptors the producer keeps free of interception connections (Redis, logs, REPL pipes)."""


def raise_open_files_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; returns the new soft limit
    (descriptors). The producer holds one descriptor per connection of every rollout's REPL."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


_Body = TypeVar("_Body", bound=BaseModel)


def _parse(raw: bytes, model: type[_Body], shape: str) -> _Body | web.Response:
    """``raw`` as a ``model``, or the 400 refusing it (not JSON, nested too deeply, not ``shape``)."""
    try:
        return model.model_validate(json.loads(raw))
    except RecursionError:  # json.loads of deeply nested arrays/objects (100,000 levels)
        return _error(400, "body is nested too deeply")
    except (ValueError, ValidationError) as exc:
        detail = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else "body is not JSON"
        return _error(400, f"expected {shape}: {detail}")


def _first_invalid_text(prompts: list[str]) -> str | None:
    """A message naming the first prompt that is not valid Unicode (a lone surrogate), else None."""
    for i, prompt in enumerate(prompts):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (
                f"prompts[{i}] is not valid Unicode text: a lone surrogate {prompt[exc.start]!r} at "
                f"character {exc.start}; send text only"
            )
    return None


class _Listener:
    """One listening socket (a rollout's Unix socket, or the TCP endpoint) with its own accept
    loop: at most ``cap`` of its connections are served at once (by aiohttp's ``server``); one
    past it is closed as soon as it is accepted, before any transport exists, so the producer
    holds no descriptor for it (asyncio's own server keeps an aborted connection's descriptor
    until a later loop iteration: 2,600 of them under a flood)."""

    def __init__(
        self, sock: socket.socket, server: web.Server, cap: int | Callable[[], int], folder: str | None = None
    ) -> None:
        self.sock = sock
        self.server = server
        self.cap = cap
        self.folder = folder
        self.live: list[RequestHandler] = []
        self.refused = 0
        self._pending: set[asyncio.Task[None]] = set()
        self._loop = asyncio.get_running_loop()
        self._open = True
        self._loop.add_reader(sock.fileno(), self._accept)

    def connections(self) -> int:
        """Connections served now (and being set up)."""
        self.live = [h for h in self.live if h.transport is not None]
        return len(self.live) + len(self._pending)

    def _accept(self) -> None:
        for _ in range(256):  # then back to the loop: other listeners are served in between
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # EMFILE and the like: pause this listener for a second, as asyncio does
                self._loop.remove_reader(self.sock.fileno())
                self._loop.call_later(1.0, self._resume)
                return
            if self.connections() >= (self.cap() if callable(self.cap) else self.cap):
                self.refused += 1
                conn.close()
                continue
            conn.setblocking(False)
            task = self._loop.create_task(self._serve(conn))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    def shed(self, cap: int) -> None:
        """Abort its newest connections past ``cap`` (another rollout's socket made its share
        of the producer's descriptors smaller)."""
        self.connections()
        while self._pending and len(self.live) + len(self._pending) > cap:
            self._pending.pop().cancel()  # its _serve closes the accepted socket
        while len(self.live) > cap:
            handler = self.live.pop()
            if handler.transport is not None:
                handler.transport.abort()

    def _resume(self) -> None:
        if self._open:
            self._loop.add_reader(self.sock.fileno(), self._accept)

    async def _serve(self, conn: socket.socket) -> None:
        try:
            _, handler = await self._loop.connect_accepted_socket(self.server, sock=conn)
        except BaseException:
            conn.close()
            raise
        self.live.append(handler)

    def close(self, connections: bool = True) -> None:
        """Stop listening, close every connection it holds (unless ``connections`` is false:
        the caller shuts them down) and remove its folder; idempotent."""
        if self._open:
            self._open = False
            self._loop.remove_reader(self.sock.fileno())
            self.sock.close()
        for task in list(self._pending):
            task.cancel()
        if connections:
            self.close_connections()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def close_connections(self) -> list[asyncio.Task[None]]:
        """Abort every connection it serves; returns their handlers' tasks (they end on the
        loop's next turns)."""
        tasks: list[asyncio.Task[None]] = []
        for handler in self.live:
            if handler.transport is not None:
                handler.transport.abort()
            task = getattr(handler, "_task_handler", None)  # aiohttp's own task for the connection
            if isinstance(task, asyncio.Task) and not task.done():
                tasks.append(task)
        self.live = []
        return tasks


class InterceptionServer:
    """Routes ``llm_batch`` requests to the rollout that owns the bearer token.

    Args:
        max_batch_prompts: most prompts one request may carry (default admits 10,000).
        max_batch_bytes: largest request body in bytes.
        max_connections_per_rollout: connections one rollout's Unix socket keeps open at once;
            a connection past it is closed as soon as it is accepted (the REPL child sends at
            most 8 requests at once per process).
        max_tcp_connections: the same, for the TCP endpoint, all clients together.
        body_timeout: seconds a request's body may take to arrive in full (then 408).
        max_tool_bytes: largest root-tool request body in bytes.
    """

    def __init__(
        self,
        *,
        max_batch_prompts: int = setting_default("max_batch_prompts"),
        max_batch_bytes: int = setting_default("max_batch_bytes"),
        max_connections_per_rollout: int = 64,
        max_tcp_connections: int = 256,
        body_timeout: float = 60.0,
        max_tool_bytes: int = 1024 * 1024,
    ) -> None:
        self.max_batch_prompts = max_batch_prompts
        self.max_batch_bytes = max_batch_bytes
        self.max_connections_per_rollout = max_connections_per_rollout
        self.max_tcp_connections = max_tcp_connections
        self.body_timeout = body_timeout
        self.max_tool_bytes = max_tool_bytes
        self._handlers: dict[str, BatchHandler] = {}
        self._tool_handlers: dict[str, ToolHandler] = {}
        self._rlm_handlers: dict[str, RlmBatchHandler] = {}
        self._sockets: dict[str, _Listener] = {}
        self._tcp: _Listener | None = None
        self._runner: web.AppRunner | None = None
        self._fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.port = 0

    @property
    def url(self) -> str:
        """The endpoint the REPL posts to."""
        return f"http://127.0.0.1:{self.port}/llm_batch"

    def register(
        self, handler: BatchHandler, tools: ToolHandler | None = None, rlm: RlmBatchHandler | None = None
    ) -> str:
        """Register a rollout's batch handler (and its root-tool handler, if it has tools, and its
        ``rlm_batch`` handler, if given); returns its fresh bearer token. Once the server is started
        (now or later), the rollout also has a Unix socket of its own (:meth:`unix_path_of`)."""
        token = secrets.token_urlsafe(32)
        self._handlers[token] = handler
        if tools is not None:
            self._tool_handlers[token] = tools
        if rlm is not None:
            self._rlm_handlers[token] = rlm
        if self._runner is not None:
            self._open_socket(token)
        return token

    def unregister(self, token: str) -> None:
        """Forget a rollout's token and close its socket and connections: its REPL can no
        longer send batches nor call tools."""
        self._handlers.pop(token, None)
        self._tool_handlers.pop(token, None)
        self._rlm_handlers.pop(token, None)
        listener = self._sockets.pop(token, None)
        if listener is not None:
            listener.close()

    def unix_path_of(self, token: str) -> str | None:
        """The path of the rollout's own Unix socket (``None`` before :meth:`start` or for an
        unknown token). Its folder is the socket's alone, so a REPL's private file system can
        show it this one socket."""
        listener = self._sockets.get(token)
        if listener is None or listener.folder is None:
            return None
        return os.path.join(listener.folder, "llm_batch.sock")

    def connections_of(self, token: str) -> int:
        """Connections the rollout's socket holds open now (for tests and diagnostics)."""
        listener = self._sockets.get(token)
        if listener is None:
            return 0
        return listener.connections()

    def _open_socket(self, token: str) -> None:
        assert self._runner is not None and self._runner.server is not None
        # The folder stays the producer's alone (0700) until the rollout's REPL child, started as
        # root, gives it to its own uid's group (0750): no other REPL can connect, not even
        # before this one starts (to fill its connection cap). The bearer token, not the file
        # mode, keeps one rollout out of another's batches where all run as one user.
        folder = tempfile.mkdtemp(prefix="rlmq-icpt-")
        path = os.path.join(folder, "llm_batch.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, 0o666)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self._sockets[token] = _Listener(sock, self._runner.server, self._rollout_cap, folder)
        cap = self._rollout_cap()
        for listener in self._sockets.values():  # rollouts flooding since before keep no more than theirs
            listener.shed(cap)

    def _rollout_cap(self) -> int:
        """Connections one rollout's socket may hold now: ``max_connections_per_rollout``, or less
        when every rollout at that cap would leave the producer under ``_FD_RESERVE`` free
        descriptors (a fair share of what the open-files limit leaves, at least 2)."""
        limit = self._fd_limit if self._fd_limit != resource.RLIM_INFINITY else 1 << 30
        share = max(2, (limit - _FD_RESERVE - self.max_tcp_connections) // max(1, len(self._sockets)))
        return min(self.max_connections_per_rollout, share)

    def _token(self, request: web.Request) -> str | None:
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            return None
        given = auth[7:].strip()
        for token in self._handlers:
            if hmac.compare_digest(token, given):
                return token
        return None

    def _lookup(self, request: web.Request) -> BatchHandler | None:
        token = self._token(request)
        return None if token is None else self._handlers.get(token)

    async def _read_batch_body(self, request: web.Request) -> bytes | web.Response:
        """A batch request's body, or the 4xx refusing it (over ``max_batch_bytes``, or slow)."""
        declared = request.content_length
        if declared is not None and declared > self.max_batch_bytes:
            return _error(413, f"request body of {declared} bytes is over the limit of {self.max_batch_bytes} bytes")
        try:
            return await asyncio.wait_for(request.read(), self.body_timeout)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body over {self.max_batch_bytes} bytes")
        except TimeoutError:
            return _error(408, f"the request body did not arrive in full within {self.body_timeout:g} s")

    async def _handle(self, request: web.Request) -> web.Response:
        handler = self._lookup(request)
        if handler is None:
            return _error(401, "missing or invalid rollout token")
        raw = await self._read_batch_body(request)
        if isinstance(raw, web.Response):
            return raw
        body = _parse(raw, BatchRequest, '{"prompts": [str, ...]}')
        if isinstance(body, web.Response):
            return body
        if not body.prompts:
            return _error(400, "empty batch: give llm_batch at least one prompt")
        if len(body.prompts) > self.max_batch_prompts:
            return _error(413, f"batch of {len(body.prompts)} prompts is over the limit of {self.max_batch_prompts}")
        invalid = _first_invalid_text(body.prompts)
        if invalid is not None:
            return _error(400, invalid)
        try:
            results, summary = await handler(body.prompts)
        except Exception as exc:  # e.g. Redis gone for good: a clear error, and the server stays up
            return _error(503, f"the sub-LLM service failed: {type(exc).__name__}: {exc}")
        return web.json_response({"results": results, "summary": summary})

    async def _handle_rlm(self, request: web.Request) -> web.Response:
        token = self._token(request)
        if token is None:
            return _error(401, "missing or invalid rollout token")
        raw = await self._read_batch_body(request)
        if isinstance(raw, web.Response):
            return raw
        body = _parse(raw, RlmBatchRequest, '{"tasks": [{"prompt": str, "context": JSON}, ...]}')
        if isinstance(body, web.Response):
            return body
        handler = self._rlm_handlers.get(token)
        if handler is None:
            return _error(404, "this rollout has no rlm_batch")
        if not body.tasks:
            return _error(400, "empty batch: give rlm_batch at least one task")
        if len(body.tasks) > self.max_batch_prompts:
            return _error(413, f"batch of {len(body.tasks)} tasks is over the limit of {self.max_batch_prompts}")
        invalid = _first_invalid_text([t.prompt for t in body.tasks])
        if invalid is not None:
            return _error(400, invalid.replace("prompts[", "tasks[").replace("] is", "].prompt is", 1))
        for i, t in enumerate(body.tasks):
            try:  # it travels on as JSON in the child's job: text only, nested no deeper than that allows
                to_json(t.context)
            except ValueError:
                return _error(400, f"tasks[{i}].context is not valid Unicode text or is nested too deeply")
        try:
            results, summary = await handler(body.tasks)
        except Exception as exc:  # e.g. Redis gone for good: a clear error, and the server stays up
            return _error(503, f"the rlm_batch service failed: {type(exc).__name__}: {exc}")
        return web.json_response({"results": results, "summary": summary})

    async def _read_tool_body(self, request: web.Request) -> bytes:
        """The body, whole, or its first ``max_tool_bytes + 1`` bytes: ``read(n)`` gives what has
        arrived so far, so a body split across segments is read on to its end."""
        raw = bytearray()
        while len(raw) <= self.max_tool_bytes:
            chunk = await request.content.read(self.max_tool_bytes + 1 - len(raw))
            if not chunk:
                break
            raw += chunk
        return bytes(raw)

    async def _handle_tool(self, request: web.Request) -> web.Response:
        token = self._token(request)
        if token is None:
            return _error(401, "missing or invalid rollout token")
        handler = self._tool_handlers.get(token)
        if request.content_length is not None and request.content_length > self.max_tool_bytes:
            return _error(413, f"tool arguments over {self.max_tool_bytes} bytes")
        try:
            raw = await asyncio.wait_for(self._read_tool_body(request), self.body_timeout)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"tool arguments over {self.max_tool_bytes} bytes")
        except TimeoutError:
            return _error(408, f"the request body did not arrive in full within {self.body_timeout:g} s")
        if len(raw) > self.max_tool_bytes:
            return _error(413, f"tool arguments over {self.max_tool_bytes} bytes")
        body = _parse(raw, RootToolRequest, '{"name": str, "args": [...], "kwargs": {...}}')
        if isinstance(body, web.Response):
            return body
        if handler is None:
            return _error(404, f"this rollout has no root tools (asked for {body.name!r})")
        try:
            ok, text = await handler(body.name, body.args, body.kwargs)
        except LookupError as exc:  # a name the rollout has no tool of
            return _error(404, str(exc.args[0]) if exc.args else "no such root tool")
        if not ok:
            return web.json_response({"error": text})
        return web.Response(body=b'{"result": ' + text.encode("ascii") + b"}", content_type="application/json")

    async def start(self) -> None:
        """Bind 127.0.0.1 on a free port, open a Unix socket for every rollout registered so
        far, and raise this process's ``RLIMIT_NOFILE`` to its hard limit."""
        self._fd_limit = raise_open_files_limit()
        app = web.Application(client_max_size=self.max_batch_bytes)
        app.router.add_post("/llm_batch", self._handle)
        app.router.add_post("/root_tool", self._handle_tool)
        app.router.add_post("/rlm_batch", self._handle_rlm)
        # A short shutdown_timeout: stopping (a cancelled rollout, a verifiers agent timeout)
        # must not wait for an in-flight batch's sub-calls (up to sub_call_timeout).
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        assert self._runner.server is not None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", 0))
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.port = int(sock.getsockname()[1])
        self._tcp = _Listener(sock, self._runner.server, self.max_tcp_connections)
        for token in self._handlers:
            self._open_socket(token)

    async def stop(self) -> None:
        """Stop serving; idempotent."""
        listeners = list(self._sockets.values()) + ([self._tcp] if self._tcp is not None else [])
        self._sockets.clear()
        self._tcp = None
        for listener in listeners:
            listener.close(connections=False)  # aiohttp's cleanup shuts them down (1 s at most)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        tasks = [task for listener in listeners for task in listener.close_connections()]
        if tasks:  # let the aborted connections' handlers end before the loop may close
            await asyncio.wait(tasks, timeout=1.0)
