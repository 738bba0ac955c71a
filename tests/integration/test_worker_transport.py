"""A whole worker, in-process on a real Redis, whose model is an in-memory transport: no HTTP server.

The worker gets its model client through ``client_factory`` with a
:class:`~rlmq.workers.transport.Transport` that answers each prompt from its own text,
fails the first attempt of some prompts with 503 or a broken connection, delays others and
leaves ``usage`` out of one. The producer side is the real dispatcher, budget included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest
from redis.asyncio import Redis

from rlmq.common import keys as K
from rlmq.common.budget.ledger import BudgetLedger
from rlmq.common.metrics import Metrics
from rlmq.common.schemas import SubCallOptions
from rlmq.common.settings import load_settings
from rlmq.producer.dispatch import BatchSpec, Dispatcher
from rlmq.workers.model import ChatClient, HttpReply
from rlmq.workers.worker import SubLLMWorker

pytestmark = pytest.mark.integration
MODEL = "transport-test"
QUEUE = K.queue_name_for_model(MODEL)
_ITEM = re.compile(r"item (\d+)")


class PromptModel:
    """A transport answering ``"answer <n> x ..."`` to a prompt naming ``item <n>``, in ``n % 7 + 2``
    tokens cut to ``max_tokens``.

    Item 3's first attempt gets a 503, item 5's a broken connection; item 8 answers after
    0.2 s; item 9's answer has no ``usage``.
    """

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.attempts: dict[int, int] = {}

    async def post(self, url: str, data: bytes, *, headers: Mapping[str, str], timeout: float) -> HttpReply:
        body = json.loads(data)
        self.requests.append(body)
        match = _ITEM.search(body["messages"][-1]["content"])
        assert match, body
        n = int(match.group(1))
        attempt = self.attempts[n] = self.attempts.get(n, 0) + 1
        if n == 3 and attempt == 1:
            return HttpReply(503, {}, b'{"error": {"message": "busy"}}')
        if n == 5 and attempt == 1:
            raise ConnectionError("connection reset by peer")
        if n == 8:
            await asyncio.sleep(0.2)  # a slower model answer (a delay of the double, not a wait of the test)
        tokens = min(n % 7 + 2, body.get("max_tokens") or 10**6)
        content = " ".join(["answer", str(n), *(["x"] * (tokens - 2))][:tokens])
        out: dict[str, Any] = {
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]
        }
        if n != 9:
            out["usage"] = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}
        return HttpReply(200, {"Content-Type": "application/json"}, json.dumps(out).encode())

    async def close(self) -> None:
        """Nothing to close."""


@contextlib.asynccontextmanager
async def running(worker: SubLLMWorker) -> AsyncIterator[None]:
    task = asyncio.create_task(worker.run(grace=5))
    try:
        yield
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 30)


async def test_a_worker_serves_a_budgeted_batch_through_an_in_memory_model(aredis: Redis, redis_url: str) -> None:
    model = PromptModel()
    settings = load_settings(redis_url=redis_url, model=MODEL)  # no base_url: no model server at all
    factory = lambda: ChatClient("http://in-memory.test/v1", transport=model, backoff_base=0.001)  # noqa: E731
    worker = SubLLMWorker(settings, name="transport-w", metrics=Metrics(), client_factory=factory)
    await BudgetLedger(aredis).open("tr1", 1000)
    spec = BatchSpec(
        rollout_id="tr1", batch_id="b1", queue=QUEUE, sub_call_timeout=30, parallelism=12,
        call=SubCallOptions(model=MODEL, budgeted=True, max_completion_tokens=6),
    )  # fmt: skip
    async with running(worker):
        results = await asyncio.wait_for(Dispatcher(aredis).run_batch(spec, [f"item {i}" for i in range(12)]), 60)
    assert [r.status for r in results] == ["ok"] * 12, [r.content for r in results]
    assert [r.content.split()[:2] for r in results] == [["answer", str(i)] for i in range(12)]
    # The grant is the per-call cap; the model's answers were cut to it.
    assert all(req["max_tokens"] == 6 and req["user"] == "tr1" for req in model.requests)
    assert model.attempts[3] == model.attempts[5] == 2 and len(model.requests) == 14  # one retry each
    assert [r.completion_tokens for r in results if r.index != 9] == [min(i % 7 + 2, 6) for i in range(12) if i != 9]
    snap = await BudgetLedger(aredis).snapshot("tr1")
    # Within the budget; the call without usage is charged by the worker's own rule (at most its grant).
    counted = sum(r.completion_tokens for r in results if r.index != 9)
    assert snap is not None and counted <= snap.charged <= counted + 6 and snap.grants == 12
