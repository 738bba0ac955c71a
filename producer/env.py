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
import enum
import inspect
import logging
import time
import uuid
from collections.abc import Iterable
from typing import Any, Final

from redis.asyncio import Redis
from redis.exceptions import RedisError

from rlmq.common import keys as K
from rlmq.common.aio import cancel_and_wait
from rlmq.common.connection import async_client
from rlmq.common.errors import ConfigError, RlmqError
from rlmq.common.ledger import BudgetLedger, default_cap
from rlmq.common.metrics import Metrics
from rlmq.common.schemas import DatasetRow, ResultRow, StopReason
from rlmq.common.settings import Settings, Verbosity, load_settings
from rlmq.producer.dispatch import Dispatcher
from rlmq.producer.interception import InterceptionServer
from rlmq.producer.llm_batch import LlmBatchService
from rlmq.producer.repl import Repl
from rlmq.producer.rollout import Rollout, RolloutResult, normalize_answer, root_loop
from rlmq.producer.root import RootModel
from rlmq.producer.scaffold import root_system_prompt

__all__ = ["FROM_SETTINGS", "RLMEnv", "RolloutResult", "normalize_answer"]


log = logging.getLogger("rlmq.env")


class _FromSettings(enum.Enum):
    """The default of every :class:`RLMEnv` setting argument: take the value from ``settings``."""

    FROM_SETTINGS = "from settings"


FROM_SETTINGS: Final = _FromSettings.FROM_SETTINGS


class RLMEnv:
    """An RLM environment whose sub-LLM calls run on the rlmq worker fleet.

    Every setting argument is a field of :class:`~rlmq.common.settings.Settings` of the same
    name: left out, it comes from ``settings``; given, it overrides ``settings`` for this
    environment. The result is validated once, as a whole, and kept as ``env.settings``,
    which is all the rollout reads. The defaults (those of ``Settings``) are the verifiers
    ``RLMEnv``'s where it has the argument.

    Args (keyword only; an unknown one raises :class:`~rlmq.common.errors.ConfigError`):
        max_turns: root-model turns per rollout (default 50, as in verifiers).
        sub_llm_max_turns: turns of one sub-LLM's own tool loop (default 5).
        sub_llm_max_completion_tokens: the rollout's sub-LLM budget in completion tokens,
            a hard limit across all workers (default ``None``: no budget).
        sub_llm_per_call_max_tokens: cap on one sub-LLM model call's completion tokens.
        root_max_completion_tokens: the root model's own completion tokens per rollout;
            each root call gets ``max_tokens`` = what is left (``None``: no limit).
        max_sub_llm_parallelism: sub-calls of one rollout queued or running at once (default 64).
        sub_model: the sub-LLM model (default: the root model).
        sub_tools: dotted import paths of tools the sub-LLMs may call (the workers must
            allow-list them).
        max_output_length: characters of a cell's output shown to the root model (default 8192).
        code_execution_timeout: seconds a cell may run before the REPL is restarted (default 120).
        max_startup_wait_seconds: seconds the REPL may take to start (package installs included).
        pip_install_packages: packages installed into each rollout's REPL.
        root_prompt_verbosity / sub_prompt_verbosity: light | medium | heavy (default light).
        include_sub_llm_in_trajectory: keep every sub-LLM's conversation in the trajectory.
        settings: the base settings (Redis URL, queue, sub-call deadline, limits); default
            :func:`~rlmq.common.settings.load_settings` (the ``RLMQ_*`` and ``REDIS_URL`` variables).
        root: the root model client (a seam for tests); built from ``settings`` if ``None``.
        metrics: :class:`~rlmq.common.metrics.Metrics` to update with batches and refused calls.

    Raises:
        ConfigError: an unknown argument, or a value ``Settings`` refuses.

    Use as ``async with RLMEnv(...) as env: result = await env.rollout(row, model=...)``.
    """

    def __init__(
        self,
        *,
        max_turns: int | _FromSettings = FROM_SETTINGS,
        sub_llm_max_turns: int | _FromSettings = FROM_SETTINGS,
        sub_llm_max_completion_tokens: int | None | _FromSettings = FROM_SETTINGS,
        sub_llm_per_call_max_tokens: int | None | _FromSettings = FROM_SETTINGS,
        root_max_completion_tokens: int | None | _FromSettings = FROM_SETTINGS,
        max_sub_llm_parallelism: int | _FromSettings = FROM_SETTINGS,
        sub_model: str | None | _FromSettings = FROM_SETTINGS,
        sub_tools: list[str] | _FromSettings = FROM_SETTINGS,
        max_output_length: int | _FromSettings = FROM_SETTINGS,
        code_execution_timeout: float | _FromSettings = FROM_SETTINGS,
        max_startup_wait_seconds: float | _FromSettings = FROM_SETTINGS,
        pip_install_packages: list[str] | _FromSettings = FROM_SETTINGS,
        root_prompt_verbosity: Verbosity | _FromSettings = FROM_SETTINGS,
        sub_prompt_verbosity: Verbosity | _FromSettings = FROM_SETTINGS,
        include_sub_llm_in_trajectory: bool | _FromSettings = FROM_SETTINGS,
        settings: Settings | None = None,
        root: RootModel | None = None,
        metrics: Metrics | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            known = ", ".join((*_OVERRIDABLE, "settings", "root", "metrics"))
            raise ConfigError(f"unknown RLMEnv argument(s): {', '.join(sorted(unknown))}; known: {known}")
        given = locals()
        overrides = {name: given[name] for name in _OVERRIDABLE if given[name] is not FROM_SETTINGS}
        if settings is not None and not isinstance(settings, Settings):
            raise ConfigError(f"settings must be a rlmq Settings, not {type(settings).__name__}")
        self.settings: Settings = (settings or load_settings()).with_overrides(**overrides)
        self._root = root
        self.metrics = metrics
        self._redis: Redis | None = None
        self._server: InterceptionServer | None = None
        self._batches: LlmBatchService | None = None
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
        self._batches = LlmBatchService(self.ledger, self.dispatcher, self.metrics)
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
        if self._redis is None or self._server is None or self._root is None or self._batches is None:
            raise RuntimeError("RLMEnv.start() first (or use `async with`)")
        s = self.settings
        sub_model = s.sub_model or model
        ro = Rollout(
            id=rollout_id or uuid.uuid4().hex,
            row=row,
            model=model,
            sub_model=sub_model,
            queue=s.producer_queue(sub_model),
            settings=s,
        )
        rid, budget, keys = ro.id, ro.budget, K.RolloutKeys(ro.id)
        self._live.add(rid)
        await self._redis.hset(
            keys.info,
            mapping={"model": model, "sub_model": sub_model, "queue": ro.queue, "started": time.time(), "row": row.id},
        )
        await self._redis.expire(keys.info, s.rollout_key_ttl)
        await self._redis.zadd(K.LIVE_ROLLOUTS, {rid: time.time() + s.rollout_key_ttl})
        if budget is not None:
            cap = s.sub_llm_per_call_max_tokens or default_cap(budget, s.sub_llm_budget_grant_tokens)
            await self.ledger.open(rid, budget, cap)
        sem = asyncio.Semaphore(1)
        batches = self._batches

        async def handle_batch(prompts: list[str]) -> tuple[list[str], str]:
            # The REPL's own account of what it serves pauses its cell timeout (never the child's word);
            # one batch of a rollout at a time, its parallelism is per rollout.
            async with repl.serving(), sem:
                return await batches.run(ro, prompts)

        token = self._server.register(handle_batch)
        ro.messages += [
            {
                "role": "system",
                "content": root_system_prompt(
                    row.context,
                    verbosity=s.root_prompt_verbosity,
                    budget=budget,
                    max_turns=s.max_turns,
                    sub_llm_max_turns=s.sub_llm_max_turns,
                    max_output_length=s.max_output_length,
                    parallelism=s.max_sub_llm_parallelism,
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
            max_output_length=s.max_output_length,
            code_execution_timeout=s.code_execution_timeout,
            max_startup_wait_seconds=s.max_startup_wait_seconds,
            pip_install_packages=s.pip_install_packages,
            max_batch_bytes=s.max_batch_bytes,
            max_batch_prompts=s.max_batch_prompts,
        )
        deadline = asyncio.timeout(s.rollout_timeout)  # a wall-clock deadline of its own
        try:
            async with deadline:
                await repl.start()
                stop, final = await root_loop(self._root, ro, repl)
        except TimeoutError as exc:
            stop, error = "error", f"{type(exc).__name__}: {exc}"
            if deadline.expired():
                error = f"RolloutTimeout: the rollout ran past its deadline of {s.rollout_timeout:g} s"
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
        metrics = ro.stats.metrics()
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
        return RolloutResult(row=result_row, trajectory=ro.trajectory, messages=ro.messages)

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
                try:
                    res = await self.rollout(row, model=model)
                except Exception as exc:  # one rollout's failure (even past rollout's own guard) never ends the others
                    log.exception("rollout of row %s failed", row.id)
                    res = RolloutResult(
                        row=ResultRow(
                            id=row.id,
                            final_answer=None,
                            answer=row.answer,
                            correct=None,
                            stop_reason="error",
                            metrics={},
                            error=f"{type(exc).__name__}: {exc}",
                        )
                    )
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


_OVERRIDABLE: Final = tuple(
    name for name, p in inspect.signature(RLMEnv.__init__).parameters.items() if p.default is FROM_SETTINGS
)
"""The setting arguments of :class:`RLMEnv` (each a :class:`~rlmq.common.settings.Settings` field)."""
