"""The texts the models see: the root scaffold (system message), the REPL tool, sub-LLM prompts.

Modelled on the verifiers ``RLMEnv`` scaffold (``root_prompt_verbosity`` /
``sub_prompt_verbosity`` in light | medium | heavy) and the RLM paper's REPL framing:
the long input is never in the prompt, only described; the model reads it from code.
"""

from __future__ import annotations

from typing import Any

from rlmq.common.settings import Verbosity

REPL_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "call_python_repl",
        "description": (
            "Run Python code in your persistent REPL and see its output (stdout, stderr and the value "
            "of a last expression). Variables persist between calls."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python code to run."}},
            "required": ["code"],
        },
    },
}


def describe_context(context: Any) -> str:
    """One line on the shape and size of ``context`` (never its content)."""
    if isinstance(context, str):
        return f"a str of {len(context):,} characters"
    if isinstance(context, list):
        return f"a list of {len(context):,} items"
    if isinstance(context, dict):
        return f"a dict with {len(context):,} keys"
    return f"a {type(context).__name__}"


def root_system_prompt(
    context: Any,
    *,
    verbosity: Verbosity = "light",
    budget: int | None = None,
    max_turns: int = 50,
    sub_llm_max_turns: int = 5,
    max_output_length: int = 8192,
    parallelism: int = 64,
) -> str:
    """The root model's system message.

    Args:
        context: the row's context (only its type and size are described).
        verbosity: light | medium | heavy.
        budget: the sub-LLM completion-token budget (tokens), or ``None`` for none.
        max_turns: the root's turn limit; stated with medium and heavy verbosity, as are
        sub_llm_max_turns (turns of one sub-LLM), max_output_length (characters of a cell's
            output) and parallelism (sub-LLM calls at once).

    ``tests/e2e/test_cli_flags.py`` checks that a run's flags reach this text.
    """
    parts = [
        "You are answering a question about a long input that you cannot see directly. You work in a "
        "persistent Python REPL through the tool `call_python_repl(code)`.",
        f"In the REPL, the variable `context` holds the input: {describe_context(context)}.",
        "`llm_batch(prompts: list[str]) -> list[str]` sends each prompt to a sub-LLM, all in parallel, and "
        "returns their answers in order. Sub-LLMs see only the prompt you give them, so put the relevant "
        "part of `context` and your question into each prompt.",
        'When you know the final answer, set `answer["content"] = "..."` and `answer["ready"] = True` in a '
        "cell; that ends the task.",
    ]
    if budget is not None:
        parts.append(
            f"Sub-LLM calls share a budget of {budget:,} completion tokens for this task. Each `llm_batch` "
            "prints `[U/B sub-LLM completion tokens used]`; when it is spent, calls are rejected and you must "
            "finish with what you have."
        )
    if verbosity in ("medium", "heavy"):
        parts.append(
            f"Output of a cell is cut to {max_output_length:,} characters, so print summaries, not the whole "
            f"context. You have at most {max_turns} turns. Up to {parallelism} sub-LLM calls run at once; "
            f"each may take up to {sub_llm_max_turns} turns of its own."
        )
    if verbosity == "heavy":
        parts.append(
            "A good strategy: inspect `type(context)` and `len(context)`, split the input into chunks of a "
            "few thousand characters, ask a sub-LLM about each chunk with `llm_batch`, then combine the "
            "answers in code (for example by majority) before setting `answer`. Errors from sub-LLM calls "
            "come back as strings starting with `[error]` or `[rejected]`."
        )
    return "\n\n".join(parts)


def sub_system_prompt(verbosity: Verbosity = "light") -> str | None:
    """The sub-LLMs' system message (``None`` for light: the prompt alone)."""
    if verbosity == "light":
        return None
    text = "Answer the request using only the text given in it. Be brief."
    if verbosity == "heavy":
        text += " If the text does not contain the answer, reply exactly NOT FOUND."
    return text
