"""rlmq: Recursive Language Model rollouts whose sub-LLM calls run on a Redis-backed worker fleet.

One import name. ``rlmq.common``, ``rlmq.producer`` and ``rlmq.workers`` are the repository's
top-level folders ``common/``, ``producer/`` and ``workers/`` (this folder links to them, so an
editable install, ``mypy --strict`` and a built wheel all see the same single package).

The public API, for a trainer or an evaluation script::

    from rlmq import RLMEnv, Settings, DatasetRow, load_settings

Importing ``rlmq`` connects to nothing and imports nothing optional (no verifiers). The names
above are imported on first use (PEP 562), so ``import rlmq.cli.main`` (every ``rlmq``
command) does not first load the openai client, pydantic and redis: a command installs its
signal handlers within a few hundred milliseconds of starting.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlmq.common.errors import ConfigError, RlmqError
    from rlmq.common.schemas import DatasetRow, ResultRow, SubLLMRequest, SubLLMResult, read_dataset
    from rlmq.common.settings import Settings, load_settings
    from rlmq.producer.env import RLMEnv, RolloutResult

_WHERE = {
    "ConfigError": "rlmq.common.errors",
    "RlmqError": "rlmq.common.errors",
    "DatasetRow": "rlmq.common.schemas",
    "ResultRow": "rlmq.common.schemas",
    "SubLLMRequest": "rlmq.common.schemas",
    "SubLLMResult": "rlmq.common.schemas",
    "read_dataset": "rlmq.common.schemas",
    "Settings": "rlmq.common.settings",
    "load_settings": "rlmq.common.settings",
    "RLMEnv": "rlmq.producer.env",
    "RolloutResult": "rlmq.producer.env",
}

__all__ = [
    "ConfigError",
    "DatasetRow",
    "RLMEnv",
    "ResultRow",
    "RlmqError",
    "RolloutResult",
    "Settings",
    "SubLLMRequest",
    "SubLLMResult",
    "load_settings",
    "read_dataset",
]


def __getattr__(name: str) -> Any:
    """The public names, imported from their modules on first use."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'rlmq' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
