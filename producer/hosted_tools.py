"""Hosted tools: the rollout's process runs its shared tools for sub-LLMs whose workers cannot.

verifiers' ``RLMEnv`` (#966 / 0.1.14) shares ``tools`` between the root REPL and the sub-LLMs,
as callables of the author's process. rlmq's sub-LLMs run on workers, which run a tool
themselves only if they allow-list its import path (the fast path). For any other shared tool
the worker sends the call here through Redis (:mod:`rlmq.common.tool_wire`), and each rollout
serves the requests of its own sub-calls with :class:`HostedToolServer` while it runs.

A call runs once per request id (a request sent again after a dropped connection, or by a job
re-run after its worker died, gets the stored answer), under ``hosted_tool_timeout`` seconds
(a sync callable in a daemon thread of its own, an async one awaited), its arguments at most
``root_tool_max_args_bytes`` and its answer (result or error) cut to ``sub_tool_max_result_chars``
characters, as a worker's own tool.
Its answer is kept ``rollout_key_ttl`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from rlmq.common.aio import raise_if_cancelling
from rlmq.common.errors import ConfigError
from rlmq.common.keys import RolloutKeys
from rlmq.common.metrics import Metrics
from rlmq.common.tool_registry import MAX_OUTPUT_CHARS, ToolRegistry, canonical_tool_path
from rlmq.common.tool_turns import FairTurns
from rlmq.common.tool_wire import CALLS_PER_ROLLOUT, FIELD, TOOL_ERROR, HostedTool, ToolCallAnswer, ToolCallRequest

__all__ = ["HostedToolServer", "HostedTools"]

log = logging.getLogger(__name__)

_READ_BLOCK_MS = 1000
_RETRY_PAUSE = 0.2


class HostedTools:
    """The shared tools of an environment, as the sub-LLMs are offered them and as this process runs them.

    Args:
        tools: ``(dotted path, callable)`` per shared tool.
        timeout: seconds one call may run (``hosted_tool_timeout``).
        max_args_bytes: largest arguments text of one call (``root_tool_max_args_bytes``).
        max_result_chars: characters of one call's answer, result or error
            (``sub_tool_max_result_chars``); the rest is cut with a marker before it reaches Redis.

    Raises:
        ConfigError: a callable's name or parameters cannot make a tool schema.
    """

    def __init__(
        self,
        tools: Sequence[tuple[str, Callable[..., Any]]],
        *,
        timeout: float,
        max_args_bytes: int,
        max_result_chars: int = MAX_OUTPUT_CHARS,
    ) -> None:
        canonical: list[tuple[str, Callable[..., Any]]] = []
        for path, func in tools:
            try:  # one without a tool schema stays a REPL tool; its sub-LLM calls fail as not allowed
                ToolRegistry.from_callables([(path, func)])
            except ConfigError as exc:
                log.warning("shared tool %s is not offered to the sub-LLMs by this process: %s", path, exc)
                continue
            canonical.append((canonical_tool_path(path), func))
        self.registry = ToolRegistry.from_callables(canonical, max_output_chars=max_result_chars)
        self.specs = tuple(HostedTool(path=p, tool_schema=self.registry.schemas([p])[0]) for p, _ in canonical)
        self.timeout = timeout
        self.max_args_bytes = max_args_bytes
        self.turns = FairTurns(CALLS_PER_ROLLOUT)
        """The calls run at once per rollout, fair between the rollouts this process serves (each
        :class:`HostedToolServer` of these tools takes its turns here)."""

    async def run(self, request: ToolCallRequest, owner: str = "") -> ToolCallAnswer:
        """Run one request; never raises (except cancellation): an error is a one-line answer.
        ``owner``: the rollout whose tree made it (sync calls hung past their timeout are capped
        per rollout, :data:`~rlmq.common.tool_registry.MAX_OVERRUN_THREADS`)."""
        if not self.registry.is_allowed(request.tool):
            text = f"{TOOL_ERROR} unknown tool {request.tool!r}: this rollout hosts {', '.join(self.registry.paths)}"
            return ToolCallAnswer(id=request.id, ok=False, text=text)
        size = len(request.arguments.encode())
        if size > self.max_args_bytes:
            name = self.registry.tool_name(request.tool)
            text = f"{TOOL_ERROR} {name}: arguments too large ({size} bytes, at most {self.max_args_bytes})"
            return ToolCallAnswer(id=request.id, ok=False, text=text)
        text = await self.registry.call(request.tool, request.arguments, timeout=self.timeout, owner=owner)
        return ToolCallAnswer(id=request.id, ok=not text.startswith(TOOL_ERROR), text=text)


class HostedToolServer:
    """Serves one rollout's hosted-tool requests while it runs (:meth:`serve` as a task).

    Args:
        redis: the producer's asyncio client.
        rollout_id: whose requests (``RolloutKeys.tool_requests``).
        tools: what may be run.
        answer_ttl: seconds an answer is kept (``rollout_key_ttl``).
        metrics: ``rlmq_hosted_tool_calls`` counted here, if given.
    """

    def __init__(
        self, redis: Redis, rollout_id: str, tools: HostedTools, *, answer_ttl: int, metrics: Metrics | None = None
    ) -> None:
        self.redis, self.keys, self.tools = redis, RolloutKeys(rollout_id), tools
        self.answer_ttl, self.metrics = answer_ttl, metrics
        self.calls = 0
        """Calls run (each request id once)."""
        self._seen: set[str] = set()
        self._running: set[asyncio.Task[None]] = set()
        self._stopped = False

    def stop(self) -> None:
        """Ask :meth:`serve` to end at its next turn (at most one blocking read later), whether
        or not its cancellation reaches it (see :func:`rlmq.common.aio.raise_if_cancelling`)."""
        self._stopped = True

    async def serve(self) -> None:
        """Read requests until cancelled or stopped (:meth:`stop`); each new id runs in a task of
        its own, at most :data:`~rlmq.common.tool_wire.CALLS_PER_ROLLOUT` at once, and while another
        rollout of the same :class:`HostedTools` runs calls, no more young calls than it runs
        (:class:`~rlmq.common.tool_turns.FairTurns`; the rest wait in the rollout's stream). A
        Redis error is retried (the stream is read again from the last entry seen). Every read
        blocks at most 1 s, and each turn checks both the stop flag and a swallowed cancellation:
        a cancelled server ends within about a second, never reads on."""
        last = "0-0"
        try:
            while not self._stopped:
                raise_if_cancelling()
                room = min(CALLS_PER_ROLLOUT - len(self._running), self.tools.turns.room(self.keys.rollout_id))
                if room <= 0:  # its calls wait in its stream: a flood runs its fair share at once, no more
                    if self._running:  # (or until its young calls grow old: its share counts those)
                        timeout = min(_READ_BLOCK_MS / 1000, self.tools.turns.young)
                        await asyncio.wait(self._running, timeout=timeout, return_when="FIRST_COMPLETED")
                    else:  # (none of its own: the turns' state changes with other rollouts' calls)
                        await asyncio.sleep(_RETRY_PAUSE)
                    continue
                try:
                    got: list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] = await self.redis.xread(
                        {self.keys.tool_requests: last}, count=room, block=_READ_BLOCK_MS
                    )  # type: ignore[assignment]
                except RedisError as exc:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():  # a cancel the read turned into its error
                        raise asyncio.CancelledError from exc  # (3.11's wait_for race): stop, as asked
                    log.warning("hosted tools of %s: reading requests failed: %s", self.keys.rollout_id, exc)
                    await asyncio.sleep(_RETRY_PAUSE)
                    continue
                taken: list[bytes] = []
                for _key, entries in got or []:
                    for entry_id, fields in entries:
                        last = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                        taken.append(entry_id)
                        self._take(fields)
                if taken:  # each id is remembered here: the stream need not keep the arguments
                    with contextlib.suppress(RedisError):
                        await self.redis.xdel(self.keys.tool_requests, *taken)
        finally:
            for task in list(self._running):
                task.cancel()
            with contextlib.suppress(RedisError):
                await self.redis.delete(self.keys.tool_requests)

    def _take(self, fields: dict[bytes, bytes]) -> None:
        raw = fields.get(FIELD.encode())
        try:
            request = ToolCallRequest.model_validate_json(raw or b"")
        except ValidationError:
            log.warning("hosted tools of %s: a request that is not one was ignored", self.keys.rollout_id)
            return
        if request.id in self._seen:
            return  # sent again (a dropped connection, a re-run job): its one run answers it
        self._seen.add(request.id)
        task = asyncio.create_task(self._answer(request), name=f"rlmq-hosted-tool-{request.id}")
        self._running.add(task)
        task.add_done_callback(functools.partial(self._ended, self.tools.turns.hold(self.keys.rollout_id)))

    def _ended(self, turn: float, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self.tools.turns.release(self.keys.rollout_id, turn)

    async def _answer(self, request: ToolCallRequest) -> None:
        self.calls += 1
        answer = await self.tools.run(request, self.keys.rollout_id)
        if self.metrics is not None:
            self.metrics.hosted_tool_calls.labels(outcome="ok" if answer.ok else "error").inc()
        key = self.keys.tool_answer(request.id)
        loop = asyncio.get_running_loop()
        ends = loop.time() + request.wait
        while True:
            try:
                async with self.redis.pipeline(transaction=True) as pipe:
                    pipe.delete(key)  # one entry, whatever an earlier try that failed left
                    pipe.xadd(key, {FIELD: answer.model_dump_json()})
                    pipe.expire(key, self.answer_ttl)
                    await pipe.execute()
                return
            except RedisError as exc:
                if loop.time() >= ends:
                    log.warning("hosted tools of %s: answer %s not written: %s", self.keys.rollout_id, request.id, exc)
                    return
                await asyncio.sleep(_RETRY_PAUSE)
