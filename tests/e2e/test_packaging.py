"""The layout fails loudly, never silently.

``rlmq.common``, ``rlmq.producer`` and ``rlmq.workers`` are the top-level folders
``common/``, ``producer/`` and ``workers/`` (``rlmq/`` links to them). A checkout made without
symlinks once built a 26-file wheel with none of the three, without a word; and under pytest's
default import mode ``common.errors.ConfigError`` could be a second class beside
``rlmq.common.errors.ConfigError``. Here: a real ``git -c core.symlinks=false clone`` of this
branch's committed HEAD, a real ``pip wheel``, real imports in fresh interpreters.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from rlmq.cli.local import child_env

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SIDES = ("common", "producer", "workers")


def tracked_modules() -> set[str]:
    """Every ``.py`` file the wheel must hold, as its path in the wheel (``rlmq/common/keys.py``)."""
    out = subprocess.run(
        ["git", "ls-files", "--", "rlmq", *SIDES], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    return {p if p.startswith("rlmq/") else f"rlmq/{p}" for p in out if p.endswith(".py")}


def build_wheel(source: Path, into: Path) -> zipfile.ZipFile:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(into), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = into.glob("rlmq-*.whl")
    return zipfile.ZipFile(wheel)


def test_a_checkout_without_symlinks_builds_the_complete_wheel(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    subprocess.run(
        ["git", "-c", "core.symlinks=false", "clone", "-q", str(REPO), str(clone)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert (clone / "rlmq" / "common").is_file()  # the link is a text file here: the trap is set
    names = set(build_wheel(clone, tmp_path / "wheel").namelist())
    missing = sorted(tracked_modules() - names)
    assert not missing, f"the wheel lacks {missing}"
    assert "rlmq/py.typed" in names
    assert "rlmq/data/sample.jsonl" in names  # the sample dataset of the README's `rlmq run`
    assert not {"rlmq/common", "rlmq/producer", "rlmq/workers"} & names  # no link stub shipped
    # run from that checkout itself (its root first on sys.path), rlmq says why it cannot work
    proc = subprocess.run(
        [sys.executable, "-c", "import rlmq"], cwd=clone, capture_output=True, text=True, timeout=60, env=child_env()
    )
    assert proc.returncode != 0 and "this checkout was made without symlinks" in proc.stderr, proc.stderr[-2000:]


def test_a_build_without_a_side_folder_stops_with_a_clear_line(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, capture_output=True, timeout=120)
    subprocess.run(["git", "rm", "-r", "-q", "producer"], cwd=clone, check=True, capture_output=True, timeout=60)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "w"), str(clone)],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
    )
    assert proc.returncode != 0
    assert "package directory 'producer' does not exist" in proc.stdout + proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("side", SIDES)
def test_a_side_folder_imported_under_its_bare_name_fails_loudly(side: str) -> None:
    """With the checkout's root first on ``sys.path`` (pytest's default import mode puts it
    there for ``tests/``), ``import common.errors`` would load a second copy; it must refuse."""
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); import {side}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=child_env())
    assert proc.returncode != 0
    assert f"ImportError: the folder {side}/ is the package rlmq.{side}: import rlmq.{side}" in proc.stderr


def test_one_configerror_class_under_the_checkout_on_sys_path() -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); import rlmq.common.errors as e, rlmq.common.settings as s; "
        "assert s.ConfigError is e.ConfigError; print(e.__file__)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=child_env())
    assert proc.returncode == 0, proc.stderr


def test_an_editable_install_of_a_checkout_without_symlinks_imports(tmp_path: Path) -> None:
    """The README's own set-up (``pip install -e .``) in a checkout made without symlinks: the
    editable install maps ``rlmq.common`` to ``common/`` and works, so the layout guard must not
    refuse it (it refused every import, though nothing was missing)."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "-c", "core.symlinks=false", "clone", "-q", str(REPO), str(clone)],
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    prefix = tmp_path / "prefix"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", "--prefix", str(prefix),
         "-e", str(clone)],
        capture_output=True, text=True, timeout=600, env=child_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    own = subprocess.run([sys.executable, "-m", "pip", "show", "rlmq"], capture_output=True, text=True, timeout=120)
    assert f"Editable project location: {REPO}" in own.stdout, own.stdout  # this interpreter's rlmq left alone
    (site,) = prefix.glob("lib/python3*/site-packages")
    # -S: only that install's path hooks, not this interpreter's own editable rlmq; run outside the clone.
    # This interpreter's site-packages go last on the path, unprocessed (no .pth: not its editable
    # rlmq's finder), for the dependencies (redis) the install was made without.
    deps = sysconfig.get_paths()["purelib"]
    code = (f"import site, sys; site.addsitedir({str(site)!r}); sys.path.append({deps!r}); "
            "import rlmq.common.errors as e, rlmq.workers as w; print(e.__file__); print(w.__file__)")  # fmt: skip
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(clone / "common" / "errors.py"), str(clone / "workers" / "__init__.py")]
