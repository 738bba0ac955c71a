"""RLMEnv's configuration: one Settings, arguments that override it, validated once (no Redis needed)."""

from __future__ import annotations

import inspect
import os

import pytest
from pydantic import ValidationError

from rlmq.common.errors import ConfigError
from rlmq.common.settings import RolloutOptions, Settings
from rlmq.producer.env import FROM_SETTINGS, RLMEnv


def test_settings_reach_the_environment_unless_an_argument_overrides_them() -> None:
    s = Settings(
        max_turns=3, sub_llm_max_turns=2, max_output_length=500, code_execution_timeout=7,
        root_prompt_verbosity="heavy", sub_llm_max_completion_tokens=100,
    )  # fmt: skip
    env = RLMEnv(settings=s)
    got = env.settings
    assert (got.max_turns, got.sub_llm_max_turns, got.max_output_length, got.code_execution_timeout) == (3, 2, 500, 7)
    assert got.root_prompt_verbosity == "heavy" and got.sub_llm_max_completion_tokens == 100
    env = RLMEnv(settings=s, max_turns=9, sub_tools=["rlmq.workers.tools.grep"], include_sub_llm_in_trajectory=True)
    assert env.settings.max_turns == 9 and env.settings.sub_llm_max_turns == 2
    assert env.settings.sub_tools == ["rlmq.workers.tools.grep"] and env.settings.include_sub_llm_in_trajectory
    assert s.max_turns == 3 and s.sub_tools == []  # the caller's settings are not changed


def test_an_explicit_none_switches_the_budget_off() -> None:
    s = Settings(sub_llm_max_completion_tokens=100)
    assert RLMEnv(settings=s).settings.sub_llm_max_completion_tokens == 100
    assert RLMEnv(settings=s, sub_llm_max_completion_tokens=None).settings.sub_llm_max_completion_tokens is None


def test_the_defaults_are_the_references(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("RLMQ_"):
            monkeypatch.delenv(name)
    s = RLMEnv().settings
    assert (s.max_turns, s.sub_llm_max_turns, s.max_output_length, s.code_execution_timeout) == (50, 5, 8192, 120)
    assert (s.root_prompt_verbosity, s.sub_prompt_verbosity, s.sub_llm_max_completion_tokens) == (
        "light",
        "light",
        None,
    )
    # the environment's RLMQ_* variables are the same one path
    monkeypatch.setenv("RLMQ_MAX_TURNS", "4")
    assert RLMEnv().settings.max_turns == 4


def test_every_setting_argument_is_a_settings_field() -> None:
    params = inspect.signature(RLMEnv.__init__).parameters
    overridable = [n for n, p in params.items() if p.default is FROM_SETTINGS]
    # tools and root_tools take callables too (default None: settings); tests/unit/test_settings_paths.py: types
    assert set(overridable) | {"tools", "root_tools"} == set(RolloutOptions.model_fields)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_turn": 3},  # a typo
        {"context_warning_threshold": 0},
        {"context_warning_threshold": 1.5},
        {"root_context_tokens": 0},
        {"sub_llm_max_turns": 0},
        {"max_output_length": 10},
        {"code_execution_timeout": -1},
        {"root_prompt_verbosity": "loud"},
        {"sub_llm_max_completion_tokens": -5},
        {"max_sub_llm_parallelism": 0},
    ],
)
def test_unknown_or_invalid_arguments_are_config_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        RLMEnv(**kwargs)  # type: ignore[arg-type]


def test_the_environment_is_read_as_load_settings_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("RLMQ_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:7/0")
    assert RLMEnv().settings.redis_url == "redis://127.0.0.1:7/0"
    monkeypatch.setenv("RLMQ_SUB_TOOLS", "not json")  # a list setting from the environment is JSON
    with pytest.raises(ConfigError):
        RLMEnv()
    with pytest.raises(ConfigError):
        RLMEnv(settings={"max_turns": 3})  # type: ignore[arg-type]


def test_settings_cannot_change_under_a_running_environment() -> None:
    env = RLMEnv(settings=Settings(max_turns=3))
    with pytest.raises(ValidationError):
        env.settings.max_turns = 0  # type: ignore[misc]
    assert env.settings.max_turns == 3
