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
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from redis.asyncio import Redis

from rlmq.common.errors import RlmqError
from rlmq.common.metrics import Metrics
from rlmq.common.schemas import DatasetRow, ResultRow, RlmTask, StopReason
from rlmq.common.settings import RolloutOptions, setting_default
from rlmq.common.tree import TreePosition
from rlmq.producer.dispatch import Dispatcher
from rlmq.producer.interception import BatchHandler, RlmBatchHandler, ToolHandler
from rlmq.producer.live import LiveRollouts
from rlmq.producer.llm_batch import LlmBatchService
from rlmq.producer.repl import Repl
from rlmq.producer.rlm_batch import RlmBatchService
from rlmq.producer.rollout import Rollout, RolloutResult, normalize_answer
from rlmq.producer.root import RootClient
from rlmq.producer.root_loop import CellRunner, root_loop
from rlmq.producer.root_tools import RootToolbox, RootToolService
from rlmq.producer.scaffold import compose_system_prompt, root_system_prompt
from rlmq.producer.tree_metrics import tree_metrics
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

    def serving(self) -> AbstractAsyncContextManager[None]:
        """Wraps the serving of one of its ``llm_batch`` requests (pauses its cell clock)."""
        ...


ReplFactory = Callable[[Any, str, RolloutOptions, "Interception", Sequence[dict[str, str]]], ReplSession]
"""Makes a rollout's REPL: ``(context, bearer token, options, interception endpoint, root tools
({"name", "doc"} each)) -> ReplSession``."""


def sandbox_repl(
    context: Any, token: str, options: RolloutOptions, interception: Interception, tools: Sequence[dict[str, str]]
) -> Repl:
    """The production REPL: a sandboxed subprocess (:class:`~rlmq.producer.repl.Repl`) holding
    ``context``, posting ``llm_batch`` and its root ``tools``' calls to ``interception`` with ``token``."""
    return Repl(
        context=context,
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
    make_repl: ReplFactory = sandbox_repl
    rlm: RlmBatchService | None = None

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
        tree: the rollout's place in its rollout tree (issue 22); ``None``: a top rollout (depth 1,
            ``max_depth`` = ``options.max_depth``). Its ``rlm_batch`` starts child rollouts while
            ``depth < max_depth``, else runs plain sub-LLM calls.
            Its depth and parent are announced with the rollout (``rlmq status``).
            A top opens the tree's ledger and its node and closes the ledger when it ends; a
            child (depth >= 2) charges ``tree.ledger_id``, opens and deletes its own node, its calls
            carry ``(*tree.nodes, rollout_id)`` and its root turns reserve from the tree's budget
            (:mod:`rlmq.producer.tree_node`).

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
    pos = tree = tree_position(rid, tree, options.max_depth)
    ro = Rollout(
        id=rid, row=row, model=model, sub_model=sub_model, queue=queue, options=options,
        ledger_id=pos.ledger_id, nodes=chain_of(rid, pos),
    )  # fmt: skip
    info: dict[str, str | int | float] = {
        "model": model, "sub_model": sub_model, "queue": queue, "started": time.time(), "row": row.id
    }  # fmt: skip
    if pos.depth > 1:
        info.update(depth=pos.depth, parent=pos.parent_id or "", ledger=pos.ledger_id)
    node = TreeNode(host.redis, ro, pos)
    await host.live.enter(rid, options.rollout_key_ttl, info, node=node.live_node)
    try:
        await node.open()
    except BaseException:
        try:
            await node.close()
        finally:
            await host.live.leave(rid)
        raise
    sem = asyncio.Semaphore(1)
    batches = host.batches
    rlm = host.rlm or RlmBatchService(batches)
    rlm_sem = asyncio.Semaphore(1)
    ends_at = time.monotonic() + options.rollout_timeout  # (re)set when the deadline starts

    async def handle_rlm(tasks: list[RlmTask]) -> tuple[list[str], str]:
        # Served like llm_batch: pauses the cell's clock; one rlm_batch of a rollout at a time.
        async with repl.serving(), rlm_sem:
            return await rlm.run(ro, tasks, tree, ends_at - time.monotonic())

    async def handle_batch(prompts: list[str]) -> tuple[list[str], str]:
        # The REPL's own account of what it serves pauses its cell timeout (never the child's word);
        # one batch of a rollout at a time, its parallelism is per rollout.
        async with repl.serving(), sem:
            return await batches.run(ro, prompts)

    toolbox = host.toolbox if host.toolbox is not None and host.toolbox.tools else None
    handle_tool: ToolHandler | None = None
    tools: RootToolService | None = None
    ro.stats.root_tool_calls = dict.fromkeys(toolbox.names if toolbox else [], 0)
    if toolbox is not None:
        tools = service = RootToolService(toolbox)
        tool_sem = asyncio.Semaphore(1)

        async def handle_tool(name: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[bool, str]:
            # Served like a batch: the parent's own account pauses the cell's timeout; the tool has its own.
            # One call of a rollout at a time, waiting at most one tool timeout for the one before.
            async with repl.serving():
                try:
                    async with asyncio.timeout(options.root_tool_timeout):
                        await tool_sem.acquire()
                except TimeoutError:
                    return False, f"{name}: another tool call of this rollout is still running; try again"
                try:
                    return await service.run(ro, name, args, kwargs)
                finally:
                    tool_sem.release()

    token = host.interception.register(handle_batch, handle_tool, handle_rlm)
    scaffold = root_system_prompt(
        row.context,
        verbosity=options.root_prompt_verbosity,
        budget=ro.budget,
        max_turns=options.max_turns,
        sub_llm_max_turns=options.sub_llm_max_turns,
        max_output_length=options.max_output_length,
        parallelism=options.max_sub_llm_parallelism,
        tools=[t.summary() for t in toolbox.tools.values()] if toolbox else [],
        depth=tree.depth,
        max_depth=tree.max_depth,
    )
    system = compose_system_prompt(scaffold, options.system_prompt, options.system_prompt_mode)
    ro.messages += [{"role": "system", "content": system}, {"role": "user", "content": row.question}]
    stop: StopReason = "max_turns"
    final: str | None = None
    error: str | None = None
    repl_tools = [{"name": t.name, "doc": t.doc} for t in toolbox.tools.values()] if toolbox else []
    try:
        repl = host.make_repl(row.context, token, options, host.interception, repl_tools)
    except BaseException:  # nothing of the rollout may stay registered or listed as live
        host.interception.unregister(token)
        try:
            await node.close()
        finally:
            await host.live.leave(rid)
        raise
    deadline = asyncio.timeout(options.rollout_timeout)  # a wall-clock deadline of its own
    ends_at = time.monotonic() + options.rollout_timeout
    try:
        async with deadline:
            await repl.start()
            stop, final = await root_loop(node.wrap_root(host.root), ro, repl)
    except TimeoutError as exc:
        stop, error = "error", f"{type(exc).__name__}: {exc}"
        if deadline.expired():
            error = f"RolloutTimeout: the rollout ran past its deadline of {options.rollout_timeout:g} s"
    except RlmqError as exc:
        stop, error = "error", f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # a rollout never takes the evaluation down with it
        stop, error = "error", f"{type(exc).__name__}: {exc}"
    finally:
        host.interception.unregister(token)
        if tools is not None:
            tools.close()  # its calls still running are recorded now, none after the result
        try:
            await repl.close()
        finally:  # also when the close is cut short: `rlmq status` must not list it as live
            try:
                await node.close()  # its tree (a top) or its subtree (a child) gets no more grants
            finally:
                await host.live.leave(rid)
    raise_if_cancelled(f"rollout {rid} of row {row.id}")
    metrics = ro.stats.metrics()
    # per depth and tree-wide (rlm_batch children)
    metrics.update(tree_metrics(ro.trajectory, metrics, depth=tree.depth, max_depth=tree.max_depth))
    if ro.ledger is not None and node.top:  # a child's ledger is its tree's: the top reports it
        metrics.update(await ro.ledger.metrics())
    correct = None if row.answer is None else normalize_answer(final) == normalize_answer(row.answer)
    result_row = ResultRow(
        id=row.id,
        final_answer=final,
        answer=row.answer,
        correct=correct,
        stop_reason=stop,
        metrics=metrics,
        error=error,
        rollout=rollout_index,
    )
    return RolloutResult(row=result_row, trajectory=ro.trajectory, messages=ro.messages)
