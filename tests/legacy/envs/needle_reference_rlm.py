"""A needle-in-a-haystack environment written the way verifiers 0.1.14's ``-rlm`` environments are.

It is the test's stand-in for an author's module: ``load_environment()`` builds the reference's
``RLMEnv(dataset=..., rubric=..., repl_language=..., sandbox_*=..., **kwargs)`` with the
haystack in ``info["context"]`` and a rubric that reads ``state["final_answer"]``. The one line
that differs from a module for the reference is the ``RLMEnv`` import (marked below); the tests
check that it is the only one (``test_the_module_differs_from_a_reference_module_by_its_import``).
"""

from __future__ import annotations

import json
from typing import Any

import verifiers as vf
from datasets import Dataset

from rlmq.verifiers_legacy import RLMEnv  # the reference: from verifiers.envs.experimental.rlm_env import RLMEnv


def _rows(rows_path: str, num_examples: int, no_context: bool = False) -> Dataset:
    with open(rows_path, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    if num_examples > 0:
        rows = rows[:num_examples]
    return Dataset.from_list(
        [
            {
                "question": row["question"],
                "answer": row["answer"],
                "info": {"row_id": row["id"]} if no_context else {"context": row["context"], "row_id": row["id"]},
            }
            for row in rows
        ]
    )


async def exact_passphrase(state: vf.State, answer: str, **_: Any) -> float:
    """1.0 when the final answer is the passphrase (case and outer whitespace aside)."""
    final = (state.get("final_answer") or "").strip().strip(".").lower()
    return 1.0 if final == answer.strip().lower() else 0.0


async def answered(state: vf.State, **_: Any) -> float:
    """1.0 when the rollout set a final answer at all."""
    return 1.0 if (state.get("final_answer") or "").strip() else 0.0


class HookedRLMEnv(RLMEnv):
    """A subclass as public environments write them: it overrides hooks and calls ``super()``;
    each call is counted in ``state["hook_calls"]``."""

    async def setup_state(self, state: vf.State, **kwargs: Any) -> None:
        await super().setup_state(state, **kwargs)
        calls = state.setdefault("hook_calls", {"setup_state": 0, "add_model_response": 0})
        calls["setup_state"] += 1

    async def add_model_response(self, state: vf.State, prompt_messages: Any, response: Any) -> None:
        await super().add_model_response(state, prompt_messages, response)
        state["hook_calls"]["add_model_response"] += 1


def load_environment(
    rows_path: str,
    num_examples: int = -1,
    repl_language: str = "python",
    max_turns: int = 10,
    sub_max_completion_tokens: int | None = None,
    code_execution_timeout: int = 120,
    subclass: bool = False,
    closure_sub_tool: bool = False,
    no_context: bool = False,
    **kwargs: Any,
) -> vf.Environment:
    dataset = _rows(rows_path, num_examples, no_context)
    rubric = vf.Rubric(funcs=[exact_passphrase, answered], weights=[1.0, 0.0])
    cls = HookedRLMEnv if subclass else RLMEnv
    if closure_sub_tool:
        offset = len(dataset)  # a value of this call: the tool is a closure, as authors write them

        def add(x: int, y: int) -> int:
            """Add two numbers (and the rows' count, minus itself)."""
            return x + y + offset - len(dataset)

        kwargs["sub_tools"] = [add]
    return cls(
        dataset=dataset,
        rubric=rubric,
        repl_language=repl_language,
        max_turns=max_turns,
        sub_llm_max_turns=3,
        sub_max_completion_tokens=sub_max_completion_tokens,
        max_sub_llm_parallelism=8,
        code_execution_timeout=code_execution_timeout,
        sandbox_docker_image="python:3.11-slim",
        sandbox_cpu_cores=1,
        sandbox_memory_gb=2,
        sandbox_timeout_minutes=30,
        **kwargs,
    )
