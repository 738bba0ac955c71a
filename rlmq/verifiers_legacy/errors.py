"""The reference's exception types, importable from ``rlmq.verifiers_legacy``.

They are verifiers 0.1.14's own classes (``verifiers.envs.experimental.rlm_env``), so an
``except RLMCodeExecutionTimeout`` written for the reference catches what this package puts in
a rollout's ``state["error"]``: ``RLMCodeExecutionTimeout`` when a cell ran past
``code_execution_timeout`` with ``abort_on_code_timeout=True``, as the reference's rollout ends.
rlmq's own errors stay in :mod:`rlmq.common.errors`.
"""

from __future__ import annotations

from verifiers.envs.experimental.rlm_env import (
    RLMCodeExecutionTimeout,
    RLMSandboxCommandTimeout,
    RLMSessionError,
    RLMSetupError,
    RLMWorkerError,
    RLMWorkerRecoveryError,
    SubLLMEmptyModelResponseError,
)

__all__ = [
    "RLMCodeExecutionTimeout",
    "RLMSandboxCommandTimeout",
    "RLMSessionError",
    "RLMSetupError",
    "RLMWorkerError",
    "RLMWorkerRecoveryError",
    "SubLLMEmptyModelResponseError",
]
