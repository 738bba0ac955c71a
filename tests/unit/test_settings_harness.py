"""Every rollout setting through the verifiers harness knobs (``--env.agent.harness.*``): the
path of ``tests/unit/test_settings_paths.py`` that needs the verifiers extra (``rlmq[verifiers]``,
part of the test extra), kept apart so that the declaration's own tests run without it.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from rlmq.common.settings import RolloutOptions, Settings
from rlmq.common.settings.schema import Knob, knobs
from rlmq.verifiers_plugin.adapter import rollout_env
from rlmq.verifiers_plugin.harness import RlmqHarnessConfig
from tests.unit.test_settings_paths import clean_environment, env_text, reached, sample

__all__ = ["clean_environment"]  # the autouse fixture: no RLMQ_* of the machine leaks into a case

HARNESS_CASES = [
    pytest.param(k, id=k.name)
    for k in knobs()
    if (k.owner == "rollout" and k.name != "max_depth") or k.name in ("queue", "tenant")
]
"""Every rollout knob but `max_depth`, which has the meaning of the rlm harness there (its own test:
`tests/unit/test_rlm_harness_keys.py`)."""


@pytest.mark.parametrize("k", HARNESS_CASES)
def test_every_harness_knob_reaches_the_rollout_and_beats_the_variable_which_beats_the_default(
    k: Knob, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 21, reproduction 1: the harness passed every knob explicitly, ``None`` included,
    so an ``RLMQ_*`` variable never counted under vf-eval."""

    def harness_settings(**given: Any) -> Settings:
        knobs = RlmqHarnessConfig(**given).knobs()
        env = rollout_env(knobs, model="root", base_url="http://root:1/v1", api_key="sk")
        return env.settings

    monkeypatch.setenv("REDIS_URL", "redis://fleet:1/0")
    one, two = sample(k, 1), sample(k, 2)
    assert reached(k, harness_settings(**{k.name: one})) == one
    monkeypatch.setenv(k.env[0], env_text(two))
    assert reached(k, harness_settings(**{k.name: one})) == one  # knob > variable
    assert reached(k, harness_settings()) == two  # variable > default
    monkeypatch.delenv(k.env[0])
    assert reached(k, harness_settings()) == k.default


def test_the_harness_redis_url_knob_beats_the_variables() -> None:
    os.environ["REDIS_URL"] = "redis://from-env:1/0"
    try:
        knobs = RlmqHarnessConfig(redis_url="redis://knob:1/0").knobs()
        assert rollout_env(knobs, model="m", base_url="http://r:1/v1", api_key="k").settings.redis_url == (
            "redis://knob:1/0"
        )
        knobs = RlmqHarnessConfig().knobs()
        assert rollout_env(knobs, model="m", base_url="http://r:1/v1", api_key="k").settings.redis_url == (
            "redis://from-env:1/0"
        )
    finally:
        del os.environ["REDIS_URL"]


def test_no_rollout_option_shadows_a_verifiers_field() -> None:
    vf_fields = set(RlmqHarnessConfig.model_fields) - set(RolloutOptions.model_fields)
    assert not (vf_fields & set(RolloutOptions.model_fields)), "a rollout option shadows a verifiers field"


def test_a_bad_harness_knob_is_named_as_vf_eval_writes_it() -> None:
    with pytest.raises(ValueError, match=r"--env\.agent\.harness\.sub-llm-max-completion-tokens: must be >= 1"):
        RlmqHarnessConfig(sub_llm_max_completion_tokens=0)
