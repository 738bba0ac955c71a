"""An invalid job's payload is not copied into its error message (nor its result, nor the log)."""

from __future__ import annotations

import pytest

from rlmq.common.errors import PayloadError
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
