"""The one exception module of rlmq.

Every error rlmq raises on purpose derives from :class:`RlmqError`. The tree::

    RlmqError
    ├── ConfigError            bad settings or arguments (unknown RLMEnv argument, bad flag)
    │   ├── ArgumentError      a bad argument of the verifiers 0.1.14 RLMEnv (also a ValueError)
    │   └── UncontainedReplError  a worker asked to host REPLs on a host that cannot contain them
    ├── EmbeddedRedisError     no embedded redis-server could be started
    ├── PayloadError           a job, result or request body failed pydantic validation
    ├── PreflightError         before any rollout, a model server or the queue's workers did not answer
    ├── RedisUnavailableError  a Redis did not answer, or refused the password
    ├── ReplError              the rollout's Python REPL
    │   └── ReplStartupError   the REPL did not come up within max_startup_wait_seconds
    ├── ReplicaAckMissing      a budget grant was not acknowledged by enough Redis replicas in time
    ├── RootBudgetSpent        a child rollout's root turn got too little of its tree's budget
    ├── SubLLMError            one sub-LLM call failed
    │   └── ModelError         the model server failed after the retry layer gave up
    │       └── PromptTooLongError  the server refused the prompt for its length (context window)
    └── WorkerFailed           a worker's long-lived task kept failing: the process exits non-zero

A spent budget, a missed deadline or a timed-out cell are not exceptions: they are results
(``SubLLMResult.status`` / ``error_kind``, ``CellResult.timed_out``) the root model sees.

``python -m rlmq.common.errors`` prints this tree from the classes themselves (in the same order;
``tests/unit/test_payload_errors.py`` holds the drawing to it).
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import ResponseError


class RlmqError(Exception):
    """Base class of every error raised on purpose by rlmq."""


class ConfigError(RlmqError):
    """Settings or arguments are invalid (for example an unknown ``RLMEnv`` argument)."""


class UncontainedReplError(ConfigError):
    """``rlmq worker --repl-slots N`` on a host where the probe REPL is not fully contained (own
    uid, no network, private file system), without ``--allow-uncontained-repl``."""


class ArgumentError(ConfigError, ValueError):
    """A bad argument of ``rlmq.verifiers_legacy.RLMEnv``: a ``ValueError`` as verifiers 0.1.14's
    ``RLMEnv`` raises for one, and a :class:`ConfigError` as rlmq raises for one."""


class PayloadError(RlmqError):
    """A JSON payload (job, result, interception request) failed validation."""


class EmbeddedRedisError(RlmqError):
    """No embedded ``redis-server`` could be found or started."""


class WorkerFailed(RlmqError):
    """A worker's long-lived task (flush, heartbeat, reaper, wake listener) kept failing after
    its restarts; the worker stopped, and its process exits non-zero so that its supervisor
    starts a fresh one (the reaper of the others re-queues whatever it handed back)."""


class RedisUnavailableError(RlmqError):
    """A Redis did not answer, or refused the connection's password; the message names it
    (the URL with its password masked).

    Attributes:
        auth: ``True`` when Redis answered but refused the credentials (waiting will not help).
    """

    def __init__(self, message: str, *, auth: bool = False) -> None:
        super().__init__(message)
        self.auth = auth


class ReplicaAckMissing(RlmqError, ResponseError):
    """A ledger write that lets a model call run (a grant, a begin) was acknowledged by fewer Redis
    replicas than ``redis_replica_acks`` within ``redis_replica_ack_timeout`` (Redis ``WAIT``):
    a replica promoted now might not hold it, so no model call runs on it. Also a redis-py
    ``ResponseError`` whose message starts with ``NOREPLICAS`` (Redis's own word for a write refused
    for want of replicas), so the ledger asks again as for any passing refusal: the write is
    idempotent by reservation id (the same grant again on this master; on a promoted replica that
    lost it, made anew).

    Attributes:
        acked: replicas that acknowledged. wanted: replicas required.
    """

    def __init__(self, acked: int, wanted: int, timeout: float) -> None:
        super().__init__(
            f"NOREPLICAS budget grant acknowledged by {acked} of the {wanted} Redis replica(s) required "
            f"within {timeout:g} s; not used, asked again"
        )
        self.acked = acked
        self.wanted = wanted


class PreflightError(RlmqError):
    """Before any rollout started, a model server did not answer, or no live worker served
    the sub-LLM queue; the message names which (``rlmq run`` exits 5)."""


class SubLLMError(RlmqError):
    """Base class of the failures of one sub-LLM call."""


class ModelError(SubLLMError):
    """The model server failed (HTTP error, malformed body, connection) after all retries.

    Attributes:
        status: the last HTTP status, or ``None`` when no response came back.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class PromptTooLongError(ModelError):
    """The model server refused the prompt because it does not fit the model's context window
    (an OpenAI-compatible server's 400 with a context-length message). Not retried: the same
    prompt would be refused again. The rollout engine ends the rollout with ``prompt_too_long``."""


class RootBudgetSpent(RlmqError):
    """A child rollout's root turn cannot run: the tree budget granted less than its minimum, or
    refused (its tree or its parent ended). Raised by the root client before the model is called;
    the root loop ends the rollout with ``budget_spent`` and its best answer so far."""


class ReplError(RlmqError):
    """Base class of the failures of a rollout's REPL subprocess."""


class ReplStartupError(ReplError):
    """The REPL subprocess did not become ready within ``max_startup_wait_seconds``."""


def validation_summary(exc: Any, root: str) -> str:
    """One line for a pydantic ``ValidationError``: ``field: message; ...`` (``root`` names an
    error of the whole object). Input values are never included."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or root}: {e['msg']}" for e in exc.errors(include_input=False))


def tree(root: type[BaseException] = RlmqError, indent: str = "") -> str:
    """Draw the exception hierarchy below ``root`` as text, one class per line."""
    lines = [root.__name__] if not indent else []
    children = sorted(root.__subclasses__(), key=lambda c: c.__name__)
    for i, child in enumerate(children):
        last = i == len(children) - 1
        lines.append(f"{indent}{'└── ' if last else '├── '}{child.__name__}")
        sub = tree(child, indent + ("    " if last else "│   "))
        if sub:
            lines.append(sub)
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    print(tree())
