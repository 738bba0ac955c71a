"""rlmq for environment modules written for verifiers 0.1.14's ``RLMEnv``
(``pip install 'rlmq[verifiers-legacy]'``).

Change one line of such a module, ``from verifiers.envs.experimental.rlm_env import RLMEnv``,
to ``from rlmq.verifiers_legacy import RLMEnv``; see :mod:`rlmq.verifiers_legacy.env`. It needs
verifiers 0.1.14, which cannot share an environment with the verifiers 0.4 of ``rlmq[verifiers]``.
"""

from __future__ import annotations

from rlmq.verifiers_legacy.env import SANDBOX_ARGUMENTS, RLMEnv
from rlmq.verifiers_legacy.errors import (
    RLMCodeExecutionTimeout,
    RLMSandboxCommandTimeout,
    RLMSessionError,
    RLMSetupError,
    RLMWorkerError,
    RLMWorkerRecoveryError,
    SubLLMEmptyModelResponseError,
)

__all__ = [
    "SANDBOX_ARGUMENTS",
    "RLMCodeExecutionTimeout",
    "RLMEnv",
    "RLMSandboxCommandTimeout",
    "RLMSessionError",
    "RLMSetupError",
    "RLMWorkerError",
    "RLMWorkerRecoveryError",
    "SubLLMEmptyModelResponseError",
]
