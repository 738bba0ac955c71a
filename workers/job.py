"""The RQ job functions, for stock RQ workers: a sub-LLM call (run), a child rollout (refused).

rlmq's producer enqueues every sub-LLM call as an ordinary RQ job whose function is
``rlmq.workers.job.run_sub_llm`` (by import path) with one JSON argument, a
:class:`~common.schemas.SubLLMRequest`. rlmq's own worker (:mod:`rlmq.workers.worker`) runs
these jobs hundreds at a time without calling this function. A stock
``rq worker --serializer rq.serializers.JSONSerializer`` can run them too, one at a
time, through this function (the benchmark's baseline); it reads its model server from
``RLMQ_BASE_URL`` / ``RLMQ_API_KEY`` and adds the result to the batch's reply stream.

Two functions are named ``run_sub_llm``: this one, the synchronous RQ job entry point, and
:func:`rlmq.workers.subllm.run_sub_llm`, the asynchronous sub-call it runs (imported here as
``_run``). This one's name is part of every job record (``rlmq.common.jobs.record.SUB_LLM_FUNC``),
so renaming it would make old and new workers of one fleet refuse each other's jobs.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from redis.asyncio import Redis
from rq import get_current_job

from rlmq.common import keys as K
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.errors import ConfigError
from rlmq.common.jobs.record import F_REPLY, F_REPLY_TTL
from rlmq.common.jobs.store import DEFAULT_REPLY_TTL
from rlmq.common.schemas import load_request
from rlmq.common.settings import load_settings
from rlmq.workers.model import ChatClient
from rlmq.workers.subllm import SubLLMContext
from rlmq.workers.subllm import run_sub_llm as _run
from rlmq.workers.tools import ToolRegistry


def run_sub_llm(payload: dict[str, Any]) -> dict[str, Any]:
    """Run one sub-LLM call under a stock RQ worker and deliver its result.

    Args:
        payload: a :class:`~common.schemas.SubLLMRequest` as a dict.

    Returns:
        A small summary (status, completion tokens, turns, seconds) stored as RQ's result.

    Raises:
        PayloadError: the payload is invalid.
        RuntimeError: not running inside an RQ job.
    """
    request = load_request(payload)
    job = get_current_job()
    if job is None:
        raise RuntimeError("run_sub_llm must run as an RQ job")
    reply_raw, reply_ttl_raw = job.connection.hmget(K.rq_job(job.id), [F_REPLY, F_REPLY_TTL])
    reply_key = reply_raw.decode() if isinstance(reply_raw, bytes) else str(reply_raw)
    reply_ttl = int(reply_ttl_raw) if reply_ttl_raw else DEFAULT_REPLY_TTL  # the producer's, never ours
    settings = load_settings()
    started = time.time()

    async def go() -> dict[str, Any]:
        kwargs = job.connection.connection_pool.connection_kwargs
        redis = Redis(**{k: v for k, v in kwargs.items() if k in ("host", "port", "db", "password", "username")})
        client = ChatClient(
            str(settings.base_url), settings.api_key.get_secret_value(), retries=settings.model_retries,
            token_api=settings.token_api(),
        )  # fmt: skip
        try:
            ctx = SubLLMContext(
                client=client,
                ledger=BudgetLedger(redis),
                tools=ToolRegistry.from_paths(
                    settings.allowed_sub_tools, max_output_chars=settings.sub_tool_max_result_chars
                ),
                worker_name=f"rq:{job.worker_name or ''}",
                frozen=settings.frozen_fleet,
                continuation=settings.sub_llm_continuation,
                redis=redis,
                turn_token_max_ids=settings.turn_token_max_ids,
            )
            result = await _run(request, ctx, job_id=job.id, started_at=started)
            async with redis.pipeline(transaction=False) as pipe:
                pipe.xadd(reply_key, {K.REPLY_FIELD: result.model_dump_json()})
                pipe.expire(reply_key, reply_ttl)
                await pipe.execute()
            return {"status": result.status, "completion_tokens": result.completion_tokens, "turns": result.turns}
        finally:
            await client.close()
            await redis.aclose()

    return asyncio.run(go())


def run_child_rollout(payload: dict[str, Any]) -> dict[str, Any]:
    """The function a child rollout's job names (``rlmq.common.jobs.record.CHILD_ROLLOUT_FUNC``), for a
    stock RQ worker that takes one: it refuses in one line.

    A child rollout needs a REPL host: ``rlmq worker --repl-slots N`` runs it through its child
    kind (:mod:`rlmq.workers.child_kind`, by this name in its kind registry) without calling this
    function; a stock RQ worker has no REPL host, so the job fails with this message instead of
    an import error.

    Args:
        payload: a :class:`~rlmq.common.schemas.ChildRolloutRequest` as a dict (not read).

    Raises:
        ConfigError: always.
    """
    raise ConfigError(
        "a child rollout (rlm_batch) runs only on an rlmq worker hosting child rollouts "
        "(rlmq worker --repl-slots N), not on a stock RQ worker"
    )
