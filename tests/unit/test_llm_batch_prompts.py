"""``llm_batch`` with a prompt that is not a str answers that prompt with an error and runs the
others (verifiers 0.1.14's ``llm_batch``: "must be a string"), instead of failing the batch."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rlmq.producer.repl_child import endpoint


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The prompts each POST carried; the service answers each prompt upper-cased."""
    bodies: list[list[str]] = []

    def post(opener: Any, url: str, body: bytes, *args: Any, **kwargs: Any) -> bytes:
        prompts = json.loads(body)["prompts"]
        bodies.append(prompts)
        return json.dumps({"results": [p.upper() for p in prompts]}).encode()

    monkeypatch.setattr(endpoint, "_post", post)
    return bodies


def _llm_batch() -> Any:
    return endpoint.make_llm_batch("http://x.invalid/llm_batch", "t", 5.0, None, 1 << 20, 100)


def test_a_non_string_prompt_is_answered_with_an_error_and_the_rest_run(sent: list[list[str]]) -> None:
    answers = _llm_batch()(["a", {"role": "user", "content": "hi"}, "b", ["x"]])
    assert answers[0] == "A" and answers[2] == "B"
    assert "index 1 must be a string" in answers[1] and "index 3 must be a string" in answers[3]
    assert sent == [["a", "b"]]


def test_only_non_string_prompts_send_nothing(sent: list[list[str]]) -> None:
    answers = _llm_batch()([{"role": "user", "content": "hi"}])
    assert len(answers) == 1 and "must be a string" in answers[0] and sent == []


def test_a_batch_that_is_not_a_list_still_raises(sent: list[list[str]]) -> None:
    with pytest.raises(TypeError):
        _llm_batch()("a")
