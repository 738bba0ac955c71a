"""rlmq: Recursive Language Model rollouts whose sub-LLM calls run on a Redis-backed worker fleet.

One import name. ``rlmq.common``, ``rlmq.producer`` and ``rlmq.workers`` are the repository's
top-level folders ``common/``, ``producer/`` and ``workers/`` (this folder links to them, so an
editable install, ``mypy --strict`` and a built wheel all see the same single package).

The supported API is what ``__all__`` lists, imported from ``rlmq`` itself, for a trainer, an
evaluation script or a plug-in::

    from rlmq import RLMEnv, Settings, DatasetRow, load_settings

with the plug-ins (:mod:`rlmq.verifiers_plugin`, :mod:`rlmq.verifiers_legacy`) and the ``rlmq``
command. Every module under ``rlmq.common``, ``rlmq.producer`` and ``rlmq.workers`` is internal
(their packages say so): it may change in any release, even where a public name is defined in it.
``tests/unit/test_public_api.py`` pins the list and checks that the plug-ins use nothing else.

Importing ``rlmq`` connects to nothing and imports nothing optional (no verifiers). The names
above are imported on first use (PEP 562), so ``import rlmq.cli.main`` (every ``rlmq``
command) does not first load the openai client, pydantic and redis: a command installs its
signal handlers within a few hundred milliseconds of starting.

With the ``verifiers`` extra, ``rlmq`` is also a verifiers v1 plug-in id: verifiers' loader
imports the module named by the id and takes the ``Harness`` / ``Taskset`` / ``Env``
subclasses listed in its ``__all__``. ``RlmqHarness``, ``RlmqTaskset`` and ``RlmqEnv`` (the
taskset's env) are listed there when verifiers is installed (found, not imported) and
resolved lazily from :mod:`rlmq.verifiers_plugin`, so only asking for one of them imports
verifiers; without the extra, ``from rlmq import *`` still works.
"""

from __future__ import annotations

import importlib
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any


def _check_layout() -> None:
    """Stop with one clear line when ``rlmq/common`` (``producer``, ``workers``) is a file: a
    checkout made without symlinks, where the links are text files and every
    ``import rlmq.common...`` would fail far from the cause (a wheel holds real folders; an
    editable install of that checkout maps the folders itself and passes).

    Raises:
        ImportError: a link of the checkout is not a folder.
    """
    here = Path(__file__).parent
    for side in ("common", "producer", "workers"):
        if (here / side).is_file() and not _mapped_here(side, here.parent / side):
            raise ImportError(
                f"{here / side} is a file, not a link to ../{side}: this checkout was made without symlinks. "
                "Run `git config core.symlinks true && git checkout -f -- rlmq` in it, "
                "or install a wheel (pip install .)"
            )


def _mapped_here(side: str, folder: Path) -> bool:
    """Whether an import hook maps ``rlmq.<side>`` to this checkout's own ``folder`` (an
    editable install, ``pip install -e .``, does: it needs no link)."""
    try:
        spec = find_spec(f"rlmq.{side}")
    except (ImportError, ValueError):
        return False
    origin = spec.origin if spec is not None else None
    return origin is not None and Path(origin).resolve().parent == folder.resolve()


_check_layout()

if TYPE_CHECKING:
    from rlmq.common.errors import (
        ArgumentError,
        ConfigError,
        ModelError,
        PromptTooLongError,
        RlmqError,
        RootBudgetSpent,
    )
    from rlmq.common.sampling import DEFAULT_CALL_MAX_TOKENS
    from rlmq.common.schemas import (
        ROOT_RESERVED_SAMPLING,
        DatasetRow,
        ResultRow,
        SubLLMRequest,
        SubLLMResult,
        read_dataset,
    )
    from rlmq.common.settings import RolloutOptions, Settings, build_settings, load_settings
    from rlmq.common.settings.schema import unset_model
    from rlmq.common.token_wire import expand_trajectory, turn_counts
    from rlmq.common.tool_wire import TOOL_ERROR
    from rlmq.common.tree import MAX_DEPTH
    from rlmq.producer.env import RLMEnv, RolloutResult
    from rlmq.producer.rollout import normalize_answer

_WHERE = {
    "ArgumentError": "rlmq.common.errors",
    "ConfigError": "rlmq.common.errors",
    "ModelError": "rlmq.common.errors",
    "PromptTooLongError": "rlmq.common.errors",
    "RlmqError": "rlmq.common.errors",
    "RootBudgetSpent": "rlmq.common.errors",
    "DEFAULT_CALL_MAX_TOKENS": "rlmq.common.sampling",
    "ROOT_RESERVED_SAMPLING": "rlmq.common.schemas",
    "DatasetRow": "rlmq.common.schemas",
    "ResultRow": "rlmq.common.schemas",
    "SubLLMRequest": "rlmq.common.schemas",
    "SubLLMResult": "rlmq.common.schemas",
    "read_dataset": "rlmq.common.schemas",
    "RolloutOptions": "rlmq.common.settings",
    "Settings": "rlmq.common.settings",
    "build_settings": "rlmq.common.settings",
    "load_settings": "rlmq.common.settings",
    "unset_model": "rlmq.common.settings.schema",
    "expand_trajectory": "rlmq.common.token_wire",
    "turn_counts": "rlmq.common.token_wire",
    "TOOL_ERROR": "rlmq.common.tool_wire",
    "MAX_DEPTH": "rlmq.common.tree",
    "RLMEnv": "rlmq.producer.env",
    "RolloutResult": "rlmq.producer.env",
    "normalize_answer": "rlmq.producer.rollout",
}
"""Each public name -> the internal module that defines it (imported on first use)."""

_PLUGIN = ("RlmqEnv", "RlmqHarness", "RlmqTaskset")
"""verifiers plug-in classes, resolved on first access (see the module docstring)."""

__all__ = [
    "DEFAULT_CALL_MAX_TOKENS",
    "MAX_DEPTH",
    "ROOT_RESERVED_SAMPLING",
    "TOOL_ERROR",
    "ArgumentError",
    "ConfigError",
    "DatasetRow",
    "ModelError",
    "PromptTooLongError",
    "RLMEnv",
    "ResultRow",
    "RlmqError",
    "RolloutOptions",
    "RolloutResult",
    "RootBudgetSpent",
    "Settings",
    "SubLLMRequest",
    "SubLLMResult",
    "build_settings",
    "expand_trajectory",
    "load_settings",
    "normalize_answer",
    "read_dataset",
    "turn_counts",
    "unset_model",
]
if find_spec("verifiers") is not None:  # the extra is installed: export the plug-in (no import yet)
    __all__ += _PLUGIN


def __getattr__(name: str) -> Any:
    """The public names, imported from their modules on first use; the verifiers plug-in
    classes (``RlmqHarness``, ``RlmqTaskset``, ``RlmqEnv``) from :mod:`rlmq.verifiers_plugin`.

    Raises:
        AttributeError: any other missing name.
        ImportError: a plug-in class was asked for and verifiers is not installed
            (``pip install 'rlmq[verifiers]'``).
    """
    module = _WHERE.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if name in _PLUGIN:
        try:
            from rlmq import verifiers_plugin
        except ImportError as exc:
            raise ImportError(
                f"rlmq.{name} needs verifiers: pip install 'rlmq[verifiers]' ({exc})", name=exc.name
            ) from exc
        return getattr(verifiers_plugin, name)
    raise AttributeError(f"module 'rlmq' has no attribute {name!r}")
