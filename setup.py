"""What ``pyproject.toml`` cannot state: where rlmq's packages are.

One import name, ``rlmq``: the folder ``rlmq/`` (``rlmq``, ``rlmq.cli``, ...) and the
repository's top-level folders ``common/``, ``producer/`` and ``workers/``, which are
``rlmq.common``, ``rlmq.producer`` and ``rlmq.workers``. The wheel takes those three from the
top-level folders themselves (``package_dir``), never through the links ``rlmq/common`` etc.
(which exist for ``mypy`` and for tests run in the checkout), so a checkout made without
symlinks (``git -c core.symlinks=false clone``, some Windows and CI setups) builds the same,
complete wheel. A side folder that is missing stops the build with one clear line.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
SIDES = ("common", "producer", "workers")
"""The top-level folders that are subpackages of ``rlmq``."""


def layout() -> tuple[list[str], dict[str, str]]:
    """The packages of the wheel and the folder of each (``package_dir``).

    Raises:
        SystemExit: a side folder (or its ``__init__.py``) is missing.
    """
    missing = [side for side in SIDES if not (HERE / side / "__init__.py").is_file()]
    if missing:
        raise SystemExit(
            f"rlmq build: the folder(s) {', '.join(missing)} (with __init__.py) are missing next to pyproject.toml; "
            "they are the packages rlmq.common, rlmq.producer and rlmq.workers"
        )
    skip = [*SIDES, *(f"{side}.*" for side in SIDES)]
    packages = ["rlmq", *(f"rlmq.{p}" for p in find_packages(str(HERE / "rlmq"), exclude=skip))]
    package_dir = {"rlmq": "rlmq"}
    for side in SIDES:
        package_dir[f"rlmq.{side}"] = side
        packages += [f"rlmq.{side}", *(f"rlmq.{side}.{p}" for p in find_packages(str(HERE / side)))]
    return packages, package_dir


PACKAGES, PACKAGE_DIR = layout()
setup(packages=PACKAGES, package_dir=PACKAGE_DIR, package_data={"rlmq": ["py.typed"], "rlmq.data": ["sample.jsonl"]})
