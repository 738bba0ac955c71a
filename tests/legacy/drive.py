"""Run the reference-style module through verifiers 0.1.14's ``Environment.evaluate``.

Run by the tests with the verifiers-0.1.14 venv's Python (``.venv-legacy``), never imported by
the main test process (whose verifiers is 0.4)::

    python tests/legacy/drive.py OUT.json RUNS_JSON --base-url URL --model NAME [-n N]

RUNS_JSON is a JSON list of ``load_environment`` argument objects: each is loaded and evaluated
in turn, in one process (verifiers is imported once).

The environment module is found by name on ``PYTHONPATH`` (the tests put ``tests/legacy/envs``
there), as ``vf-eval`` finds an installed one; ``REDIS_URL`` names the fleet's Redis. Writes
``{"runs": [{"outputs": [...]}, ...], "verifiers": version, "env": module}`` to OUT.json (each
output: what :func:`_output` keeps of it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("runs")
    parser.add_argument("--env", default="needle_reference_rlm")
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("-n", type=int, default=-1)
    args = parser.parse_args(argv)

    import verifiers as vf
    from verifiers.types import ClientConfig

    client = ClientConfig(api_base_url=args.base_url, api_key_var="RLMQ_TEST_KEY", max_retries=0)
    runs: list[dict[str, Any]] = []
    module = ""
    for env_args in json.loads(args.runs):
        sampling_args = env_args.pop("sampling_args", None)  # the rollout's, as evaluate takes them
        env = vf.load_environment(args.env, **env_args)
        module = next(c.__module__ for c in type(env).__mro__ if c.__module__.startswith("rlmq"))
        results = await env.evaluate(
            client=client,
            model=args.model,
            num_examples=args.n,
            rollouts_per_example=1,
            sampling_args=sampling_args,
            state_columns=["final_answer", "rlmq", "trajectory", "hook_calls"],
            on_progress=lambda *a, **k: None,
        )
        runs.append({"outputs": [_output(out) for out in results["outputs"]]})
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"runs": runs, "verifiers": vf.__version__, "env": module}, fh, default=str)
    return 0


def _output(out: Any) -> dict[str, Any]:
    """What the tests read of one rollout's output."""
    return {
        "reward": out.get("reward"),
        "metrics": out.get("metrics"),
        "final_answer": out.get("final_answer"),
        "answer": out.get("answer"),
        "stop_condition": out.get("stop_condition"),
        "error": out.get("error"),
        "rlmq": out.get("rlmq"),
        "hooks": out.get("hook_calls"),
        "completion_messages": len(out.get("completion") or []),
        "prompt_roles": [m.get("role") for m in out.get("prompt") or []],
        "trajectory_steps": len(out.get("trajectory") or []),
        "sub_steps": [_sub_step(s) for s in out.get("trajectory") or [] if _extras(s).get("is_sub_llm_call")],
        "root_prompts": [_prompt_view(s) for s in out.get("trajectory") or [] if not _extras(s).get("is_sub_llm_call")],
        "root_turn_completion_tokens": [
            _usage(s) for s in out.get("trajectory") or [] if not _extras(s).get("is_sub_llm_call")
        ],
        "token_usage": out.get("token_usage"),
    }


def _extras(step: Any) -> dict[str, Any]:
    extras = step.get("extras") if isinstance(step, dict) else None
    return extras if isinstance(extras, dict) else {}


def _usage(step: Any) -> int:
    response = step.get("response") if isinstance(step, dict) else None
    usage = getattr(response, "usage", None) or (response.get("usage") if isinstance(response, dict) else None)
    value = getattr(usage, "completion_tokens", None) or (
        usage.get("completion_tokens") if isinstance(usage, dict) else 0
    )
    return int(value or 0)


def _text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
    return content if isinstance(content, str) else json.dumps(content, default=str)


def _role(message: Any) -> str:
    return str(message.get("role") if isinstance(message, dict) else getattr(message, "role", ""))


def _prompt_view(step: dict[str, Any]) -> dict[str, Any]:
    """What the tests read of one root step's prompt: its assistant messages' texts (cut)."""
    prompt = step.get("prompt") or []
    return {
        "assistants": [_text(m)[:300] for m in prompt if _role(m) == "assistant"],
        "tools": [_text(m)[:300] for m in prompt if _role(m) == "tool"],
    }


def _sub_step(step: dict[str, Any]) -> dict[str, Any]:
    """What the tests read of one sub-LLM trajectory step."""
    tokens = step.get("tokens") or {}
    return {
        "trajectory_id": step.get("trajectory_id"),
        "extras": _extras(step),
        "completion_ids": tokens.get("completion_ids"),
        "completion_logprobs": tokens.get("completion_logprobs"),
        "prompt_ids": tokens.get("prompt_ids"),
        "completion": [
            m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
            for m in step.get("completion") or []
        ],
    }


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
