"""Facts about the constructors, printed as JSON; run with the verifiers 0.1.14 venv's Python.

``{"reference": {name: default}, "ours": {name: default}, "refused": {case: message},
"mapped": {...}}``: the reference ``RLMEnv``'s parameters (verifiers 0.1.14, the release this
venv holds) and ``rlmq.verifiers_legacy.RLMEnv``'s, with their defaults as ``repr``; what a
refused value raises; and the rlmq settings a few arguments become. ``REDIS_URL`` need not
answer: nothing connects.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Any

from datasets import Dataset
from verifiers.envs.experimental.rlm_env import RLMEnv as Reference

from rlmq.verifiers_legacy import RLMEnv


def _params(cls: type) -> dict[str, str]:
    return {
        name: repr(p.default)
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    }


def _refusal(**kwargs: Any) -> str:
    try:
        RLMEnv(dataset=DATA, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the type and message are the fact
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def _without_redis() -> str:
    saved = os.environ.pop("REDIS_URL")
    try:
        return _refusal(repl_language="python")
    finally:
        os.environ["REDIS_URL"] = saved


DATA = Dataset.from_list([{"question": "q", "answer": "a", "info": {"context": "c"}}])


def main() -> None:
    env = RLMEnv(
        dataset=DATA,
        eval_dataset=DATA,
        repl_language="python",
        max_seq_len=32_000,
        sub_max_completion_tokens=500,
        max_turns=30,
        max_turns_in_context=12,
        code_execution_timeout=60,
        sandbox_timeout_minutes=5,
        sandbox_memory_gb=8,
        pip_install_packages="numpy pandas",
        sub_tools=[json.dumps],
        env_id="needle",
    )
    s = env._rlmq_check.settings
    facts = {
        "reference": _params(Reference),
        "ours": _params(RLMEnv),
        "mapped": {
            "max_turns": s.max_turns,
            "sub_llm_max_completion_tokens": s.sub_llm_max_completion_tokens,
            "root_context_tokens": s.root_context_tokens,
            "sub_call_timeout": s.sub_call_timeout,
            "rollout_timeout": s.rollout_timeout,
            "pip_install_packages": s.pip_install_packages,
            "max_seq_len": env.max_seq_len,
            "env_id": env.env_id,
            "eval_rows": len(env.get_eval_dataset()),
            "max_sub_llm_parallelism": s.max_sub_llm_parallelism,
            "sub_tools": s.sub_tools,
        },  # fmt: skip
        "turn_caps": [
            RLMEnv(dataset=DATA, repl_language="python", max_turns=m, max_turns_in_context=c).rlmq_args["max_turns"]
            for m, c in ((0, 5), (30, 12), (10, 40), (50, None))
        ],
        "refused": {
            "both_budgets": _refusal(
                repl_language="python", sub_max_completion_tokens=5, sub_llm_max_completion_tokens=6
            ),
            "same_budgets": _refusal(
                repl_language="python", sub_max_completion_tokens=5, sub_llm_max_completion_tokens=5
            ),
            "no_sub_llms": _refusal(repl_language="python", enable_sub_llms=False),
            "summarization": _refusal(repl_language="python", enable_summarization=True),
            "bad_parallelism": _refusal(repl_language="python", max_sub_llm_parallelism=0),
            "bash": _refusal(),
            "message_history": _refusal(repl_language="python", expose_message_history=True),
            "lambda_sub_tool": _refusal(repl_language="python", sub_tools=[lambda x: x]),
            "no_redis": _without_redis(),
        },
    }
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
