"""The texts the models see: the root scaffold (system message), the REPL tool, sub-LLM prompts.

Modelled on the verifiers ``RLMEnv`` scaffold (``root_prompt_verbosity`` /
``sub_prompt_verbosity`` in light | medium | heavy) and the RLM paper's REPL framing:
the long input is never in the prompt, only described; the model reads it from code.
"""

from __future__ import annotations

import inspect
import pkgutil
from collections.abc import Sequence
from typing import Any

from rlmq.common.settings import Verbosity, setting_default

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


BASH_REPL_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "call_bash_repl",
        "description": (
            "Run bash commands in your REPL and see their output (stdout and stderr). The working directory, "
            "the files and the ANSWER_CONTENT / ANSWER_READY variables carry over between calls; other shell "
            "variables do not."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Bash commands to run."}},
            "required": ["code"],
        },
    },
}


def repl_tool(language: str) -> dict[str, Any]:
    """The root model's one tool for ``language`` (``"python"``: :data:`REPL_TOOL`, ``"bash"``:
    :data:`BASH_REPL_TOOL`, as the verifiers RLMEnv's ``call_python_repl`` / ``call_bash_repl``)."""
    return BASH_REPL_TOOL if language == "bash" else REPL_TOOL


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
    max_turns: int = setting_default("max_turns"),
    sub_llm_max_turns: int = setting_default("sub_llm_max_turns"),
    max_output_length: int = setting_default("max_output_length"),
    parallelism: int = setting_default("max_sub_llm_parallelism"),
    tools: Sequence[str] = (),
    depth: int = 1,
    max_depth: int = setting_default("max_depth"),
    root_budget: int | None = None,
    root_turn_tokens: int | None = None,
    files: str | None = None,
    language: str = "python",
    message_history: bool = False,
    sub_tools: Sequence[str] = (),
    sub_llms: bool = True,
) -> str:
    """The root model's system message.

    Args:
        context: the row's context (only its type and size are described).
        verbosity: light | medium | heavy.
        budget: the sub-LLM completion-token budget (tokens), or ``None`` for none.
        max_turns: the root's turn limit (0 or less: none); stated with medium and heavy verbosity, as are
        sub_llm_max_turns (turns of one sub-LLM), max_output_length (characters of a cell's
            output) and parallelism (sub-LLM calls at once).
        tools: one line per root tool (``RootTool.summary``): its signature and first doc line.
        depth / max_depth: the rollout's depth in its rollout tree and the tree's limit;
            with ``max_depth`` 1 nothing is said of ``rlm_batch`` (the text is as before it).
        root_budget: ``root_max_completion_tokens`` (tokens), told to the root as the reference's
            0.1.14 does, with ``root_turn_tokens`` (a turn's ``max_tokens``), or ``None``.
        files: what the REPL's working directory holds (:func:`files_text`), or ``None``.
        language: ``"python"`` or ``"bash"`` (:func:`bash_parts` then says how the bash REPL works).
        message_history: the REPL's working directory has ``.messages`` (``expose_message_history``).
        sub_tools: one line per sub-LLM tool (:func:`sub_tool_lines`): the root is told what the
            sub-LLMs of ``llm_batch`` can call, as verifiers 0.1.14's ``RLMEnv`` tells it.
        sub_llms: ``False`` (``enable_sub_llms``): nothing is said of sub-LLMs, ``llm_batch``,
            ``rlm_batch``, their tools or their budget.

    ``tests/e2e/test_cli_flags.py`` checks that a run's flags reach this text.
    """
    parts = _opening(context, files, language)
    if not sub_llms:
        parts = [p for p in parts if "llm_batch" not in p]
        max_depth, sub_tools, budget = 1, (), None
    if message_history:
        parts.append(_history_text(language))
    if max_depth > 1:
        parts.append(rlm_batch_text(depth, max_depth))
    parts += _tool_parts(tools, sub_tools, language)
    parts += _budget_parts(budget, root_budget, root_turn_tokens)
    parts += _guidance_parts(verbosity, max_turns, max_output_length, parallelism, sub_llm_max_turns, sub_llms)
    if not sub_llms:
        parts = [p for p in parts if "llm_batch" not in p and "sub-LLM" not in p]
    return "\n\n".join(parts)


def _opening(context: Any, files: str | None, language: str) -> list[str]:
    """The system message's first paragraphs: the task, the REPL, ``context``, ``llm_batch`` and
    how to answer (the bash REPL's own: :func:`bash_parts`)."""
    if language == "bash":
        return bash_parts(files)
    return [
        "You are answering a question about a long input that you cannot see directly. You work in a "
        "persistent Python REPL through the tool `call_python_repl(code)`.",
        f"In the REPL, the variable `context` holds the input: {describe_context(context)}."
        + (f" {files}" if files else ""),
        "`llm_batch(prompts: list[str]) -> list[str]` sends each prompt to a sub-LLM, all in parallel, and "
        "returns their answers in order. Sub-LLMs see only the prompt you give them, so put the relevant "
        "part of `context` and your question into each prompt.",
        'When you know the final answer, set `answer["content"] = "..."` and `answer["ready"] = True` in a '
        "cell; that ends the task.",
    ]


def _history_text(language: str) -> str:
    """Where the conversation so far is (``expose_message_history``) and how to read it in ``language``."""
    how = "cat .messages" if language == "bash" else '[json.loads(line) for line in open(".messages")]'
    return (
        "The file `.messages` in the working directory holds this conversation so far, one JSON message per "
        f"line, written anew before each of your calls; read it with `{how}`."
    )


def _tool_parts(tools: Sequence[str], sub_tools: Sequence[str], language: str) -> list[str]:
    """The root tools (one line each, as the REPL of ``language`` offers them) and the sub-LLMs' tools;
    no paragraph for an empty list."""
    parts: list[str] = []
    if tools:
        how = (
            "These tools are also commands in the REPL: `name arg1 arg2` (an argument that is JSON is decoded, "
            'else it is a string; or `name --json \'{"args": [...], "kwargs": {...}}\'`); a command prints a '
            "str result as it is and anything else as JSON, and a failure prints `Error: ...` and exits with 1:\n"
            if language == "bash"
            else "These tools are also functions in the REPL; call them from your code (arguments and results "
            "are JSON values; a failure raises RuntimeError with its message):\n"
        )
        parts.append(how + "\n".join(f"- {line}" for line in tools))
    if sub_tools:
        parts.append(
            "llm_batch tools: the sub-LLMs that `llm_batch` calls can use these tools themselves (you cannot "
            "call them from the REPL; ask for them in your prompts when they help):\n"
            + "\n".join(f"- {line}" for line in sub_tools)
        )
    return parts


def _budget_parts(budget: int | None, root_budget: int | None, root_turn_tokens: int | None) -> list[str]:
    """The sub-LLMs' budget and the root's own (tokens; ``None``: not told)."""
    parts: list[str] = []
    if budget is not None:
        parts.append(
            f"Sub-LLM calls share a budget of {budget:,} completion tokens for this task. Each `llm_batch` "
            "prints `[U/B sub-LLM completion tokens used]` and the tokens left; an answer cut short by the "
            "budget is marked CUT; when it is spent, calls return a string starting with `[rejected]` and you "
            "must finish with what you have."
        )
    if root_budget is not None:
        parts.append(
            f"Your own responses share a budget of {root_budget:,} completion tokens for this task"
            + (f", up to {root_turn_tokens:,} a turn" if root_turn_tokens else "")
            + ". A turn starts only while a whole turn's tokens are left; then the task ends with "
            '`answer["content"]` as it is, so keep it up to date.'
        )
    return parts


def _guidance_parts(
    verbosity: Verbosity,
    max_turns: int,
    max_output_length: int,
    parallelism: int,
    sub_llm_max_turns: int,
    sub_llms: bool,
) -> list[str]:
    """What ``medium`` verbosity adds (the limits) and what ``heavy`` adds to it (a strategy)."""
    parts: list[str] = []
    if verbosity in ("medium", "heavy"):
        turns = f"You have at most {max_turns} turns." if max_turns > 0 else "You have no turn limit, but a time limit."
        parts.append(
            f"Output of a cell is cut to {max_output_length:,} characters, so print summaries, not the whole "
            f"context. {turns}"
            + (
                f" Up to {parallelism} sub-LLM calls run at once; each may take up to {sub_llm_max_turns} turns "
                "of its own."
                if sub_llms
                else ""
            )
        )
    if verbosity == "heavy":
        parts.append(
            "A good strategy: inspect `type(context)` and `len(context)`, split the input into chunks of a "
            "few thousand characters, ask a sub-LLM about each chunk with `llm_batch`, then combine the "
            "answers in code (for example by majority) before setting `answer`. Errors from sub-LLM calls "
            "come back as strings starting with `[error]` or `[rejected]`."
        )
    return parts


def sub_tool_lines(paths: Sequence[str]) -> list[str]:
    """One line per sub-LLM tool (a ``pkg.mod:func`` / ``pkg.mod.func`` path): its signature and
    the first line of its docstring when the producer can import it, else its name (the workers
    import it; the producer need not be able to)."""
    lines: list[str] = []
    for path in paths:
        name = path.replace(":", ".").rsplit(".", 1)[-1]
        try:
            func = pkgutil.resolve_name(path.strip())
            signature = f"{name}{inspect.signature(func)}"
            doc = (inspect.getdoc(func) or "").strip().splitlines()
        except Exception:  # noqa: BLE001 - not importable here (or no signature): the name is enough
            lines.append(f"{name}(...)")
            continue
        lines.append(f"{signature}: {doc[0]}" if doc else signature)
    return lines


def bash_parts(files: str | None) -> list[str]:
    """The first paragraphs of the root scaffold for the bash REPL (the verifiers RLMEnv's
    ``repl_language="bash"``), in rlmq's words: the tool, the files, ``llm_batch``, the answer."""
    return [
        "You are answering a question about a long input that you cannot see directly. You work in a "
        "bash REPL through the tool `call_bash_repl(code)`; each call is a fresh shell in the directory the last "
        "one ended in. " + (files or "The REPL's working directory holds the input as files."),
        '`llm_batch "prompt 1" "prompt 2" ...` sends each prompt to a sub-LLM, all in parallel, and prints their '
        "answers as a JSON list, in order (`llm_batch --lines` reads one prompt per line of its input; "
        "`llm_batch --json '{\"prompts\": [...]}'` takes JSON). Sub-LLMs see only the prompt you give them, so put "
        "the relevant part of the input and your question into each prompt.",
        "When you know the final answer, put it in the variable `ANSWER_CONTENT` and run `export ANSWER_READY=1`; "
        "that ends the task. Both variables carry over to your next call.",
    ]


def files_text(name: str | None) -> str:
    """The scaffold's sentence on the REPL's working directory: ``name`` is the one context file
    (``context.txt`` / ``context.json``), ``None`` for a copied context folder."""
    if name is None:
        return "The REPL's working directory holds the task's files (a copy of its context folder)."
    return f"The REPL's working directory holds the same input as the file `{name}`."


def rlm_batch_text(depth: int, max_depth: int) -> str:
    """What the root scaffold says of ``rlm_batch`` at ``depth`` of a tree of ``max_depth`` (> 1).

    Its first line is ``rlm_batch: recursive (depth D of M)`` below the limit, else
    ``rlm_batch: plain sub-LLM calls (depth D of M)``: the line the scripted model reads
    (:func:`rlmq.scripted.recursion.recursion_of`)."""
    call = (
        '`rlm_batch(tasks: list) -> list[str]` takes tasks, each a prompt str or `{"prompt": str, '
        '"context": ...}` (a str, list or dict), and returns one answer per task, in order.'
    )
    if depth < max_depth:
        return (
            f"rlm_batch: recursive (depth {depth} of {max_depth})\n{call} Each task is solved by a child RLM like "
            "you: its own REPL, with the task's `context` as its `context` variable and the prompt as its "
            f"question. Your children can go {max_depth - depth - 1} level(s) deeper with `rlm_batch` of their "
            "own. Use it for sub-problems that need code over a large input; use `llm_batch` for simple "
            "questions (it is much cheaper)."
        )
    return (
        f"rlm_batch: plain sub-LLM calls (depth {depth} of {max_depth})\n{call} You are at the deepest level: "
        "your rlm_batch runs plain sub-LLM calls, each seeing its prompt with the task's context appended, "
        "like `llm_batch`."
    )


def compose_system_prompt(scaffold: str, author: str | None, mode: str = "prepend") -> str:
    """The root model's system message from the scaffold's text and the author's ``system_prompt``.

    ``mode``: ``prepend`` (the author's text, a blank line, the scaffold's), ``append`` (the
    scaffold's first) or ``replace`` (the author's alone). No author text (or only blanks, but
    with ``replace``): the scaffold's.

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in ("prepend", "append", "replace"):
        raise ValueError(f"system_prompt_mode must be prepend, append or replace, not {mode!r}")
    if author is None or (not author.strip() and mode != "replace"):
        return scaffold
    if mode == "replace":
        return author
    return f"{author}\n\n{scaffold}" if mode == "prepend" else f"{scaffold}\n\n{author}"


def sub_system_prompt(verbosity: Verbosity = "light") -> str | None:
    """The sub-LLMs' system message (``None`` for light: the prompt alone)."""
    if verbosity == "light":
        return None
    text = "Answer the request using only the text given in it. Be brief."
    if verbosity == "heavy":
        text += " If the text does not contain the answer, reply exactly NOT FOUND."
    return text


def context_warning(prompt_tokens: int, context_tokens: int, language: str = "python") -> str:
    """The warning the root model reads (appended to its next tool message) once a reply's prompt
    reached ``context_warning_threshold`` of its context window.

    Args:
        prompt_tokens: the prompt tokens the server reported for the root's last reply.
        context_tokens: the root model's context window (tokens).
        language: the REPL's (``"bash"``: the answer is set through ``ANSWER_CONTENT``).
    """
    share = prompt_tokens / context_tokens
    how = (
        "set ANSWER_CONTENT and export ANSWER_READY=1"
        if language == "bash"
        else 'set answer["content"] and answer["ready"] = True'
    )
    return (
        f"[context warning] This conversation uses {prompt_tokens:,} of your {context_tokens:,}-token context "
        f"({share:.0%}). Finish now: {how} in your next cell."
    )
