""".ci/run fails on a lint or type error, and still runs the tests and the 6379 check after one.

The script runs for real, in a copy, with every program it calls replaced by a stub on ``PATH``
that logs its arguments: ``make lint types`` is made to fail, and the run must exit non-zero
after running pytest and the Redis check all the same.
"""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

STUB = """#!/bin/sh
echo "$(basename "$0") $*" >> "$CI_LOG"
case "$(basename "$0") $*" in
  "make -s lint types") exit "$LINT_STATUS" ;;
esac
exit 0
"""


def stub(path: Path) -> None:
    path.write_text(STUB, encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def run_ci(tmp_path: Path, lint_status: int) -> tuple[int, list[str]]:
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("chromium", "faketime", "python3", "make", "apt-get"):
        stub(bin_dir / name)
    (repo / ".venv" / "bin").mkdir(parents=True)
    for name in ("python", "pip"):
        stub(repo / ".venv" / "bin" / name)
    log = tmp_path / "log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CI_LOG": str(log), "LINT_STATUS": str(lint_status)}
    done = subprocess.run(["bash", str(repo / ".ci" / "run")], env=env, capture_output=True, timeout=60, check=False)
    return done.returncode, log.read_text(encoding="utf-8").splitlines()


def test_a_lint_or_type_error_fails_the_run_and_the_tests_still_run(tmp_path: Path) -> None:
    status, calls = run_ci(tmp_path, lint_status=2)
    assert status != 0
    assert "pip install -q -e .[dev]" in calls, calls
    assert "make -s lint types" in calls, calls
    pytest_calls = [c for c in calls if c.startswith("python -m pytest")]
    assert pytest_calls == ["python -m pytest -q -n 4 --dist loadfile"], calls
    assert calls.index("make -s lint types") < calls.index(pytest_calls[0]), "the test summary closes the run"
    assert any(c.startswith("python .ci/redis6379.py check") for c in calls), calls


def test_a_clean_run_passes(tmp_path: Path) -> None:
    status, calls = run_ci(tmp_path, lint_status=0)
    assert status == 0, calls


def test_the_lint_and_type_tools_are_pinned() -> None:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    dev = next(line for line in text.splitlines() if line.startswith("dev = "))
    assert '"mypy==' in dev and '"ruff==' in dev, dev
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    for command in ("ruff check", "ruff format --check", "mypy"):
        assert f"$(PY) -m {command}" in makefile, command
