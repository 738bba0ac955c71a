"""The verifiers 0.1.14 venv of the ``rlmq.verifiers_legacy`` tests, built once and kept.

verifiers 0.1.14 (the last release with ``RLMEnv``) and the verifiers 0.4 of ``rlmq[test]``
cannot share one environment, so these tests run their verifiers side as subprocesses of a
second venv, ``.venv-legacy`` at the checkout's root: ``pip install -e '.[verifiers-legacy]'``
(this checkout, editable, so code changes need no rebuild). It is built by the first test
session that needs it (a few minutes; PyPI must be reachable) and reused while
``pyproject.toml``'s ``[project]`` and ``[tool.setuptools]`` are unchanged (a stamp file records their hash). A failed
build fails the tests that need it, with pip's output; nothing is skipped. Sessions in parallel
(pytest-xdist) wait on one lock file, so the venv is built once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-legacy"
STAMP = VENV / ".rlmq-stamp"
BUILD_TIMEOUT = 1200
"""Seconds a build may take (about 5 minutes on a loaded 2-core box with an empty pip cache)."""


def _stamp() -> str:
    """What the venv was built from: pyproject's ``[project]`` table (dependencies, extras,
    entry points) and ``[tool.setuptools]`` (the packages); other tool settings do not count."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    built_from = {"project": pyproject["project"], "packages": pyproject["tool"]["setuptools"]}
    digest = hashlib.sha256(json.dumps(built_from, sort_keys=True).encode())
    return digest.hexdigest()


def build_steps(venv: Path) -> dict[str, list[str]]:
    """The commands that build the venv at ``venv``: ``python -m venv``, then ``pip install -e
    '.[verifiers-legacy]' pytest pytest-asyncio`` without compiling every module up front (``--no-compile``: Python
    compiles what the tests import when they import it; measured 258-508 s with, 101 s without,
    on two busy cores)."""
    base = getattr(sys, "_base_executable", sys.executable)
    python = str(venv / "bin" / "python")
    packages = [f"{ROOT}[verifiers-legacy]", "pytest", "pytest-asyncio"]  # pytest: the reference's test file
    return {
        "venv": [base, "-m", "venv", str(venv)],
        "pip_install": [python, "-m", "pip", "install", "-q", "--no-compile", "-e", *packages],
    }


def legacy_python() -> Path:
    """The venv's Python, building the venv first when it is missing or stale.

    Raises:
        pytest.fail.Exception: the build failed or took more than :data:`BUILD_TIMEOUT` seconds.
    """
    python = VENV / "bin" / "python"
    with open(ROOT / ".venv-legacy.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if STAMP.is_file() and STAMP.read_text() == _stamp() and python.exists():
            return python
        shutil.rmtree(VENV, ignore_errors=True)
        started = time.monotonic()
        for argv in build_steps(VENV).values():
            try:
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT, cwd=ROOT)
            except subprocess.TimeoutExpired:
                pytest.fail(f"building {VENV} took more than {BUILD_TIMEOUT} s: {' '.join(argv)}")
            if proc.returncode != 0:
                pytest.fail(f"building {VENV} failed ({' '.join(argv)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        STAMP.write_text(_stamp())
        print(f"\n[built {VENV} in {time.monotonic() - started:.0f} s]", file=sys.stderr)
        return python


@pytest.fixture(scope="session")
def legacy() -> Iterator[Path]:
    """Path of the verifiers 0.1.14 venv's Python (built on first use)."""
    yield legacy_python()


def legacy_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of a subprocess in the legacy venv: the reference-style module on
    ``PYTHONPATH``, no ``RLMQ_*`` of the machine, ``extra`` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLMQ_") and k != "REDIS_URL"}
    env.update({"PYTHONPATH": str(ROOT / "tests" / "legacy" / "envs"), "RLMQ_TEST_KEY": "sk-test", **extra})
    return env
