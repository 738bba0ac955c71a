"""Assembling a process's :class:`~rlmq.producer.engine.RolloutHost`, written once.

Two processes host rollouts: ``RLMEnv`` (top rollouts, :mod:`rlmq.producer.env`) and a worker
hosting child rollouts (:mod:`rlmq.workers.child_host`). Both make their root model client with
:func:`root_model` (one timeout for every root call: ``root_model_timeout``) and their
interception server and host with :func:`start_host`.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from rlmq.common.errors import ConfigError
from rlmq.common.metrics import Metrics
from rlmq.common.settings import Settings
from rlmq.producer.engine import RolloutHost
from rlmq.producer.interception import InterceptionServer
from rlmq.producer.root import RootClient, RootModel
from rlmq.producer.root_tools import RootToolbox

__all__ = ["StartedHost", "root_model", "start_host"]


def root_model(settings: Settings, *, needed_for: str) -> RootModel:
    """The root model client of ``settings``: ``base_url`` with ``api_key``, ``model_retries``
    retries and ``root_model_timeout`` seconds per HTTP attempt.

    Args:
        needed_for: what needs it, for the error (``"RLMEnv needs settings.base_url ..."``).

    Raises:
        ConfigError: no ``base_url``; the message is ``needed_for``.
    """
    if not settings.base_url:
        raise ConfigError(needed_for)
    return RootModel(
        str(settings.base_url),
        settings.api_key.get_secret_value(),
        retries=settings.model_retries,
        timeout=settings.root_model_timeout,
    )


@dataclass
class StartedHost:
    """A host and the server it owns (its owner stops the server when it is done)."""

    host: RolloutHost
    server: InterceptionServer


async def start_host(
    settings: Settings,
    redis: Redis,
    root: RootClient,
    *,
    metrics: Metrics | None = None,
    toolbox: RootToolbox | None = None,
) -> StartedHost:
    """Start an interception server with the limits of ``settings`` (``max_batch_prompts``,
    ``max_batch_bytes``, ``root_tool_max_args_bytes``) and build the host of its rollouts on
    ``redis`` and ``root`` (finished sub-call jobs kept ``result_ttl`` seconds).

    Args:
        metrics: updated with each batch and each refused sub-call, if given.
        toolbox: the root tools of the rollouts, if any.

    Raises:
        OSError: the server could not listen (nothing is left running).
    """
    server = InterceptionServer(
        max_batch_prompts=settings.max_batch_prompts,
        max_batch_bytes=settings.max_batch_bytes,
        max_tool_bytes=settings.root_tool_max_args_bytes,
    )
    try:
        await server.start()
    except BaseException:
        await server.stop()  # idempotent: whatever of it started
        raise
    host = RolloutHost.build(redis, root, server, metrics=metrics, result_ttl=settings.result_ttl, toolbox=toolbox)
    host.frozen = settings.frozen_fleet  # a frozen fleet's REPL host: its child root turns are untrainable
    host.token_api = settings.token_api()  # the fields its root model server takes and answers for tokens
    return StartedHost(host, server)
