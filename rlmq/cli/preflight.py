"""Checks ``rlmq run`` makes before any rollout starts, so a missing piece costs one line, not a run.

* each model server it will call answers ``GET {base_url}/models`` within a short deadline:
  the root model's ``--base-url``, and the sub-model's server when ``rlmq run`` starts the
  workers itself (``--sub-base-url``, default ``--base-url``);
* on an external Redis (no local workers), a live worker serves the sub-LLM queue
  (``rlmq:serving:<queue>``, refreshed by every worker's heartbeat), and, when the rollouts
  recurse (``max_depth`` > 1), a live REPL host (``rlmq worker --repl-slots N``) serves the
  child queue of depth 2 (:func:`~rlmq.common.keys.child_queue`).

A failed check raises :class:`~rlmq.common.errors.PreflightError`: ``rlmq run`` prints its one
line and exits 5 (:data:`~rlmq.cli.exits.EXIT_UNAVAILABLE`). Any HTTP answer other than 401/403
and 5xx counts as a server that answers (a server without ``/models`` still serves chats).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import aiohttp

from rlmq.common import keys as K
from rlmq.common.connection import mask_url
from rlmq.common.errors import PreflightError

if TYPE_CHECKING:
    from rlmq.common.settings import Settings

POLL_SECONDS = 0.25
"""How often the worker check looks again while it waits for a worker to register."""


async def probe_model_server(base_url: str, api_key: str | None, timeout: float) -> str | None:
    """``GET {base_url}/models`` once; ``None`` when the server answers, else why not (one phrase).

    Args:
        base_url: an OpenAI-compatible base URL (``http://host:port/v1``).
        api_key: sent as a bearer token when set (and not ``EMPTY``).
        timeout: seconds the whole request may take.
    """
    url = base_url.rstrip("/") + "/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key and api_key != "EMPTY" else {}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.get(url, headers=headers) as resp,
        ):
            status = resp.status
    except TimeoutError:
        return f"no answer to GET /models within {timeout:g} s"
    except aiohttp.ClientError as exc:
        return f"GET /models failed: {exc}"
    if status in (401, 403):
        return f"it refuses the API key (GET /models answered {status}; give --api-key or RLMQ_API_KEY)"
    if status >= 500:
        return f"GET /models answered {status}"
    return None


async def check_model_servers(servers: dict[str, str], api_key: str | None, timeout: float) -> None:
    """Probe every server of ``servers`` (label -> base URL) at once.

    Raises:
        PreflightError: one of them did not answer; the message names it and says why.
    """
    urls = dict.fromkeys(servers.values())  # one probe per distinct URL
    reasons = await asyncio.gather(*(probe_model_server(url, api_key, timeout) for url in urls))
    why = dict(zip(urls, reasons, strict=True))
    for label, url in servers.items():
        if why[url] is not None:
            raise PreflightError(f"the {label} at {mask_url(url)} does not answer: {why[url]}; nothing was run")


def wait_for_worker(redis_url: str, queue: str, start: str, timeout: float, what: str = "sub-LLM queue") -> int:
    """Wait up to ``timeout`` seconds for a live worker on ``queue``; returns how many there are.

    ``start`` is the command that starts one, ``what`` names the queue's role (both in the error).

    Raises:
        PreflightError: none registered in time (the message says which command starts one).
    """
    from rlmq.cli.exits import say
    from rlmq.common.connection import sync_client

    client = sync_client(redis_url)
    deadline = time.monotonic() + timeout
    said = False
    base = queue.split("@", 1)[0]
    try:
        while True:
            live = int(client.zcount(K.serving(queue), time.time() - K.SERVING_CLOCK_SKEW, "+inf"))
            if live or time.monotonic() >= deadline:
                break
            if not said:
                said = True  # at once, not after the wait: what it waits for and how to end the wait
                say(f"rlmq: waiting up to {timeout:g} s for a live worker on the {what} {base} (`{start}`)")
            time.sleep(POLL_SECONDS)  # another process registers; bounded by the deadline
    finally:
        client.close()
    if not live:
        raise PreflightError(
            f"no live worker serves the {what} {base} (waited {timeout:g} s); start one with "
            f"`{start} --redis-url ...`; nothing was run"
        )
    return live


def preflight(settings: Settings, redis_url: str | None, base_url: str, sub_base_url: str | None) -> None:
    """The checks before the rollouts (:mod:`rlmq.cli.preflight`): the root model server, the
    sub-model's server of local workers (``sub_base_url``), else a live worker on the queue.

    Raises:
        PreflightError: one is missing (exit 5).
    """
    servers = {"root model server": base_url}
    if sub_base_url is not None:
        servers["sub-model server"] = sub_base_url
    from rlmq.common.aio import run as run_loop

    api_key = settings.api_key.get_secret_value()
    run_loop(check_model_servers(servers, api_key, settings.preflight_timeout))
    if redis_url:
        sub_model = settings.sub_model or str(settings.model)
        start = f"rlmq worker --model {sub_model}" + (f" --queue {settings.queue}" if settings.queue else "")
        queue = settings.producer_queue(sub_model)
        wait_for_worker(redis_url, queue, start, settings.preflight_timeout)
        if settings.max_depth > 1:  # the children run on REPL hosts, on the queue of depth 2
            host = f"{start} --repl-slots N"
            child_queue = K.child_queue(queue, 2)
            wait_for_worker(redis_url, child_queue, host, settings.preflight_timeout, what="child-rollout queue")
