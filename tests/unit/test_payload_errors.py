"""An invalid job's payload is not copied into its error message (nor its result, nor the log),
and a job's data that inflates past MAX_JOB_DATA is refused before it is inflated whole."""

from __future__ import annotations

import zlib

import pytest

from rlmq.common.errors import PayloadError
from rlmq.common.jobs.record import MAX_JOB_DATA, decode_job_data
from rlmq.common.schemas import load_lane_entry, load_request


def test_invalid_request_error_does_not_echo_the_prompt() -> None:
    prompt = "x" * 1_000_000
    with pytest.raises(PayloadError) as info:
        load_request({"prompt": prompt})  # every other field missing
    message = str(info.value)
    assert "invalid sub-LLM request" in message
    assert "model" in message  # still says what is wrong
    assert len(message) < 2_000


def test_invalid_lane_entry_error_does_not_echo_the_entry() -> None:
    with pytest.raises(PayloadError) as info:
        load_lane_entry('{"v": 1, "queue": "q", "enqueued_at": 0, "jobs": [], "x": "' + "y" * 1_000_000 + '"}')
    assert len(str(info.value)) < 2_000


def test_a_compression_bomb_in_a_job_is_refused_without_inflating_it() -> None:
    bomb = zlib.compress(b"[" + b" " * (MAX_JOB_DATA + 10), 9)
    assert len(bomb) < 1_000_000
    with pytest.raises(ValueError, match="decompresses to more than"):
        decode_job_data(bomb)
    ok = zlib.compress(b'["f", null, [1], {}]')
    assert decode_job_data(ok) == ("f", [1], {})


def test_the_error_tree_drawn_in_the_docstring_is_the_classes_tree() -> None:
    """``common/errors.py`` draws its exception tree; every class is in it, where it is."""
    import re

    from rlmq.common import errors

    doc = errors.__doc__ or ""
    lines = [line[4:] for line in doc.splitlines() if line.startswith("    ") and line.strip()]
    drawn = [m.group(0) for m in (re.match(r"[│├└─ ]*\w+", line) for line in lines) if m]  # minus the comment
    assert drawn == errors.tree().splitlines()
