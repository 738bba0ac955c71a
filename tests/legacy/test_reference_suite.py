"""The reference's own ``tests/test_rlm_env.py`` (verifiers 0.1.14) against ``rlmq.verifiers_legacy.RLMEnv``.

The file comes from the 0.1.14 sdist, downloaded by pip at test time (:mod:`tests.legacy.reference_suite`);
only its import of ``RLMEnv`` changes. It runs in the verifiers 0.1.14 venv with this session's
private Redis as ``REDIS_URL`` (what ``RLMEnv`` needs to be built; none of the reference's tests
runs a whole rollout, so no worker is started). Each test's outcome must be the one
``tests/legacy/reference_suite.txt`` lists: a test that starts failing fails this test, and so
does one listed as failing that now passes (the list is kept exact).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.legacy import reference_suite as suite
from tests.legacy.conftest import BUILD_TIMEOUT, VENV, legacy_env

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT + 900)  # the first test may build the venv

RUN_TIMEOUT = 600
"""Seconds the reference's file may take (about 30 s on two busy cores)."""


def test_import_rewrite_changes_only_the_import() -> None:
    source = (
        "import x\nfrom verifiers.envs.experimental.rlm_env import (\n    RLMCodeExecutionTimeout,\n"
        "    RLMEnv,\n    RLMSessionError,\n)\nfrom verifiers.types import UserMessage\n"
    )
    out = suite.point_import_at_rlmq(source)
    assert out == source.replace("    RLMEnv,\n", "").replace(")\n", ")\n" + suite.RLMQ_IMPORT, 1)
    with pytest.raises(AssertionError):
        suite.point_import_at_rlmq(source.replace("    RLMEnv,\n", ""))


def test_expectation_list_parses_and_refuses_a_failure_without_its_reason() -> None:
    rows = suite.expected(suite.EXPECTED.read_text())
    assert rows and all(outcome == "pass" or reason for outcome, reason in rows.values())
    with pytest.raises(ValueError):
        suite.expected("fail TestX::test_y\n")
    with pytest.raises(ValueError):
        suite.expected("fail TestX::test_y -- [nope]\n")


def test_reference_suite_outcomes_match_the_list(legacy: Path, redis_url: str, tmp_path: Path) -> None:
    suite.ensure_pytest(legacy)
    archive = suite.sdist(legacy, VENV / "reference-sdist")
    test_file = suite.write_test_file(archive, tmp_path)
    junit = tmp_path / "junit.xml"
    argv = [str(legacy), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "asyncio_mode=auto"]
    argv += ["--rootdir", str(tmp_path), f"--junitxml={junit}", "-W", "ignore", str(test_file)]
    env = legacy_env({"REDIS_URL": redis_url})
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    report = f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert junit.is_file(), f"pytest wrote no report ({report})"
    seen = suite.outcomes(junit)
    listed = suite.expected(suite.EXPECTED.read_text())
    assert len(seen) == 161, f"the reference's file has 161 tests; ran {len(seen)}"
    unlisted = sorted(set(seen) - set(listed))
    gone = sorted(set(listed) - set(seen))
    changed = {t: f"{listed[t][0]} -> {o}" for t, o in seen.items() if t in listed and listed[t][0] != o}
    passed = sum(1 for o in seen.values() if o == "pass")
    print(f"\nreference suite: {passed} of {len(seen)} pass")
    assert not (unlisted or gone or changed), (
        f"outcomes differ from {suite.EXPECTED.name}:\nnot listed: {unlisted}\nlisted, not run: {gone}\n"
        f"changed: {changed}\n{proc.stdout[-6000:]}"
    )
