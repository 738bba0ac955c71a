"""The import rules between rlmq's sides and between the packages of ``common/``.

Read from the source with :mod:`ast` (every ``import`` and ``from ... import``, those inside
functions included), so a module that breaks a rule fails here before it ships. The rules, as
the code keeps them (and as each package's ``__init__`` docstring states them):

- ``common`` imports nothing of rlmq outside ``rlmq.common``: never ``producer``, ``workers``,
  the CLI, the plug-ins or the scripted model.
- ``producer`` never imports ``workers`` (a worker runs a child rollout through the producer's
  engine, so only ``workers`` -> ``producer`` is allowed); neither side imports the CLI, the
  plug-ins or the scripted model.
- ``common.settings`` imports no ``common.budget`` and no ``common.jobs`` (both read their
  defaults from it).
- ``common.budget`` imports no ``common.jobs`` (an enqueue runs the ledger's script, not the
  other way round).
- The flat modules of ``common`` (keys, errors, schemas, connection, ...) import no
  ``common.jobs``.
- The REPL child (``producer/repl_child/``, a program that runs where rlmq may not be
  importable) imports the standard library and its own modules only, those relatively (the one
  place relative imports are allowed); the rest of rlmq imports from it only what it shares
  with the parent (the package's ``__all__``).

And the mapping of the sides into ``rlmq``, declared once in ``pyproject.toml``'s
``[tool.setuptools]``: its package list is every package folder, and the links in ``rlmq/`` agree
with its ``package-dir``.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SIDES = ("common", "producer", "workers")
FRONT = ("rlmq.cli", "rlmq.scripted", "rlmq.verifiers_plugin", "rlmq.verifiers_legacy")
"""What is built on the sides: none of the three sides imports it."""

GROUPED = ("budget", "jobs", "settings")
"""The packages of ``common/``."""

CHILD = ROOT / "producer" / "repl_child"
"""The REPL child's package: stdlib only, its own modules imported relatively."""


def _module(path: Path) -> str:
    """``common/budget/ledger.py`` -> ``rlmq.common.budget.ledger`` (a package: its folder's name)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["rlmq", *parts])


def _imports(path: Path) -> set[str]:
    """Every rlmq module ``path`` imports: ``from rlmq.common import keys`` counts as ``rlmq.common.keys``
    (in the REPL child, ``from .endpoint import make_llm_batch`` as ``rlmq.producer.repl_child.endpoint``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and path.parent == CHILD:
            base = ".".join(filter(None, ("rlmq.producer.repl_child", node.module)))
            found |= {base, *(f"{base}.{a.name}" for a in node.names)}
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name == "rlmq" or a.name.startswith("rlmq.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "rlmq" or node.module.startswith("rlmq."):
                found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno}: a relative import (rlmq spells them out)")
    return found


GRAPH = {_module(p): _imports(p) for side in SIDES for p in sorted((ROOT / side).rglob("*.py"))}
"""Every module of the three sides -> the rlmq names it imports."""


def _group(module: str) -> str:
    """``rlmq.common.budget.wire`` -> ``common.budget``, ``rlmq.common.keys`` -> ``common``, ``rlmq.cli`` stays."""
    parts = module.split(".")
    if parts[1:2] == ["common"] and len(parts) > 2 and parts[2] in GROUPED:
        return f"common.{parts[2]}"
    if len(parts) > 1 and parts[1] in SIDES:
        return parts[1]
    return ".".join(parts[:2])


def _breaks(source: str, forbidden: tuple[str, ...]) -> list[str]:
    """The imports of modules in group ``source`` that land in a group of ``forbidden``."""
    return sorted(
        f"{mod} imports {name}"
        for mod, names in GRAPH.items()
        if _group(mod) == source
        for name in names
        if _group(name) in forbidden
    )


RULES = [
    ("common", ("producer", "workers", *FRONT)),
    ("common.budget", ("producer", "workers", "common.jobs", *FRONT)),
    ("common.jobs", ("producer", "workers", *FRONT)),
    ("common.settings", ("producer", "workers", "common.budget", "common.jobs", *FRONT)),
    ("producer", ("workers", *FRONT)),
    ("workers", FRONT),
]


@pytest.mark.parametrize(("source", "forbidden"), RULES, ids=[r[0] for r in RULES])
def test_import_rule_holds(source: str, forbidden: tuple[str, ...]) -> None:
    assert not _breaks(source, forbidden)


def _child_imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level name) of each absolute import of ``path``; a relative one is ``"."``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." * node.level if node.level else (node.module or "").split(".")[0]))
    return found


def test_the_repl_child_imports_the_standard_library_and_itself_only() -> None:
    """It runs under ``python -I`` (another interpreter than the producer's, maybe) and runs
    model-written code: no rlmq, no third-party package; its own modules relatively (``..``
    would leave the package)."""
    modules = sorted(CHILD.glob("*.py"))
    assert {p.name for p in modules} >= {"__init__.py", "__main__.py", "containment.py", "endpoint.py", "cells.py"}
    allowed = set(sys.stdlib_module_names) | {"__future__", "."}
    strangers = [
        f"{p.relative_to(ROOT)}:{line} imports {name}" for p in modules for line, name in _child_imports(p)
        if name not in allowed
    ]  # fmt: skip
    assert not strangers
    assert not [p for p in CHILD.rglob("*") if p.is_dir() and p.name != "__pycache__"]  # one flat folder


def test_a_foreign_import_in_the_repl_child_is_seen(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom .cells import CellRunner\nfrom .. import engine\nimport redis\n", encoding="utf-8")
    names = [name for _, name in _child_imports(bad)]
    assert names == ["os", ".", "..", "redis"]


def test_rlmq_takes_from_the_repl_child_only_what_it_shares() -> None:
    """The producer (and the rest of rlmq) import the package's shared names, never its inner modules."""
    from rlmq.producer import repl_child

    shared = {"rlmq.producer.repl_child", *(f"rlmq.producer.repl_child.{n}" for n in repl_child.__all__)}
    taken = {n for m, names in GRAPH.items() if not m.startswith("rlmq.producer.repl_child") for n in names}
    assert {n for n in taken if n.startswith("rlmq.producer.repl_child")} <= shared
    assert "rlmq.producer.repl_child.UID_BASE" in taken  # the uid base is shared, not retyped


def test_the_scan_reads_every_package() -> None:
    """Every group has modules and imports, so a moved folder cannot empty a rule silently."""
    groups = {_group(m) for m in GRAPH}
    assert groups == {"common", "common.budget", "common.jobs", "common.settings", "producer", "workers"}
    assert "rlmq.common.budget.ledger" in GRAPH["rlmq.common.jobs.store"]  # the allowed edge the rules keep
    assert any(_group(n) == "producer" for m, names in GRAPH.items() if _group(m) == "workers" for n in names)


def test_a_broken_rule_is_seen(tmp_path: Path) -> None:
    """The parser sees an import inside a function, and the check names it."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f() -> None:\n    from rlmq.common.jobs.store import JobStore\n", encoding="utf-8")
    GRAPH["rlmq.common.budget.bad"] = _imports(bad)
    try:
        assert _breaks("common.budget", ("common.jobs",)) == [
            "rlmq.common.budget.bad imports rlmq.common.jobs.store",
            "rlmq.common.budget.bad imports rlmq.common.jobs.store.JobStore",
        ]
    finally:
        del GRAPH["rlmq.common.budget.bad"]


def _setuptools() -> dict[str, Any]:
    """``pyproject.toml``'s ``[tool.setuptools]``: the one declaration of where rlmq's packages are."""
    table: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    return table


def test_the_declared_packages_are_every_package_folder() -> None:
    """A package folder missing from the list would be left out of the wheel; a listed one that is gone
    fails the build."""
    declared = _setuptools()
    folders = declared["package-dir"]
    found = set()
    for name, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            if name == "rlmq" and rel and rel[0] in SIDES:
                continue  # the links to the sides: their own entries list them
            found.add(".".join([name, *rel]))
    assert sorted(declared["packages"]) == sorted(found)


def test_the_links_in_rlmq_agree_with_package_dir() -> None:
    """``rlmq/common`` etc. (for mypy and for tests run in the checkout) point where the wheel takes the sides from."""
    sides = {k: v for k, v in _setuptools()["package-dir"].items() if k != "rlmq"}
    assert sides == {f"rlmq.{s}": s for s in SIDES}
    for side in SIDES:
        link = ROOT / "rlmq" / side
        assert link.is_symlink() and link.resolve() == (ROOT / side).resolve(), link
