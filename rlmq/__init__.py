"""rlmq: Recursive Language Model rollouts whose sub-LLM calls run on a Redis-backed worker fleet.

One import name. ``rlmq.common``, ``rlmq.producer`` and ``rlmq.workers`` are the repository's
top-level folders ``common/``, ``producer/`` and ``workers/`` (this folder links to them, so an
editable install, ``mypy --strict`` and a built wheel all see the same single package).

The public API, for a trainer or an evaluation script::

    from rlmq import RLMEnv, Settings, DatasetRow, load_settings

Importing ``rlmq`` connects to nothing and imports nothing optional (no verifiers).
"""

from __future__ import annotations

from rlmq.common.errors import ConfigError, RlmqError
from rlmq.common.schemas import DatasetRow, ResultRow, SubLLMRequest, SubLLMResult, read_dataset
from rlmq.common.settings import Settings, load_settings
from rlmq.producer.env import RLMEnv, RolloutResult

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
