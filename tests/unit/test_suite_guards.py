"""The suite cannot hang: tests do not depend on the signal dispositions it
inherited, and every test has a timeout that fails it and still runs its fixtures' cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


def ignoring_sigint() -> None:
    """A ``preexec_fn``: SIGINT ignored, as a script's ``cmd &``, ``nohup`` or a CI launcher leaves it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def pytest_in_child(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, preexec_fn=ignoring_sigint,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False,
    )  # fmt: skip


def test_the_ctrl_c_tests_pass_when_the_suite_starts_with_sigint_ignored() -> None:
    # It used to wait for a Ctrl-C that never came (13 min 51 s in the issue, forever in fact).
    t0 = time.monotonic()
    done = pytest_in_child("tests/unit/test_aio.py", cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert time.monotonic() - t0 < 120


def test_a_hanging_test_fails_at_its_timeout_and_its_fixtures_still_stop_its_children(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    (tmp_path / "test_hangs.py").write_text(
        textwrap.dedent(
            f"""
            import subprocess, sys, threading
            import pytest

            @pytest.fixture
            def child():
                proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
                open({str(pidfile)!r}, "w").write(str(proc.pid))
                yield proc
                proc.kill()
                proc.wait()

            def test_waits_forever(child):
                threading.Event().wait()  # a wait with no deadline, as a lost wake-up is
            """
        )
    )
    # The project's pytest settings (timeout_method), a short timeout for this one run.
    t0 = time.monotonic()
    done = pytest_in_child(
        "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "-o", "timeout=3", str(tmp_path),
        cwd=tmp_path, timeout=60,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert done.returncode == 1, done.stdout[-3000:]
    assert "Timeout" in done.stdout and "1 failed" in done.stdout, done.stdout[-3000:]
    assert took < 30
    pid = int(pidfile.read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
