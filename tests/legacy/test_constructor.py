"""``rlmq.verifiers_legacy.RLMEnv`` takes the reference's constructor: checked against the
reference class itself, in the verifiers 0.1.14 venv (``tests/legacy/constructor_facts.py``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.legacy.conftest import BUILD_TIMEOUT, ROOT, legacy_env

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT + 300)  # the first test may build the venv

OF_966 = {"sub_llm_max_completion_tokens": "None", "expose_message_history": "True"}
"""#966's arguments that 0.1.14 renamed or dropped, with their defaults here (``expose_message_history``:
``True``, since 0.1.14 always wrote ``.messages``; #966's default was ``False``)."""


@pytest.fixture(scope="module")
def facts(legacy: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [str(legacy), str(ROOT / "tests" / "legacy" / "constructor_facts.py")],
        env=legacy_env({"REDIS_URL": "redis://127.0.0.1:1/0", "PYTHONPATH": str(ROOT)}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_every_reference_argument_is_taken_with_its_default(facts: dict[str, Any]) -> None:
    reference, ours = facts["reference"], facts["ours"]
    assert len(reference) >= 37, reference  # the 0.1.14 signature, read from the class itself
    missing = {k: v for k, v in reference.items() if ours.get(k) != v}
    assert not missing, f"reference arguments missing or with another default: {missing}"
    assert {k: ours.get(k) for k in OF_966} == OF_966


def test_arguments_map_onto_rlmq_settings_and_base_arguments_pass_through(facts: dict[str, Any]) -> None:
    """``max_turns_in_context`` caps the turns (no summarization), ``max_seq_len`` is the root's
    context window for the warning and stays the base environment's, the sub-call timeout is
    ``code_execution_timeout - 5`` as in the reference, the sandbox's lifetime is the rollout's
    deadline, the packages string is split, the 0.1.14 budget name sets the hard budget."""
    assert facts["mapped"] == {
        "max_turns": 12, "sub_llm_max_completion_tokens": 500, "root_context_tokens": 32_000,
        "sub_call_timeout": 55.0, "rollout_timeout": 300.0, "pip_install_packages": ["numpy", "pandas"],
        "max_seq_len": 32_000, "env_id": "needle", "eval_rows": 1, "max_sub_llm_parallelism": 5,
        "sub_tools": ["json:dumps"],
    }  # fmt: skip


def test_max_turns_in_context_caps_the_turns_even_without_a_turn_limit(facts: dict[str, Any]) -> None:
    """(max_turns, max_turns_in_context): (0, 5) -> 5, (30, 12) -> 12, (10, 40) -> 10, (50, None) -> 50."""
    assert facts["turn_caps"] == [5, 12, 10, 50]


def test_values_rlmq_cannot_honour_are_refused_in_one_line(facts: dict[str, Any]) -> None:
    refused = facts["refused"]
    assert refused["same_budgets"] == "accepted"
    assert refused["both_budgets"].startswith("ArgumentError: RLMEnv: sub_max_completion_tokens=5 and")
    assert refused["no_sub_llms"] == "accepted", refused["no_sub_llms"]
    assert refused["summarization"] == "accepted", refused["summarization"]
    assert "RLMEnv argument max_sub_llm_parallelism" in refused["bad_parallelism"]
    assert refused["lambda_sub_tool"].startswith("ArgumentError: RLMEnv(sub_tools=[<function")  # no name to call
    assert refused["no_redis"].startswith("ConfigError: RLMEnv: no Redis for the sub-LLM fleet: set REDIS_URL")
    assert refused["bash"] == "accepted", refused["bash"]  # rlmq has the bash REPL and .messages
    assert refused["message_history"] == "accepted", refused["message_history"]
