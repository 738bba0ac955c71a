"""rlmq as a verifiers v1 plug-in (``pip install 'rlmq[verifiers]'``), id ``rlmq``.

``vf-eval rlmq --env.agent.harness.id rlmq`` loads the plug-in by importing the module
``rlmq`` (verifiers' loader, ``verifiers/v1/utils/loaders.py``, imports the id as a module and
takes the ``Harness`` / ``Taskset`` subclass it exports in ``__all__``). ``rlmq/__init__.py``
lists these names and imports this package only when one of them is asked for, so
``import rlmq`` never imports verifiers.
"""

from __future__ import annotations

from rlmq.verifiers_plugin.harness import RlmqHarness, RlmqHarnessConfig
from rlmq.verifiers_plugin.taskset import (
    RlmqEnv,
    RlmqEnvConfig,
    RlmqTask,
    RlmqTaskData,
    RlmqTaskset,
    RlmqTasksetConfig,
)

__all__ = [
    "RlmqEnv",
    "RlmqEnvConfig",
    "RlmqHarness",
    "RlmqHarnessConfig",
    "RlmqTask",
    "RlmqTaskData",
    "RlmqTaskset",
    "RlmqTasksetConfig",
]
