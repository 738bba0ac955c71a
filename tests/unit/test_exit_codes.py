"""The exit code of a finished run (``rlmq.cli.results.exit_code``) and the worker's rate-limited
line about a failing model server (``rlmq.workers.model.FailureLog``)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from rlmq.cli.exits import EXIT_OK, EXIT_ROLLOUT_ERRORS, EXIT_SUB_CALLS_FAILED, EXIT_UNAVAILABLE, explain
from rlmq.cli.results import exit_code
from rlmq.common.errors import ModelError, PreflightError
from rlmq.workers.model import FailureLog


def row(calls: int, errors: int, rejected: int = 0, error: str | None = None) -> dict[str, Any]:
    metrics = {"sub_llm_call_count": calls, "sub_llm_error_count": errors, "sub_llm_rejected_count": rejected}
    return {"id": "r", "error": error, "metrics": metrics}


@pytest.mark.parametrize(
    ("rows", "rate", "code"),
    [
        ([row(10, 0)], 0.1, EXIT_OK),
        ([row(10, 1)], 0.1, EXIT_OK),  # at the threshold: not above it
        ([row(10, 2)], 0.1, EXIT_SUB_CALLS_FAILED),
        ([row(5, 5), row(5, 5)], 0.1, EXIT_SUB_CALLS_FAILED),  # all failed
        ([row(5, 5)], 1.0, EXIT_OK),  # a rate of 1 never fails on sub-calls
        ([row(10, 0, rejected=10)], 0.0, EXIT_OK),  # a spent budget is not a failure
        ([row(0, 0)], 0.0, EXIT_OK),  # no sub-call at all
        ([row(10, 10), row(1, 0, error="ModelError: boom")], 0.1, EXIT_ROLLOUT_ERRORS),  # rollout errors first
    ],
)
def test_exit_code(rows: list[dict[str, Any]], rate: float, code: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_code(rows, rate) == code
    err = capsys.readouterr().err
    assert (f"exit code {code}" in err) if code else err == ""


def test_all_failed_says_all(capsys: pytest.CaptureFixture[str]) -> None:
    exit_code([row(4, 4)], 0.1)
    assert "rlmq: all sub-LLM calls ended in error" in capsys.readouterr().err


def test_a_preflight_failure_is_exit_5_with_its_own_line() -> None:
    assert explain(PreflightError("the root model server at http://x/v1 does not answer")) == (
        EXIT_UNAVAILABLE,
        "the root model server at http://x/v1 does not answer",
    )


def test_failure_log_says_it_at_once_then_at_most_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    flog = FailureLog("http://u:secret@gpu:8000/v1", interval=30.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="rlmq.model"):
        flog.failure(ModelError("connection refused"))
        for _ in range(70):
            now[0] += 0.5
            flog.failure(ModelError("connection refused"))
            flog.ok()
        lines = [r.getMessage() for r in caplog.records]
    # t=100 (the first), t=130 (30 s later); nothing in between
    assert len(lines) == 2, lines
    assert "is failing: 1 sub-LLM model call(s) failed, 0 answered" in lines[0]
    assert "secret" not in lines[0] and "gpu:8000" in lines[0]
    assert "is failing: 60 sub-LLM model call(s) failed in the last 30 s, 59 answered" in lines[1], lines[1]
