"""The one exception module of rlmq.

Every error rlmq raises on purpose derives from :class:`RlmqError`. The tree::

    RlmqError
    ├── ConfigError            bad settings or arguments (unknown RLMEnv argument, bad flag)
    ├── PayloadError           a job, result or request body failed pydantic validation
    ├── RedisUnavailable       Redis did not answer within the reconnect budget
    ├── EmbeddedRedisError     no embedded redis-server could be started
    ├── BudgetError            the sub-LLM completion-token budget
    │   └── BudgetExhausted    no grant possible: the budget is spent
    ├── SubLLMError            one sub-LLM call failed
    │   ├── ModelError         the model server failed after the retry layer gave up
    │   └── DeadlineExceeded   no result before the sub-call's deadline
    └── ReplError              the rollout's Python REPL
        ├── ReplStartupError   the REPL did not come up within max_startup_wait_seconds
        └── ReplTimeout        a cell ran past code_execution_timeout (the REPL is restarted)

``python -m common.errors`` prints this tree from the classes themselves.
"""

from __future__ import annotations


class RlmqError(Exception):
    """Base class of every error raised on purpose by rlmq."""


class ConfigError(RlmqError):
    """Settings or arguments are invalid (for example an unknown ``RLMEnv`` argument)."""


class PayloadError(RlmqError):
    """A JSON payload (job, result, interception request) failed validation."""


class RedisUnavailable(RlmqError):
    """Redis did not answer, even after reconnecting with backoff."""


class EmbeddedRedisError(RlmqError):
    """No embedded ``redis-server`` could be found or started."""


class BudgetError(RlmqError):
    """Base class of the sub-LLM completion-token budget errors."""


class BudgetExhausted(BudgetError):
    """No grant is possible: the rollout's sub-LLM completion-token budget is spent.

    Attributes:
        used: tokens charged to the rollout so far (reserved and not released).
        limit: the rollout's ``sub_llm_max_completion_tokens``.
    """

    def __init__(self, used: int, limit: int) -> None:
        super().__init__(f"sub-LLM token budget spent: {used}/{limit} completion tokens used")
        self.used = used
        self.limit = limit


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


class DeadlineExceeded(SubLLMError):
    """A sub-call produced no result before its deadline (seconds since it was enqueued)."""


class ReplError(RlmqError):
    """Base class of the failures of a rollout's REPL subprocess."""


class ReplStartupError(ReplError):
    """The REPL subprocess did not become ready within ``max_startup_wait_seconds``."""


class ReplTimeout(ReplError):
    """A cell ran past ``code_execution_timeout`` seconds; the REPL was killed and restarted."""


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
