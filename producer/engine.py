"""The rollout engine: one rollout from its options and its dependencies, in any process.

:func:`run_rollout` runs one RLM rollout of a dataset row: it announces the rollout
(:mod:`rlmq.producer.live`), opens its budget ledger (:mod:`rlmq.producer.budget`), registers
its ``llm_batch`` handler (and its root tools' handler, :mod:`rlmq.producer.root_tools`, and its
``rlm_batch`` handler, :mod:`rlmq.producer.rlm_batch`) on the host's interception endpoint,
writes the scaffold (with the author's ``system_prompt``), starts the rollout's REPL, runs the
root loop (:mod:`rlmq.producer.root_loop`) under the rollout's wall-clock deadline, and builds
the result row.

It reads only :class:`~rlmq.common.settings.RolloutOptions` (per-rollout knobs, no secrets),
never ``Settings``, the environment or an API key: what a process owns (the Redis connection,
the root model client, the interception server, metrics, the live-rollout refresh) comes in
as a :class:`RolloutHost`. ``RLMEnv`` is one host; a worker hosting child rollouts can be
another (it may import this module; nothing here imports :mod:`rlmq.workers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.asyncio import Redis

from rlmq.common.aio import cancel_and_wait
from rlmq.common.metrics import Metrics
from rlmq.common.sampling import root_turn_max_tokens
from rlmq.common.schemas import DatasetRow, ResultRow, RlmTask, StopReason
from rlmq.common.settings import RolloutOptions, setting_default
from rlmq.common.token_servers import TokenApi, TokenFieldsLog
from rlmq.common.token_wire import turn_counts
from rlmq.common.tool_wire import HostedTool
from rlmq.common.tree import TreePosition
from rlmq.producer.dispatch import Dispatcher
from rlmq.producer.hosted_tools import HostedTools, HostedToolServer
from rlmq.producer.interception import BatchHandler, RlmBatchHandler, ToolHandler
from rlmq.producer.live import LiveRollouts
from rlmq.producer.llm_batch import LlmBatchService
from rlmq.producer.repl import Repl
from rlmq.producer.repl.files import context_files, file_name, repl_context
from rlmq.producer.rlm_batch import RlmBatchService
from rlmq.producer.rollout import Rollout, RolloutResult, normalize_answer
from rlmq.producer.root import RootClient
from rlmq.producer.root_loop import CellRunner, root_loop
from rlmq.producer.root_tools import RootToolbox, RootToolService
from rlmq.producer.scaffold import compose_system_prompt, files_text, root_system_prompt, sub_tool_lines
from rlmq.producer.tree_metrics import first_sub_call_error, tree_metrics
from rlmq.producer.tree_node import TreeNode, chain_of, tree_position

__all__ = [
    "Interception", "ReplFactory", "ReplSession", "RolloutHost", "raise_if_cancelled", "run_rollout", "sandbox_repl",
]  # fmt: skip


class ReplSession(CellRunner, Protocol):
    """A rollout's REPL as the engine drives it (:class:`~rlmq.producer.repl.Repl`)."""

    async def start(self) -> None:
        """Start it (within ``max_startup_wait_seconds``).

        Raises:
            ReplStartupError: it did not come up.
        """
        ...

    async def close(self) -> None:
        """Kill it and remove its files; idempotent."""
        ...

    async def retain_files(self) -> str | None:
        """Copy its working directory to a new host folder; returns its path (``None``: not running)."""
        ...

    def serving(self) -> AbstractAsyncContextManager[None]:
        """Wraps the serving of one of its ``llm_batch`` requests (pauses its cell clock)."""
        ...


ReplFactory = Callable[[DatasetRow, str, RolloutOptions, "Interception", Sequence[dict[str, str]]], ReplSession]
"""Makes a rollout's REPL: ``(dataset row, bearer token, options, interception endpoint, root tools
({"name", "doc"} each)) -> ReplSession``."""


def sandbox_repl(
    row: DatasetRow, token: str, options: RolloutOptions, interception: Interception, tools: Sequence[dict[str, str]]
) -> Repl:
    """The production REPL: a sandboxed subprocess (:class:`~rlmq.producer.repl.Repl`) holding
    ``row``'s context as the ``context`` variable (:func:`~rlmq.producer.repl.files.repl_context`)
    and as files in its working directory (:func:`~rlmq.producer.repl.files.context_files`),
    posting ``llm_batch`` and its root ``tools``' calls to ``interception`` with ``token``.

    Raises:
        ValueError: the row's file context is neither a str nor JSON-serializable.
    """
    return Repl(
        context=repl_context(row),
        files=context_files(row),
        language=options.repl_language,
        output_format=options.repl_output_format,
        sub_llms=options.enable_sub_llms,
        endpoint_url=interception.url,
        unix_socket=interception.unix_path_of(token),
        token=token,
        max_output_length=options.max_output_length,
        code_execution_timeout=options.code_execution_timeout,
        max_startup_wait_seconds=options.max_startup_wait_seconds,
        pip_install_packages=options.pip_install_packages,
        max_batch_bytes=options.max_batch_bytes,
        max_batch_prompts=options.max_batch_prompts,
        tools=tools,
        tool_timeout=options.root_tool_timeout,
        max_tool_bytes=options.root_tool_max_args_bytes,
    )


class Interception(Protocol):
    """Where a rollout's REPL sends ``llm_batch``: an endpoint its host serves
    (:class:`~rlmq.producer.interception.InterceptionServer`), on which each rollout registers
    a handler under a bearer token of its own."""

    @property
    def url(self) -> str:
        """The HTTP endpoint (127.0.0.1) the REPL posts to."""
        ...

    def unix_path_of(self, token: str) -> str | None:
        """The Unix socket of the rollout with ``token`` (REPLs without network reach the
        endpoint only there; ``None`` when the endpoint has none)."""
        ...

    def register(
        self, handler: BatchHandler, tools: ToolHandler | None = None, rlm: RlmBatchHandler | None = None
    ) -> str:
        """Register a rollout's batch handler (and its root-tool handler, if it has tools, and
        its ``rlm_batch`` handler); returns its fresh bearer token."""
        ...

    def unregister(self, token: str) -> None:
        """Forget a token: its REPL can no longer send batches."""
        ...


@dataclass
class RolloutHost:
    """What the process running rollouts lends each of them; shared by all its rollouts.

    Attributes:
        redis: asyncio Redis client (``decode_responses=False``; its pool must allow one
            blocking connection per ``llm_batch`` in flight).
        root: the root model client.
        interception: the ``llm_batch`` endpoint the rollouts' REPLs post to.
        batches: runs ``llm_batch`` calls as jobs on the fleet.
        live: the live rollouts, whose keys the host keeps from expiring
            (:meth:`LiveRollouts.refresh_forever`).
        toolbox: the root (REPL) tools, Python callables that run in this process (``None``: none).
        make_repl: makes each rollout's REPL (default :func:`sandbox_repl`).
        rlm: runs ``rlm_batch`` calls (child rollouts on the fleet); ``None``: one over ``batches``.
    """

    redis: Redis
    root: RootClient
    interception: Interception
    batches: LlmBatchService
    live: LiveRollouts
    toolbox: RootToolbox | None = None
    hosted: HostedTools | None = None
    """Shared tools this process runs for the sub-LLMs' workers that do not allow-list them."""
    make_repl: ReplFactory = sandbox_repl
    rlm: RlmBatchService | None = None
    frozen: bool = False
    """Its root model server is not the policy being trained (``frozen_fleet``): with
    ``include_sub_llm_in_trajectory`` its rollouts' root turns are marked ``frozen_fleet``."""
    token_api: TokenApi = field(default_factory=TokenApi)
    """How its root model server is asked for served tokens (``token_ids_api``, ``weight_versions``)."""
    token_fields_log: TokenFieldsLog = field(default_factory=TokenFieldsLog)
    """Says once for all its rollouts that the root model server answers no token field rlmq reads."""

    @classmethod
    def build(
        cls,
        redis: Redis,
        root: RootClient,
        interception: Interception,
        *,
        metrics: Metrics | None = None,
        result_ttl: int = setting_default("result_ttl"),
        toolbox: RootToolbox | None = None,
    ) -> RolloutHost:
        """A host from its connections: one dispatcher, ``llm_batch`` service and live set.

        Args:
            metrics: updated with each batch and each refused sub-call, if given.
            result_ttl: seconds RQ keeps a finished sub-call job.
            toolbox: the root tools of the rollouts, if any.
        """
        batches = LlmBatchService(Dispatcher(redis), metrics, result_ttl=result_ttl)
        live = LiveRollouts(redis)
        return cls(
            redis=redis, root=root, interception=interception, batches=batches, live=live, toolbox=toolbox,
            rlm=RlmBatchService(batches, metrics),
        )  # fmt: skip


def raise_if_cancelled(what: str) -> None:
    """End the current task with :class:`asyncio.CancelledError` if it is being cancelled.

    A rollout that a stop cut short is not a finished rollout, whatever its end looked like:
    a cancellation that arrived while a library call failed (uvloop's closed pipe, a Redis
    client that swallowed it) must not come out as a row with ``stop_reason="error"``.
    ``asyncio.timeout`` uncancels the task when it turns its own cancellation into
    ``TimeoutError``, so a rollout's deadline still ends as an error row.

    Args:
        what: names the rollout in the exception's message.

    Raises:
        asyncio.CancelledError: the current task has a cancellation pending.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError(f"{what} was cancelled before it finished")


async def run_rollout(
    host: RolloutHost,
    row: DatasetRow,
    options: RolloutOptions,
    *,
    model: str,
    queue: str,
    rollout_id: str | None = None,
    rollout_index: int | None = None,
    tree: TreePosition | None = None,
    hosted_tools: Sequence[HostedTool] = (),
) -> RolloutResult:
    """Run one rollout of ``row`` with root model ``model``; its sub-calls go to ``queue``.

    Args:
        host: the process's connections (see :class:`RolloutHost`).
        row: the dataset row (``question`` is the first user message, verbatim; ``context``
            the REPL's ``context``).
        options: every limit of this rollout (``sub_model`` defaults to ``model``).
        model: the root model's name.
        queue: the (tenant) queue the sub-calls are enqueued on.
        rollout_id: ``[A-Za-z0-9_-]{1,64}``; a fresh uuid4 hex when ``None``.
        rollout_index: which of the row's rollouts this is (from 0), the result row's
            ``rollout``; ``None`` when the row has one.
        tree: the rollout's place in its rollout tree; ``None``: a top rollout (depth 1,
            ``max_depth`` = ``options.max_depth``). Its ``rlm_batch`` starts child rollouts while
            ``depth < max_depth``, else runs plain sub-LLM calls.
            Its depth and parent are announced with the rollout (``rlmq status``).
            A top opens the tree's ledger and its node and closes the ledger when it ends; a
            child (depth >= 2) charges ``tree.ledger_id``, opens and deletes its own node, its calls
            carry ``(*tree.nodes, rollout_id)`` and its root turns reserve from the tree's budget
            (:mod:`rlmq.producer.tree_node`).
        hosted_tools: a child's: the shared tools its tree's top rollout runs in its own process
            (:class:`~rlmq.common.schemas.ChildRolloutRequest`); its sub-calls offer them. A top
            rollout offers those of ``host.hosted`` and serves their calls while it runs.

    Returns:
        The result row, trajectory and messages. ``stop_reason`` is one of
        :data:`~rlmq.common.schemas.StopReason` (see :func:`~rlmq.producer.root_loop.root_loop`).
        A failure inside the rollout (the root model, the REPL, the deadline ``rollout_timeout``,
        which holds also without a turn limit) ends it with ``stop_reason="error"`` and the
        message in ``row.error``; it is not raised.

    Raises:
        redis.RedisError: Redis failed while the rollout was announced or its ledger opened or
            read (before the first turn or after the last).
        ValueError: ``tree`` is a top position whose ledger is not ``rollout_id``.
        asyncio.CancelledError: the rollout was cancelled before it finished, also when the
            cancellation surfaced as another exception inside it: a rollout cut short never
            becomes a row (see :func:`raise_if_cancelled`).
    """
    sub_model = options.sub_model or model
    rid = rollout_id or uuid.uuid4().hex
    pos = tree_position(rid, tree, options.max_depth)
    ro = Rollout(
        id=rid, row=row, model=model, sub_model=sub_model, queue=queue, options=options,
        ledger_id=pos.ledger_id, nodes=chain_of(rid, pos), frozen=host.frozen, hosted_tools=tuple(hosted_tools),
        token_api=host.token_api, token_fields_log=host.token_fields_log,
    )  # fmt: skip
    run = _RolloutRun(host, ro, pos)
    stop, final, error = await run.run()
    raise_if_cancelled(f"rollout {rid} of row {row.id}")
    return await run.result(stop, final, error, rollout_index)


class _RolloutRun:
    """One rollout's lifecycle (:func:`run_rollout`): its parts acquired in order (live entry,
    tree node, registration on the interception endpoint, REPL), each pushing its undo on one
    :class:`contextlib.AsyncExitStack`, so the teardown is written once, whatever fails; and the
    handlers of its REPL's requests (``llm_batch``, ``rlm_batch``, root tools)."""

    def __init__(self, host: RolloutHost, ro: Rollout, pos: TreePosition) -> None:
        self.host, self.ro, self.pos, self.options = host, ro, pos, ro.options
        self.node = TreeNode(host.redis, ro, pos)
        self.rlm = host.rlm or RlmBatchService(host.batches)
        self.batch_sem, self.rlm_sem, self.tool_sem = asyncio.Semaphore(1), asyncio.Semaphore(1), asyncio.Semaphore(1)
        self.ends_at = time.monotonic() + self.options.rollout_timeout  # (re)set when the deadline starts
        toolbox = host.toolbox if host.toolbox is not None and host.toolbox.tools else None
        self.toolbox = toolbox
        self.tools = RootToolService(toolbox) if toolbox is not None else None
        ro.stats.root_tool_calls = dict.fromkeys(toolbox.names if toolbox else [], 0)
        self.token: str | None = None
        self._repl: ReplSession | None = None
        self._served = True  # until _stop_serving

    # ------------------------------------------------------------------ the lifecycle

    async def run(self) -> tuple[StopReason, str | None, str | None]:
        """Acquire the parts, run the root loop under the rollout's deadline, tear down.

        Returns:
            ``(stop reason, final answer, error)``; a failure inside the rollout is an ``error``.

        Raises:
            redis.RedisError: announcing the rollout or opening its node failed.
            BaseException: whatever making the REPL raised (everything acquired is undone).
        """
        async with contextlib.AsyncExitStack() as stack:
            await self._announce(stack)
            stack.push_async_callback(self.node.close)  # its tree (a top) or subtree (a child) gets no more grants
            await self.node.open()
            self._serve_hosted_tools(stack)
            self.token = self.host.interception.register(
                self.handle_batch, self.handle_tool if self.tools is not None else None, self.handle_rlm
            )
            stack.callback(self._stop_serving)
            self._compose_messages()
            repl = self._make_repl()
            stack.push_async_callback(self._close_repl, repl)
            return await self._run_root(repl)
        raise AssertionError("unreachable")  # pragma: no cover  (the stack never swallows)

    def _serve_hosted_tools(self, stack: contextlib.AsyncExitStack) -> None:
        """Serve the calls of the shared tools this process hosts, made by the sub-LLMs of the
        rollout's whole tree, until the rollout (a top: the tree outlives none of its children) ends."""
        hosted = self.host.hosted
        if hosted is None or not hosted.specs or self.pos.depth > 1:
            return
        self.ro.hosted_tools = hosted.specs
        server = HostedToolServer(
            self.host.redis,
            self.ro.id,
            hosted,
            answer_ttl=self.options.rollout_key_ttl,
            metrics=self.host.batches.metrics,
        )
        task = asyncio.create_task(server.serve(), name=f"rlmq-hosted-tools-{self.ro.id}")

        async def stop() -> None:
            server.stop()  # it ends at its next turn even where a cancellation is swallowed
            await cancel_and_wait([task])

        stack.push_async_callback(stop)

    async def _announce(self, stack: contextlib.AsyncExitStack) -> None:
        """List the rollout as live (``rlmq status``, its keys refreshed) until it ends."""
        pos, ro = self.pos, self.ro
        info: dict[str, str | int | float] = {
            "model": ro.model, "sub_model": ro.sub_model, "queue": ro.queue, "started": time.time(), "row": ro.row.id
        }  # fmt: skip
        if pos.depth > 1:
            info.update(depth=pos.depth, parent=pos.parent_id or "", ledger=pos.ledger_id)
        await self.host.live.enter(ro.id, self.options.rollout_key_ttl, info, node=self.node.live_node)
        stack.push_async_callback(self.host.live.leave, ro.id)  # also when the rest is cut short

    def _make_repl(self) -> ReplSession:
        toolbox = self.toolbox
        repl_tools = [{"name": t.name, "doc": t.doc} for t in toolbox.tools.values()] if toolbox else []
        assert self.token is not None
        self._repl = self.host.make_repl(self.ro.row, self.token, self.options, self.host.interception, repl_tools)
        return self._repl

    def _stop_serving(self) -> None:
        """Unregister the token (its REPL can send nothing more) and close the tool service (its
        calls still running are recorded now, none after the result); idempotent."""
        if not self._served:
            return
        self._served = False
        if self.token is not None:
            self.host.interception.unregister(self.token)
        if self.tools is not None:
            self.tools.close()

    async def _close_repl(self, repl: ReplSession) -> None:
        self._stop_serving()  # before the REPL goes: nothing it sends while closing is served
        try:
            if self.options.retain_filesystem_after_rollout:
                path = await repl.retain_files()
                self.ro.trajectory.append({"type": "files", "path": path})
        finally:
            await repl.close()

    def _compose_messages(self) -> None:
        """The system prompt (the scaffold and the author's ``system_prompt``) and the question."""
        o, ro, toolbox = self.options, self.ro, self.toolbox
        scaffold = root_system_prompt(
            repl_context(ro.row),
            verbosity=o.root_prompt_verbosity,
            budget=ro.budget,
            max_turns=o.max_turns,
            sub_llm_max_turns=o.sub_llm_max_turns,
            max_output_length=o.max_output_length,
            parallelism=o.max_sub_llm_parallelism,
            tools=[t.summary() for t in toolbox.tools.values()] if toolbox else [],
            depth=self.pos.depth,
            max_depth=self.pos.max_depth,
            root_budget=o.root_max_completion_tokens,
            root_turn_tokens=root_turn_max_tokens(o),
            files=files_text(file_name(ro.row)),
            language=o.repl_language,
            message_history=o.expose_message_history,
            sub_tools=sub_tool_lines(o.sub_tools),
            sub_llms=o.enable_sub_llms,
        )
        system = compose_system_prompt(scaffold, o.system_prompt, o.system_prompt_mode)
        ro.messages += [{"role": "system", "content": system}, {"role": "user", "content": ro.row.question}]

    async def _run_root(self, repl: ReplSession) -> tuple[StopReason, str | None, str | None]:
        """Start the REPL and run the root loop under the rollout's own wall-clock deadline."""
        timeout = self.options.rollout_timeout
        deadline = asyncio.timeout(timeout)
        self.ends_at = time.monotonic() + timeout
        try:
            async with deadline:
                await repl.start()
                stop, final = await root_loop(self.node.wrap_root(self.host.root), self.ro, repl)
                return stop, final, None
        except TimeoutError as exc:
            if deadline.expired():
                return "error", None, f"RolloutTimeout: the rollout ran past its deadline of {timeout:g} s"
            return "error", None, f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a rollout never takes the evaluation down with it (RlmqError too)
            return "error", None, f"{type(exc).__name__}: {exc}"

    async def result(
        self, stop: StopReason, final: str | None, error: str | None, rollout_index: int | None
    ) -> RolloutResult:
        """The result row (metrics per depth and tree-wide; the top reports its tree's ledger)."""
        ro, pos = self.ro, self.pos
        metrics = ro.stats.metrics()
        metrics.update(tree_metrics(ro.trajectory, metrics, depth=pos.depth, max_depth=pos.max_depth))
        metrics.update(turn_counts(ro.trajectory))  # trainable turns of its tree, and why others are not
        if ro.ledger is not None and self.node.top:  # a child's ledger is its tree's: the top reports it
            metrics.update(await ro.ledger.metrics())
        row = ro.row
        correct = None if row.answer is None else normalize_answer(final) == normalize_answer(row.answer)
        result_row = ResultRow(
            id=row.id, final_answer=final, answer=row.answer, correct=correct, stop_reason=stop,
            metrics=metrics, error=error, rollout=rollout_index, sub_llm_error=first_sub_call_error(ro.trajectory),
        )  # fmt: skip
        return RolloutResult(row=result_row, trajectory=ro.trajectory, messages=ro.messages)

    # ------------------------------------------------------------------ the REPL's requests

    def _serving(self) -> AbstractAsyncContextManager[None]:
        """The REPL's own account of a request it serves (it pauses its cell timeout; never the
        child's word)."""
        if self._repl is None:  # the token is only known to the REPL it was made for
            raise RuntimeError("a request came before the rollout's REPL was made")
        return self._repl.serving()

    async def handle_batch(self, prompts: list[str]) -> tuple[list[str], str]:
        """``llm_batch(prompts)``: one batch of a rollout at a time, its parallelism is per rollout.

        Raises:
            RuntimeError: the rollout has no sub-LLMs (``enable_sub_llms=False``).
        """
        self._check_sub_llms()
        async with self._serving(), self.batch_sem:
            t0 = time.perf_counter()
            try:
                return await self.host.batches.run(self.ro, prompts)
            finally:
                self.ro.stats.llm_batch_seconds.append(time.perf_counter() - t0)

    async def handle_rlm(self, tasks: list[RlmTask]) -> tuple[list[str], str]:
        """``rlm_batch(tasks)``: served like ``llm_batch``, one of a rollout at a time.

        Raises:
            RuntimeError: the rollout has no sub-LLMs (``enable_sub_llms=False``).
        """
        self._check_sub_llms()
        async with self._serving(), self.rlm_sem:
            return await self.rlm.run(self.ro, tasks, self.pos, self.ends_at - time.monotonic())

    def _check_sub_llms(self) -> None:
        if not self.options.enable_sub_llms:  # the REPL has no llm_batch: a call that finds the endpoint anyway
            raise RuntimeError("this rollout has no sub-LLMs (enable_sub_llms is off)")

    async def handle_tool(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[bool, str]:
        """A root tool's call: served like a batch (the tool has its own timeout). One call of a
        rollout at a time, waiting at most one tool timeout for the one before."""
        assert self.tools is not None
        async with self._serving():
            try:
                async with asyncio.timeout(self.options.root_tool_timeout):
                    await self.tool_sem.acquire()
            except TimeoutError:
                return False, f"{name}: another tool call of this rollout is still running; try again"
            try:
                return await self.tools.run(self.ro, name, args, kwargs)
            finally:
                self.tool_sem.release()
