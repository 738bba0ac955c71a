"""The ``rlm`` harness's keys on the ``rlmq`` harness: each maps onto an rlmq setting with its
meaning, or says in one line that it has none (needs the verifiers extra, part of ``rlmq[test]``)."""

from __future__ import annotations

import logging

import pytest
import verifiers.v1 as vf

from rlmq.verifiers_plugin.adapter import rollout_env
from rlmq.verifiers_plugin.harness import RlmqHarnessConfig
from rlmq.verifiers_plugin.rlm_keys import IGNORED, MAPPED

RLM_HARNESS_MODULE = "verifiers.v1.harnesses.rlm.harness"


def settings_of(config: RlmqHarnessConfig, system: str | None = None) -> dict[str, object]:
    env = rollout_env(config.knobs(system), model="m", base_url="http://root:1/v1", api_key="k")
    return env.settings.model_dump()


@pytest.fixture(autouse=True)
def _redis(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://fleet:1/0")
    for name in ("RLMQ_MAX_DEPTH", "RLMQ_SUB_LLM_MAX_COMPLETION_TOKENS", "RLMQ_MAX_TURNS"):
        monkeypatch.delenv(name, raising=False)


def test_every_key_of_the_rlm_harness_is_mapped_or_explained() -> None:
    """Read from verifiers' own ``RLMHarnessConfig``: a key it gains later fails this test."""
    from verifiers.v1.harnesses.rlm.harness import RLMHarnessConfig

    own = set(RLMHarnessConfig.model_fields) - set(vf.HarnessConfig.model_fields)
    assert own == set(MAPPED) | set(IGNORED), own ^ (set(MAPPED) | set(IGNORED))
    assert set(own) <= set(RlmqHarnessConfig.model_fields)


def test_the_rlm_keys_set_rlmq_settings_with_their_meanings() -> None:
    config = RlmqHarnessConfig(
        max_depth=2, max_total_tokens=5000, max_total_turns=7, max_concurrent_subagents=3, exec_timeout=30,
        max_tool_output_bytes=4000, append_to_system_prompt="Answer tersely.",
    )  # fmt: skip
    s = settings_of(config, system="The taskset's own prompt.")
    assert s["max_depth"] == 3  # two levels of children below the root: rlmq counts the root as level 1
    assert s["sub_llm_max_completion_tokens"] == 5000
    assert s["max_turns"] == 7 and s["max_sub_llm_parallelism"] == 3
    assert s["code_execution_timeout"] == 30.0 and s["max_output_length"] == 4000
    assert s["system_prompt"] == "The taskset's own prompt.\n\nAnswer tersely." and s["system_prompt_mode"] == "append"


def test_max_depth_zero_is_no_children_and_unset_keeps_rlmqs_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings_of(RlmqHarnessConfig(max_depth=0))["max_depth"] == 1
    monkeypatch.setenv("RLMQ_MAX_DEPTH", "3")
    assert settings_of(RlmqHarnessConfig())["max_depth"] == 3  # the variable keeps rlmq's meaning
    assert settings_of(RlmqHarnessConfig(max_depth=1))["max_depth"] == 2
    with pytest.raises(ValueError):
        RlmqHarnessConfig(max_depth=8)  # rlmq's deepest tree is 8 levels, the root included


def test_max_total_tokens_zero_removes_the_budget_and_both_names_are_refused() -> None:
    assert settings_of(RlmqHarnessConfig(max_total_tokens=0))["sub_llm_max_completion_tokens"] is None
    with pytest.raises(ValueError, match="not both"):
        RlmqHarnessConfig(max_total_tokens=10, sub_llm_max_completion_tokens=20)
    with pytest.raises(ValueError, match="not both"):
        RlmqHarnessConfig(max_total_turns=10, max_turns=20)


def test_a_key_without_counterpart_gets_one_line(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlmq.verifiers_plugin import rlm_keys

    monkeypatch.setattr(rlm_keys, "_LOGGED", set())
    caplog.set_level(logging.WARNING, logger="rlmq.verifiers")
    RlmqHarnessConfig(allow_git=True, compaction={"max_compactions": 2}, version="main")
    RlmqHarnessConfig(allow_git=True)  # the same line is not repeated
    lines = [r.getMessage() for r in caplog.records if "has no effect here" in r.getMessage()]
    assert sorted(line.split("'")[1] for line in lines) == ["allow_git", "compaction", "version"], lines
    assert all("\n" not in line for line in lines)
