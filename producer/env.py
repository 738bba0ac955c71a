"""``RLMEnv``: Recursive Language Model rollouts whose sub-LLM calls go through Redis.

The constructor follows the verifiers ``RLMEnv`` as simplified in March 2026
(``max_turns=50``, ``sub_llm_max_turns``, ``max_sub_llm_parallelism``,
``sub_llm_max_completion_tokens``, one interception server per environment on 127.0.0.1
with an OS-assigned port). What differs: sub-LLM calls leave the trainer process as RQ
jobs served by ``rlmq worker`` processes, and the sub-LLM budget is a hard guarantee
enforced in Redis (:mod:`rlmq.common.ledger`), not a counter that parallel calls overshoot.

One rollout: the root model gets the scaffold and the row's question, and calls
``call_python_repl(code)``; each call runs in the rollout's persistent REPL
(:mod:`rlmq.producer.repl`), where ``llm_batch`` posts to the interception server
(:mod:`rlmq.producer.interception`), which dispatches the batch (:mod:`rlmq.producer.dispatch`).
The rollout stops on ``answer["ready"]``, after ``max_turns`` root turns, on a root reply
without a tool call, or on an error; the stop reason is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from rlmq.common import keys as K
from rlmq.common.aio import cancel_and_wait
from rlmq.common.connection import async_client
from rlmq.common.errors import ConfigError, RlmqError
from rlmq.common.ledger import BudgetLedger
from rlmq.common.metrics import Metrics
from rlmq.common.schemas import DatasetRow, ResultRow, StopReason, SubLLMResult
from rlmq.common.settings import Settings, Verbosity
from rlmq.producer.dispatch import BatchSpec, Dispatcher
from rlmq.producer.interception import InterceptionServer
from rlmq.producer.repl import Repl
from rlmq.producer.root import RootModel
from rlmq.producer.scaffold import REPL_TOOL, root_system_prompt, sub_system_prompt


def normalize_answer(text: str | None) -> str:
    """Case-folded, whitespace-collapsed, outer punctuation stripped (for ``correct``)."""
    if text is None:
        return ""
    t = " ".join(str(text).split()).casefold()
    return t.strip(" .,:;!?'\"`")


@dataclass
class RolloutResult:
    """A finished rollout: its result row and its trajectory.

    ``trajectory`` is a list of events: ``{"type": "root", ...}`` per root turn,
    ``{"type": "cell", "code", "output", "seconds", ...}`` per REPL cell and
    ``{"type": "llm_batch", "prompts", "results": [...]}`` per batch.
    """

    row: ResultRow
    trajectory: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Stats:
    batches: list[int] = field(default_factory=list)
    sub: list[SubLLMResult] = field(default_factory=list)
    root_turns: int = 0
    root_prompt_tokens: int = 0
    root_completion_tokens: int = 0
    repl_times: list[float] = field(default_factory=list)


class RLMEnv:
    """An RLM environment whose sub-LLM calls run on the rlmq worker fleet.

    Args (keyword only; an unknown one raises :class:`~common.errors.ConfigError`):
        max_turns: root-model turns per rollout (default 50, as in verifiers).
        sub_llm_max_turns: turns of one sub-LLM's own tool loop (default 5).
        sub_llm_max_completion_tokens: the rollout's sub-LLM budget in completion tokens,
            a hard limit across all workers (``None``: no budget).
        sub_llm_per_call_max_tokens: cap on one sub-LLM model call's completion tokens.
        root_max_completion_tokens: the root model's own completion tokens per rollout;
            each root call gets ``max_tokens`` = what is left (``None``: no limit).
        max_sub_llm_parallelism: sub-calls of one rollout queued or running at once.
        sub_model: the sub-LLM model (default: the root model).
        sub_tools: dotted import paths of tools the sub-LLMs may call (the workers must
            allow-list them).
        max_output_length: characters of a cell's output shown to the root model.
        code_execution_timeout: seconds a cell may run before the REPL is restarted.
        max_startup_wait_seconds: seconds the REPL may take to start (package installs included).
        pip_install_packages: packages installed into each rollout's REPL.
        root_prompt_verbosity / sub_prompt_verbosity: light | medium | heavy.
        include_sub_llm_in_trajectory: keep every sub-LLM's conversation in the trajectory.
        settings: the rest (Redis URL, queue, sub-call deadline, limits); see
            :class:`~common.settings.Settings`.
        root: the root model client (a seam for tests); built from ``settings`` if ``None``.
        metrics: :class:`~common.metrics.Metrics` to update with batches and refused calls.

    Use as ``async with RLMEnv(...) as env: result = await env.rollout(row, model=...)``.
    """

    _ARGS = (
        "max_turns", "sub_llm_max_turns", "sub_llm_max_completion_tokens", "sub_llm_per_call_max_tokens",
        "root_max_completion_tokens", "max_sub_llm_parallelism", "sub_model", "sub_tools",
        "max_output_length", "code_execution_timeout", "max_startup_wait_seconds", "pip_install_packages",
        "root_prompt_verbosity", "sub_prompt_verbosity", "include_sub_llm_in_trajectory", "settings", "root",
        "metrics",
    )  # fmt: skip

    def __init__(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(self._ARGS))
        if unknown:
            raise ConfigError(f"unknown RLMEnv argument(s): {', '.join(unknown)}; known: {', '.join(self._ARGS)}")
        settings: Settings = kwargs.get("settings") or Settings()
        self.settings = settings
        self.max_turns: int = kwargs.get("max_turns", 50)
        self.sub_llm_max_turns: int = kwargs.get("sub_llm_max_turns", 5)
        self.sub_llm_max_completion_tokens: int | None = kwargs.get(
            "sub_llm_max_completion_tokens", settings.sub_llm_max_completion_tokens
        )
        self.sub_llm_per_call_max_tokens: int | None = kwargs.get(
            "sub_llm_per_call_max_tokens", settings.sub_llm_per_call_max_tokens
        )
        self.root_max_completion_tokens: int | None = kwargs.get(
            "root_max_completion_tokens", settings.root_max_completion_tokens
        )
        self.max_sub_llm_parallelism: int = kwargs.get("max_sub_llm_parallelism", settings.max_sub_llm_parallelism)
        self.sub_model: str | None = kwargs.get("sub_model", settings.sub_model)
        self.sub_tools: list[str] = list(kwargs.get("sub_tools") or [])
        self.max_output_length: int = kwargs.get("max_output_length", 8192)
        self.code_execution_timeout: float = kwargs.get("code_execution_timeout", 120)
        self.max_startup_wait_seconds: float = kwargs.get("max_startup_wait_seconds", 120)
        self.pip_install_packages: list[str] = list(kwargs.get("pip_install_packages") or [])
        self.root_prompt_verbosity: Verbosity = kwargs.get("root_prompt_verbosity", "light")
        self.sub_prompt_verbosity: Verbosity = kwargs.get("sub_prompt_verbosity", "light")
        self.include_sub_llm_in_trajectory: bool = kwargs.get("include_sub_llm_in_trajectory", False)
        for name in ("max_turns", "sub_llm_max_turns", "max_sub_llm_parallelism", "max_output_length"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1")
        for name in ("root_prompt_verbosity", "sub_prompt_verbosity"):
            if getattr(self, name) not in ("light", "medium", "heavy"):
                raise ConfigError(f"{name} must be light, medium or heavy")
        if self.sub_llm_max_completion_tokens is not None and self.sub_llm_max_completion_tokens < 0:
            raise ConfigError("sub_llm_max_completion_tokens must be >= 0")
        self._root: RootModel | None = kwargs.get("root")
        self.metrics: Metrics | None = kwargs.get("metrics")
        self._redis: Redis | None = None
        self._server: InterceptionServer | None = None
        self._live: set[str] = set()
        self._refresher: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> RLMEnv:
        """Connect to Redis and start the interception server.

        Raises:
            ConfigError: no Redis URL (or no root model URL when no ``root`` was given).
        """
        s = self.settings
        if not s.redis_url:
            raise ConfigError("RLMEnv needs settings.redis_url (or REDIS_URL)")
        if self._root is None:
            if not s.base_url:
                raise ConfigError("RLMEnv needs settings.base_url for the root model")
            self._root = RootModel(s.base_url, s.api_key.get_secret_value(), retries=s.model_retries)
        self._redis = async_client(s.redis_url)
        await self._redis.ping()
        self.ledger = BudgetLedger(self._redis, ttl=s.rollout_key_ttl)
        self.dispatcher = Dispatcher(self._redis)
        self._server = InterceptionServer(max_batch_prompts=s.max_batch_prompts, max_batch_bytes=s.max_batch_bytes)
        await self._server.start()
        self._refresher = asyncio.create_task(self._refresh_keys())
        return self

    async def close(self) -> None:
        """Stop the interception server and close connections; idempotent."""
        if self._refresher:
            await cancel_and_wait([self._refresher])
            self._refresher = None
        if self._server:
            await self._server.stop()
            self._server = None
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
        if self._root is not None:
            with contextlib.suppress(Exception):
                await self._root.close()

    async def __aenter__(self) -> RLMEnv:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _refresh_keys(self) -> None:
        """Keep live rollouts' keys from expiring (TTL refreshed every third of it)."""
        ttl = self.settings.rollout_key_ttl
        while True:
            await asyncio.sleep(ttl / 3)  # periodic timer
            if not self._live or self._redis is None:
                continue
            with contextlib.suppress(Exception):
                async with self._redis.pipeline(transaction=False) as pipe:
                    for rid in self._live:
                        for key in K.RolloutKeys(rid).all_static():
                            pipe.expire(key, ttl)
                        pipe.zadd(K.LIVE_ROLLOUTS, {rid: time.time() + ttl})
                    await pipe.execute()

    # ------------------------------------------------------------------ one rollout

    async def rollout(self, row: DatasetRow, *, model: str, rollout_id: str | None = None) -> RolloutResult:
        """Run one rollout of ``row`` with root model ``model``.

        Never raises for a failure inside the rollout: it ends with ``stop_reason="error"``
        and the message in ``row.error``.

        Raises:
            RuntimeError: the environment was not started.
        """
        if self._redis is None or self._server is None or self._root is None:
            raise RuntimeError("RLMEnv.start() first (or use `async with`)")
        rid = rollout_id or uuid.uuid4().hex
        sub_model = self.sub_model or model
        queue = self.settings.producer_queue(sub_model)
        stats = _Stats()
        trajectory: list[dict[str, Any]] = []
        budget = self.sub_llm_max_completion_tokens
        keys = K.RolloutKeys(rid)
        self._live.add(rid)
        await self._redis.hset(
            keys.info,
            mapping={"model": model, "sub_model": sub_model, "queue": queue, "started": time.time(), "row": row.id},
        )
        await self._redis.expire(keys.info, self.settings.rollout_key_ttl)
        await self._redis.zadd(K.LIVE_ROLLOUTS, {rid: time.time() + self.settings.rollout_key_ttl})
        if budget is not None:
            await self.ledger.open(rid, budget)
        batch_counter = 0
        sem = asyncio.Semaphore(1)

        async def handle_batch(prompts: list[str]) -> tuple[list[str], str]:
            nonlocal batch_counter
            async with sem:  # one batch of a rollout at a time; its parallelism is per rollout
                batch_counter += 1
                return await self._run_batch(rid, f"b{batch_counter}", prompts, sub_model, queue, stats, trajectory)

        token = self._server.register(handle_batch)
        messages: list[dict[str, Any]] = [
            {
                "role": "system",
                "content": root_system_prompt(
                    row.context,
                    verbosity=self.root_prompt_verbosity,
                    budget=budget,
                    max_turns=self.max_turns,
                    sub_llm_max_turns=self.sub_llm_max_turns,
                    max_output_length=self.max_output_length,
                    parallelism=self.max_sub_llm_parallelism,
                ),
            },
            {"role": "user", "content": row.question},
        ]
        stop: StopReason = "max_turns"
        final: str | None = None
        error: str | None = None
        repl = Repl(
            context=row.context,
            endpoint_url=self._server.url,
            unix_socket=self._server.unix_path,
            token=token,
            max_output_length=self.max_output_length,
            code_execution_timeout=self.code_execution_timeout,
            max_startup_wait_seconds=self.max_startup_wait_seconds,
            pip_install_packages=self.pip_install_packages,
        )
        try:
            await repl.start()
            stop, final = await self._root_loop(model, messages, repl, stats, trajectory)
        except RlmqError as exc:
            stop, error = "error", f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a rollout never takes the evaluation down with it
            stop, error = "error", f"{type(exc).__name__}: {exc}"
        finally:
            self._server.unregister(token)
            await repl.close()
            self._live.discard(rid)
            # Also when cancelled (a stop signal): `rlmq status` must not list it as live.
            with contextlib.suppress(RedisError, OSError):
                await self._redis.zrem(K.LIVE_ROLLOUTS, rid)
        metrics = self._metrics(stats)
        if budget is not None:
            snap = await self.ledger.snapshot(rid)
            if snap is not None:
                metrics.update(
                    sub_llm_budget_limit=snap.limit,
                    sub_llm_budget_charged=snap.charged,
                    sub_llm_budget_used=snap.used,
                    sub_llm_grants=snap.grants,
                    sub_llm_budget_rejections=snap.rejections,
                    sub_llm_released_tokens=snap.released,
                )
        correct = None if row.answer is None else normalize_answer(final) == normalize_answer(row.answer)
        result_row = ResultRow(
            id=row.id,
            final_answer=final,
            answer=row.answer,
            correct=correct,
            stop_reason=stop,
            metrics=metrics,
            error=error,
        )
        return RolloutResult(row=result_row, trajectory=trajectory, messages=messages)

    async def _root_loop(
        self,
        model: str,
        messages: list[dict[str, Any]],
        repl: Repl,
        stats: _Stats,
        trajectory: list[dict[str, Any]],
    ) -> tuple[StopReason, str | None]:
        assert self._root is not None
        last_answer: str | None = None
        for _turn in range(self.max_turns):
            kwargs: dict[str, Any] = {"model": model, "messages": messages, "tools": [REPL_TOOL]}
            if self.root_max_completion_tokens is not None:
                left = self.root_max_completion_tokens - stats.root_completion_tokens
                if left <= 0:
                    trajectory.append({"type": "note", "text": "root completion-token limit reached"})
                    return "max_turns", last_answer
                kwargs["max_tokens"] = left
            t0 = time.perf_counter()
            resp = await self._root.chat(**kwargs)
            stats.root_turns += 1
            usage = getattr(resp, "usage", None)
            if usage is not None:
                stats.root_prompt_tokens += int(usage.prompt_tokens or 0)
                stats.root_completion_tokens += int(usage.completion_tokens or 0)
            msg = resp.choices[0].message
            tool_calls = list(msg.tool_calls or [])
            assistant: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
            if tool_calls:
                assistant["tool_calls"] = [
                    {
                        "id": tc.id,
                        "type": "function",
                        "function": {"name": tc.function.name, "arguments": tc.function.arguments},
                    }
                    for tc in tool_calls
                ]
            messages.append(assistant)
            trajectory.append(
                {
                    "type": "root",
                    "content": msg.content or "",
                    "tool_calls": assistant.get("tool_calls", []),
                    "seconds": round(time.perf_counter() - t0, 4),
                    "usage": {
                        "prompt": getattr(usage, "prompt_tokens", 0),
                        "completion": getattr(usage, "completion_tokens", 0),
                    },
                }
            )
            if not tool_calls:
                return "no_tool_call", last_answer if last_answer else (msg.content or None)
            for tc in tool_calls:
                if tc.function.name != "call_python_repl":
                    out = f"[error] unknown tool {tc.function.name!r}; the only tool is call_python_repl(code)"
                    messages.append({"role": "tool", "tool_call_id": tc.id, "content": out})
                    continue
                try:
                    code = json.loads(tc.function.arguments or "{}")["code"]
                    if not isinstance(code, str):
                        raise TypeError
                except (ValueError, KeyError, TypeError):
                    out = '[error] call_python_repl takes one string argument: {"code": "..."}'
                    messages.append({"role": "tool", "tool_call_id": tc.id, "content": out})
                    continue
                cell = await repl.execute(code)
                stats.repl_times.append(cell.seconds)
                trajectory.append(
                    {
                        "type": "cell",
                        "code": code,
                        "output": cell.output,
                        "seconds": round(cell.seconds, 4),
                        "timed_out": cell.timed_out,
                        "restarted": cell.restarted,
                    }
                )
                messages.append({"role": "tool", "tool_call_id": tc.id, "content": cell.output})
                if cell.answer_content:
                    last_answer = cell.answer_content
                if cell.answer_ready:
                    return "answer_ready", cell.answer_content
        return "max_turns", last_answer

    # ------------------------------------------------------------------ batches

    async def _run_batch(
        self,
        rid: str,
        batch_id: str,
        prompts: list[str],
        sub_model: str,
        queue: str,
        stats: _Stats,
        trajectory: list[dict[str, Any]],
    ) -> tuple[list[str], str]:
        t0 = time.perf_counter()
        budget = self.sub_llm_max_completion_tokens
        stats.batches.append(len(prompts))
        spec = BatchSpec(
            rollout_id=rid,
            batch_id=batch_id,
            model=sub_model,
            queue=queue,
            timeout=self.settings.sub_call_timeout,
            parallelism=self.max_sub_llm_parallelism,
            max_turns=self.sub_llm_max_turns,
            system_prompt=sub_system_prompt(self.sub_prompt_verbosity),
            sub_tools=self.sub_tools,
            max_completion_tokens=self.sub_llm_per_call_max_tokens,
            budgeted=budget is not None,
            include_messages=self.include_sub_llm_in_trajectory,
            result_ttl=self.settings.result_ttl,
            reply_ttl=self.settings.rollout_key_ttl,
        )
        snap = await self.ledger.snapshot(rid) if budget is not None else None
        if budget is not None and (snap is None or snap.remaining <= 0):
            if snap is None:
                # The ledger is gone (Redis restarted without persistence, or its TTL ran out).
                # Opening a fresh one would forget what was already spent, so refuse instead.
                msg = (
                    "[rejected] sub-LLM token budget ledger lost (Redis restarted?); sub-LLM calls are "
                    "refused so the budget cannot be overshot"
                )
            else:
                msg = f"[rejected] sub-LLM token budget spent: {snap.charged}/{budget} completion tokens used"
            results = [
                SubLLMResult(rollout_id=rid, batch_id=batch_id, index=i, job_id="", status="rejected", content=msg)
                for i in range(len(prompts))
            ]
            if self.metrics:  # workers count what they run; calls refused here are counted here
                for r in results:
                    self.metrics.observe_result(r)
        else:
            try:
                results = await self.dispatcher.run_batch(spec, prompts)
            except (RedisError, OSError) as exc:  # Redis gone past the client's reconnect backoff
                results = [
                    SubLLMResult(
                        rollout_id=rid, batch_id=batch_id, index=i, job_id="", status="error", error_kind="redis",
                        content=f"[error] sub-LLM batch failed: Redis unavailable ({exc})", error=str(exc),
                    )
                    for i in range(len(prompts))
                ]  # fmt: skip
        stats.sub.extend(results)
        seconds = time.perf_counter() - t0
        if self.metrics:
            self.metrics.observe_batch(len(prompts), seconds)
        counts = {k: sum(1 for r in results if r.status == k) for k in ("ok", "rejected", "error")}
        lines = [
            f"llm_batch: {len(prompts)} prompt(s) in {seconds:.2f} s: "
            + ", ".join(f"{v} {k}" for k, v in counts.items())
        ]
        if budget is not None:
            # Right under the header, so a long batch's truncated output still shows it.
            snap = await self.ledger.snapshot(rid)
            lines.append(f"[{snap.charged if snap else 0}/{budget} sub-LLM completion tokens used]")
        for r in results:
            lines.append(
                f"  [{r.index}] {r.status:<8} {r.completion_tokens:>6} tokens  {r.turns} turn(s)  {r.seconds:6.2f} s"
                + (f"  {r.error_kind}" if r.status == "error" and r.error_kind else "")
            )
        summary = "\n".join(lines)
        trajectory.append(
            {
                "type": "llm_batch",
                "batch_id": batch_id,
                "seconds": round(seconds, 4),
                "prompts": prompts if len(prompts) <= 64 else prompts[:64],
                "results": [
                    r.model_dump(
                        exclude_none=True, exclude={"messages"} if not self.include_sub_llm_in_trajectory else None
                    )
                    for r in results
                ],
            }
        )
        return [r.content for r in results], summary

    def _metrics(self, stats: _Stats) -> dict[str, float | int]:
        sub = stats.sub
        waits = [r.queue_wait_seconds for r in sub if r.status != "rejected" and r.job_id]
        batches = stats.batches
        return {
            "sub_llm_call_count": len(sub),
            "sub_llm_total_turns": sum(r.turns for r in sub),
            "sub_llm_prompt_tokens": sum(r.prompt_tokens for r in sub),
            "sub_llm_completion_tokens": sum(r.completion_tokens for r in sub),
            "sub_llm_total_tool_calls": sum(r.tool_calls for r in sub),
            "sub_llm_batch_count": len(batches),
            "sub_llm_max_batch_size": max(batches, default=0),
            "sub_llm_mean_batch_size": round(sum(batches) / len(batches), 3) if batches else 0.0,
            "main_rlm_turns": stats.root_turns,
            "main_rlm_prompt_tokens": stats.root_prompt_tokens,
            "main_rlm_completion_tokens": stats.root_completion_tokens,
            "repl_call_count": len(stats.repl_times),
            "repl_total_time_seconds": round(sum(stats.repl_times), 4),
            "repl_mean_time_seconds": round(sum(stats.repl_times) / len(stats.repl_times), 4)
            if stats.repl_times
            else 0.0,
            "sub_llm_rejected_count": sum(1 for r in sub if r.status == "rejected"),
            "sub_llm_error_count": sum(1 for r in sub if r.status == "error"),
            "sub_llm_queue_wait_seconds_mean": round(sum(waits) / len(waits), 5) if waits else 0.0,
        }

    # ------------------------------------------------------------------ many rollouts

    async def evaluate(
        self,
        rows: Iterable[DatasetRow],
        *,
        model: str,
        concurrency: int = 4,
        on_done: Any = None,
    ) -> list[RolloutResult]:
        """Run a rollout per row, ``concurrency`` at a time; results in the rows' order.

        Args:
            on_done: optional callable ``(RolloutResult) -> None`` called as each finishes
                (progress bars, incremental writes).
        """
        rows = list(rows)
        sem = asyncio.Semaphore(max(1, concurrency))
        out: list[RolloutResult | None] = [None] * len(rows)

        async def one(i: int, row: DatasetRow) -> None:
            async with sem:
                res = await self.rollout(row, model=model)
            out[i] = res
            if on_done is not None:
                on_done(res)

        tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(rows)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            # gather ends at the first cancelled rollout; the others may still be closing their
            # REPLs. Wait for every one, so none outlives the environment (a REPL left running).
            await cancel_and_wait(tasks)
            raise
        return [r for r in out if r is not None]
