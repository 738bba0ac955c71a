"""A budget of 0 is refused at configuration, with a clear message, on every path."""

from __future__ import annotations

import pytest

from rlmq.common.errors import ConfigError
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv


def test_zero_budget_flag_is_a_clear_config_error() -> None:
    with pytest.raises(ConfigError, match="a budget of 0 would refuse every sub-LLM call"):
        load_settings(sub_llm_max_completion_tokens=0)


def test_zero_budget_from_the_environment_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLMQ_SUB_LLM_MAX_COMPLETION_TOKENS", "0")
    with pytest.raises(ConfigError, match="leave it unset for no budget"):
        load_settings()


def test_zero_budget_argument_of_rlmenv_is_refused() -> None:
    with pytest.raises(ConfigError, match="budget of 0"):
        RLMEnv(sub_llm_max_completion_tokens=0)


def test_budget_defaults() -> None:
    s = load_settings(sub_llm_max_completion_tokens=1)
    assert (s.sub_llm_max_completion_tokens, s.sub_llm_per_call_max_tokens, s.sub_llm_budget_max_parked) == (
        1,
        None,
        None,
    )
    with pytest.raises(ConfigError):
        load_settings(sub_llm_max_completion_tokens=-5)
