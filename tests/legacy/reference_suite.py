"""The reference's own test file, run against ``rlmq.verifiers_legacy.RLMEnv``.

verifiers 0.1.14's ``tests/test_rlm_env.py`` is taken from its sdist, downloaded with pip into
the legacy venv's folder at test time (nothing of it is kept in this repository), its import of
``RLMEnv`` is pointed at ``rlmq.verifiers_legacy`` (the only change), and it is run with pytest
in the verifiers 0.1.14 venv. :func:`outcomes` gives each test's outcome; ``reference_suite.txt``
beside this module is what each is expected to be, and why when it is not a pass.
"""

from __future__ import annotations

import re
import subprocess
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

VERSION = "0.1.14"
MEMBER = f"verifiers-{VERSION}/tests/test_rlm_env.py"
REFERENCE_IMPORT_BLOCK = "from verifiers.envs.experimental.rlm_env import (\n"
RLMQ_IMPORT = "from rlmq.verifiers_legacy import RLMEnv\n"
EXPECTED = Path(__file__).with_name("reference_suite.txt")
OUTCOMES = ("pass", "fail", "error", "skip")


def sdist(legacy: Path, cache: Path, timeout: float = 600) -> Path:
    """The verifiers 0.1.14 sdist in ``cache`` (downloaded with the legacy venv's pip the first time).

    Raises:
        AssertionError: pip failed or left no sdist.
    """
    found = sorted(cache.glob(f"verifiers-{VERSION}.tar.gz"))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        argv = [str(legacy), "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        proc = subprocess.run(
            [*argv, f"verifiers=={VERSION}", "-d", str(cache)], capture_output=True, text=True, timeout=timeout
        )
        assert proc.returncode == 0, f"pip download failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        found = sorted(cache.glob(f"verifiers-{VERSION}.tar.gz"))
    assert found, f"no verifiers-{VERSION}.tar.gz in {cache}"
    return found[0]


def point_import_at_rlmq(source: str) -> str:
    """``source`` with ``RLMEnv`` taken out of its one import from the reference module and
    imported from ``rlmq.verifiers_legacy`` after that import; nothing else changes.

    Raises:
        AssertionError: the file does not import ``RLMEnv`` in the one way this expects.
    """
    start = source.index(REFERENCE_IMPORT_BLOCK)
    end = source.index(")\n", start) + 2
    block = source[start:end]
    assert block.count("    RLMEnv,\n") == 1, block
    return source[:start] + block.replace("    RLMEnv,\n", "", 1) + RLMQ_IMPORT + source[end:]


def write_test_file(archive: Path, into: Path) -> Path:
    """The reference's ``tests/test_rlm_env.py`` from ``archive``, import changed, as ``into/test_rlm_env.py``."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile(MEMBER)
        assert member is not None, f"{MEMBER} missing from {archive}"
        source = member.read().decode("utf-8")
    path = into / "test_rlm_env.py"
    path.write_text(point_import_at_rlmq(source), encoding="utf-8")
    return path


def ensure_pytest(legacy: Path, timeout: float = 600) -> None:
    """pytest and pytest-asyncio in the legacy venv (the reference's tests need both; a venv
    built before they were part of its build gets them now)."""
    probe = subprocess.run([str(legacy), "-c", "import pytest, pytest_asyncio"], capture_output=True, timeout=120)
    if probe.returncode != 0:
        argv = [str(legacy), "-m", "pip", "install", "-q", "--no-compile", "pytest", "pytest-asyncio"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"installing pytest failed:\n{proc.stderr[-2000:]}"


def outcomes(junit: Path) -> dict[str, str]:
    """Test id (``Class::test[param]``) -> ``pass`` / ``fail`` / ``error`` / ``skip``, from pytest's JUnit XML."""
    found: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = case.get("classname", "").rsplit(".", 1)[-1] + "::" + case.get("name", "")
        kinds = {child.tag for child in case}
        found[test] = (
            "error" if "error" in kinds else "fail" if "failure" in kinds else "skip" if "skipped" in kinds else "pass"
        )
    return found


def expected(text: str) -> dict[str, tuple[str, str]]:
    """The expectation list: test id -> (outcome, reason). A line is ``<outcome> <test id>``,
    ``-- <reason>`` after it for an outcome other than ``pass``; ``#`` starts a comment line;
    a reason may name a ``[tag]`` defined by a ``[tag]: text`` line.

    Raises:
        ValueError: a malformed line, an unknown outcome or tag, a non-pass without a reason,
            a test listed twice.
    """
    tags: dict[str, str] = {}
    rows: dict[str, tuple[str, str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        tag = re.fullmatch(r"\[([a-z-]+)\]:\s*(.+)", line)
        if tag:
            tags[tag.group(1)] = tag.group(2)
            continue
        head, _, reason = line.partition(" -- ")
        outcome, _, test = head.partition(" ")
        if outcome not in OUTCOMES or not test or test in rows or (outcome != "pass") != bool(reason):
            raise ValueError(f"bad line in {EXPECTED.name}: {raw!r}")
        rows[test.strip()] = (outcome, reason.strip())
    for test, (_, reason) in rows.items():
        for name in re.findall(r"\[([a-z-]+)\]", reason):
            if name not in tags:
                raise ValueError(f"{test}: unknown reason tag [{name}]")
    return rows
