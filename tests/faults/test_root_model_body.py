"""A root model server that answers HTTP 200 with an HTML page (a proxy's error page, a login
wall) ends the rollout with a clear "not a chat completion" error, as the sub-LLM path does,
after its retries; never an ``AttributeError``."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv

HTML = "<html><body><h1>Bad gateway</h1>Please try again later.</body></html>"


async def test_a_root_model_answering_html_ends_the_rollout_with_a_clear_error(redis_url: str, real_redis: Any) -> None:
    calls = 0

    async def completions(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        return web.Response(text=HTML, content_type="text/html")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        settings = load_settings(
            redis_url=redis_url, base_url=f"http://127.0.0.1:{port}/v1", model="root", model_retries=1
        )
        async with RLMEnv(settings=settings) as env:
            res = await env.rollout(DatasetRow(id="html", question="Q?", context="x"), model="root")
    finally:
        await runner.cleanup()
    assert res.row.stop_reason == "error"
    assert "not a chat completion" in str(res.row.error) and "Bad gateway" in str(res.row.error), res.row.error
    assert "AttributeError" not in str(res.row.error)
    assert calls == 2  # retried once, like a 5xx
