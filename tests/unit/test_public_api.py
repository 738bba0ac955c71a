"""What rlmq supports, pinned, and what it does not, marked.

The supported API: the names of ``rlmq.__all__`` (imported from ``rlmq`` itself), the two
plug-ins (``rlmq.verifiers_plugin``, ``rlmq.verifiers_legacy``: their ``__all__``) and the
``rlmq`` command's subcommands. A name added or dropped here is a change of the public contract.

Everything under the three sides (``common/``, ``producer/``, ``workers/``) is internal, and says
so: a line ``Internal: ...`` in its module docstring or in a package docstring above it. The
plug-ins, built on rlmq as any user's code is, import rlmq only through ``rlmq`` and its
supported front ends, never an internal module. Read with :mod:`ast`, so nothing here needs
verifiers installed.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import re
from pathlib import Path

import rlmq
from rlmq.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
SIDES = ("common", "producer", "workers")
PLUGINS = ("verifiers_plugin", "verifiers_legacy")
PLUGIN_CLASSES = ["RlmqEnv", "RlmqHarness", "RlmqTaskset"]
"""Listed in ``rlmq.__all__`` only where verifiers is installed (the verifiers loader takes them)."""

PUBLIC = [
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

PLUGIN_ALL = {
    "verifiers_plugin": [
        "RlmqEnv",
        "RlmqEnvConfig",
        "RlmqHarness",
        "RlmqHarnessConfig",
        "RlmqTask",
        "RlmqTaskData",
        "RlmqTaskset",
        "RlmqTasksetConfig",
    ],
    "verifiers_legacy": [
        "SANDBOX_ARGUMENTS",
        "RLMCodeExecutionTimeout",
        "RLMEnv",
        "RLMSandboxCommandTimeout",
        "RLMSessionError",
        "RLMSetupError",
        "RLMWorkerError",
        "RLMWorkerRecoveryError",
        "SubLLMEmptyModelResponseError",
    ],
}

COMMANDS = ["demo", "export-samples", "mock-llm", "run", "status", "worker"]

INTERNAL = re.compile(r"^Internal: ", re.MULTILINE)


def test_rlmq_all_is_the_supported_list() -> None:
    assert [n for n in rlmq.__all__ if n not in PLUGIN_CLASSES] == PUBLIC


def test_every_public_name_resolves_to_its_definition() -> None:
    """``rlmq.X`` is the object its internal module defines (imported on first use), not a copy."""
    for name in PUBLIC:
        module = importlib.import_module(rlmq._WHERE[name])
        assert getattr(rlmq, name) is getattr(module, name), name


def _literal_all(path: Path) -> list[str]:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, list)
            return value
    raise AssertionError(f"{path} has no __all__")


def test_the_plugins_exports_are_pinned() -> None:
    for plugin, names in PLUGIN_ALL.items():
        assert _literal_all(ROOT / "rlmq" / plugin / "__init__.py") == names, plugin


def test_the_commands_are_pinned() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(sub.choices) == COMMANDS


def _rlmq_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every absolute import of rlmq in ``path`` (in functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "rlmq"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "rlmq":
            found.append((node.lineno, node.module or "", [a.name for a in node.names]))
    return found


def _plugin_breaks(plugin: str, path: Path, root: Path = ROOT) -> list[str]:
    """The imports of ``path`` (a module of ``plugin``, named from ``root``) that reach past the
    supported API."""
    breaks = []
    for line, module, names in _rlmq_imports(path):
        where = f"{path.relative_to(root)}:{line}"
        if module == "rlmq":
            breaks += [f"{where}: rlmq.{n} is not in rlmq.__all__" for n in names if n not in PUBLIC]
        elif not module.startswith((f"rlmq.{plugin}", "rlmq.cli")):
            breaks.append(f"{where}: imports {module}, an internal module")
    return breaks


def test_the_plugins_use_only_the_supported_api() -> None:
    breaks = [b for p in PLUGINS for path in sorted((ROOT / "rlmq" / p).rglob("*.py")) for b in _plugin_breaks(p, path)]
    assert not breaks, breaks


def test_an_internal_import_in_a_plugin_is_seen(tmp_path: Path) -> None:
    """A name outside ``__all__`` and an internal module imported inside a function are both named."""
    bad = tmp_path / "probe.py"
    bad.write_text(
        "from rlmq import RLMEnv, Repl\nfrom rlmq.verifiers_plugin.adapter import exact_match\n\n"
        "def f() -> None:\n    from rlmq.producer.env import normalize_answer\n",
        encoding="utf-8",
    )
    assert _plugin_breaks("verifiers_plugin", bad, tmp_path) == [
        "probe.py:1: rlmq.Repl is not in rlmq.__all__",
        "probe.py:5: imports rlmq.producer.env, an internal module",
    ]


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def _marked(path: Path, side: Path) -> bool:
    """``path``'s docstring, or that of a package above it up to ``side``, has an ``Internal:`` line."""
    if INTERNAL.search(_docstring(path)):
        return True
    folder = path.parent if path.name != "__init__.py" else path.parent.parent
    while folder.is_relative_to(side):
        init = folder / "__init__.py"
        if init.exists() and INTERNAL.search(_docstring(init)):
            return True
        folder = folder.parent
    return False


def test_every_module_of_the_sides_says_it_is_internal() -> None:
    modules = [p for side in SIDES for p in sorted((ROOT / side).rglob("*.py"))]
    assert len(modules) > 80
    unmarked = [str(p.relative_to(ROOT)) for p in modules if not _marked(p, ROOT / p.relative_to(ROOT).parts[0])]
    assert not unmarked, unmarked


def test_each_side_says_so_itself() -> None:
    """The mark sits on each side's own package (so a module added anywhere below it is covered)."""
    for side in SIDES:
        assert INTERNAL.search(_docstring(ROOT / side / "__init__.py")), side
