"""Exit codes of the ``rlmq`` commands, and the one line printed when a command fails.

The README lists them; a stop signal ``N`` (SIGINT 2, SIGTERM 15, SIGHUP 1) gives ``128 + N``.
"""

from __future__ import annotations

import sys

from rlmq.common.connection import mask_url
from rlmq.common.errors import (
    ConfigError,
    EmbeddedRedisError,
    PayloadError,
    PreflightError,
    RedisUnavailableError,
    RlmqError,
)

EXIT_OK = 0
"""Every rollout finished without error (or the command did its job)."""
EXIT_ROLLOUT_ERRORS = 1
"""The run finished, but at least one rollout ended with ``stop_reason`` ``error``."""
EXIT_USAGE = 2
"""A mistake in the command: a bad flag (argparse's own code), a dataset that is missing,
empty, malformed or has duplicate ids, an ``--output`` folder that does not exist."""
EXIT_REDIS = 3
"""Redis unreachable, refusing the password, or no embedded Redis could be started."""
EXIT_INTERNAL = 4
"""Anything else: a bug or an unexpected failure (``--verbose`` shows the traceback)."""
EXIT_UNAVAILABLE = 5
"""Before any rollout started: a model server (root, or the sub-model's of local workers) did
not answer, or no live worker served the sub-LLM queue (:mod:`rlmq.cli.preflight`)."""
EXIT_SUB_CALLS_FAILED = 6
"""No rollout ended in ``error``, but more than ``--max-sub-call-error-rate`` of the sub-LLM
calls did (all of them, when the sub-model's server is down): the answers are not the model's."""
EXIT_BUDGET_STARVED = 7
"""Neither 1 nor 6, but the tree budget ended at least one child rollout (stop reason
``budget_spent``): the trees' answers were cut short by ``--sub-llm-max-completion-tokens``."""


def explain(exc: BaseException) -> tuple[int, str]:
    """The exit code and the one line printed for an exception that ended a command."""
    import redis

    if isinstance(exc, (RedisUnavailableError, EmbeddedRedisError)):
        return EXIT_REDIS, str(exc)
    if isinstance(exc, PreflightError):
        return EXIT_UNAVAILABLE, str(exc)
    if isinstance(exc, redis.RedisError):  # lost mid-run, past the client's reconnect backoff
        return EXIT_REDIS, f"Redis failed: {type(exc).__name__}: {mask_url(str(exc))}"
    if isinstance(exc, (ConfigError, PayloadError)):
        return EXIT_USAGE, str(exc)
    if isinstance(exc, RlmqError):
        return EXIT_INTERNAL, f"{type(exc).__name__}: {mask_url(str(exc))}"
    return EXIT_INTERNAL, f"internal error: {type(exc).__name__}: {mask_url(str(exc))}"


def say(text: str) -> None:
    """One line to stderr, at once (progress of a stop, errors)."""
    print(text, file=sys.stderr, flush=True)
