"""Sampling arguments (``--sampling-args``, ``--sub-sampling-args``): what they may set, and what a
job may not claim with them (a worker validates every job with the same model)."""

from __future__ import annotations

from typing import Any

import pytest

from rlmq.common.errors import ConfigError, PayloadError
from rlmq.common.schemas import load_request, normalize_sampling
from rlmq.common.settings import load_settings


def job(**sampling: Any) -> dict[str, Any]:
    return {"model": "m", "rollout_id": "r1", "batch_id": "b1", "index": 0, "prompt": "p",
            "enqueued_at": 0.0, "deadline": 1e10, "budgeted": True, "max_completion_tokens": 64,
            "sampling": sampling}  # fmt: skip


def test_extra_body_is_merged_and_max_completion_tokens_is_max_tokens_for_the_root() -> None:
    out = normalize_sampling({"temperature": 0.5, "max_completion_tokens": 10, "extra_body": {"top_k": 3}}, sub=False)
    assert out == {"top_k": 3, "temperature": 0.5, "max_tokens": 10}
    assert normalize_sampling('{"top_p": 0.9}', sub=True) == {"top_p": 0.9}


@pytest.mark.parametrize(
    "claim",
    [
        {"max_tokens": 1_000_000},  # past its grant: the budget would not hold
        {"max_completion_tokens": 1_000_000},
        {"extra_body": {"max_tokens": 1_000_000}},
        {"n": 8},  # eight completions charged as one grant
        {"best_of": 8},
        {"n_predict": 100_000},  # llama.cpp takes it over max_tokens: past the grant
        {"extra_body": {"max_new_tokens": 100_000}},
        {"model": "someone-elses-model"},
        {"stream": True},
        {"user": "another-rollout"},
    ],
)
def test_a_job_cannot_claim_what_rlmq_sets(claim: dict[str, Any]) -> None:
    with pytest.raises(PayloadError):
        load_request(job(**claim))


def test_a_job_with_plain_sampling_arguments_is_valid() -> None:
    assert load_request(job(temperature=0.2, top_p=0.5)).sampling == {"temperature": 0.2, "top_p": 0.5}


@pytest.mark.parametrize(
    ("field", "value", "expect"),
    [
        ("sub_sampling_args", {"max_tokens": 0}, "max_tokens must be a whole number"),
        ("sub_sampling_args", {"user": "x"}, "may not set user"),
        ("sampling_args", {"n": 2}, "may not set n"),
        ("sampling_args", {"max_tokens": 0}, "max_tokens must be a whole number"),
        ("sampling_args", "[1, 2]", "must be a JSON object"),
        ("sampling_args", "{not json", "must be a JSON object"),
    ],
)
def test_settings_refuse_bad_sampling_arguments(field: str, value: Any, expect: str) -> None:
    with pytest.raises(ConfigError, match=expect):
        load_settings(**{field: value})


def test_sampling_arguments_come_from_the_environment_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLMQ_SUB_SAMPLING_ARGS", '{"temperature": 0.1}')
    assert load_settings().sub_sampling_args == {"temperature": 0.1}


@pytest.mark.parametrize(
    ("field", "text"),
    [
        ("sampling_args", '{"temperature": NaN}'),  # every root call failed: the request body is not JSON
        ("sub_sampling_args", '{"temperature": Infinity}'),  # the job's wire format turned it into null
        ("sub_sampling_args", '{"extra_body": {"top_k": -Infinity}}'),
    ],
)
def test_sampling_arguments_that_are_not_finite_numbers_are_refused(
    field: str, text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match=f"{field}: .*finite"):
        load_settings(**{field: text})
    monkeypatch.setenv(f"RLMQ_{field.upper()}", text)
    with pytest.raises(ConfigError, match=f"RLMQ_{field.upper()}: .*finite"):
        load_settings()


DEEP = '{"a": ' + "[" * 50_000 + "]" * 50_000 + "}"
"""JSON nested past Python's recursion limit (it was an internal error, exit 4)."""


def test_sampling_arguments_nested_too_deeply_are_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="sub_sampling_args: .*nested too deeply"):
        load_settings(sub_sampling_args=DEEP)
    monkeypatch.setenv("RLMQ_SAMPLING_ARGS", DEEP)
    with pytest.raises(ConfigError, match="RLMQ_SAMPLING_ARGS: .*nested too deeply"):
        load_settings()


@pytest.mark.parametrize("flag", ["-S", "--sub-sampling-args"])
def test_a_flag_of_sampling_arguments_nested_too_deeply_is_one_line_exit_2(
    flag: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlmq.cli.main import main

    ds = tmp_path / "ds.jsonl"
    ds.write_text('{"id": "a", "question": "?", "context": "c"}\n')
    assert main(["run", str(ds), "--model", "m", "--base-url", "http://127.0.0.1:9/v1", flag, DEEP]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "nested too deeply" in err[0] and "sampling-args" in err[0], err


def test_sub_calls_sample_as_their_rollout_unless_sub_sampling_arguments_say_otherwise() -> None:
    from rlmq.common.sampling import (
        DEFAULT_CALL_MAX_TOKENS,
        child_root_sampling,
        sub_call_max_tokens,
        sub_call_sampling,
    )
    from rlmq.common.settings import RolloutOptions

    root = {"temperature": 0.3, "max_tokens": 1000, "user": "u", "extra_body": {"top_k": 5}}
    o = RolloutOptions(sampling_args=root)
    assert sub_call_sampling(o) == {"temperature": 0.3, "top_k": 5}  # no user, max_tokens is the cap
    assert sub_call_max_tokens(o) == 1000
    o = RolloutOptions(sampling_args=root, sub_sampling_args={"temperature": 0.9, "max_completion_tokens": 700})
    assert (sub_call_sampling(o), sub_call_max_tokens(o)) == ({"temperature": 0.9, "top_k": 5}, 700)
    o = RolloutOptions(sampling_args=root, sub_sampling_args={"max_tokens": 700}, sub_llm_per_call_max_tokens=300)
    assert sub_call_max_tokens(o) == 300
    assert child_root_sampling(o) == {"temperature": 0.3, "top_k": 5, "max_tokens": 700}  # a root turn, not a sub-call
    assert child_root_sampling(RolloutOptions(sub_llm_per_call_max_tokens=16))["max_tokens"] == DEFAULT_CALL_MAX_TOKENS
    assert sub_call_max_tokens(RolloutOptions()) == DEFAULT_CALL_MAX_TOKENS  # never sent uncapped
