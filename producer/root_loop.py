"""The root model's loop of one rollout: the RLM loop of the paper and of the verifiers ``RLMEnv``.

The root model answers; each ``call_python_repl`` tool call runs in the rollout's REPL; the
loop ends on ``answer["ready"]``, after ``max_turns`` root turns (none when ``max_turns <= 0``),
when the root's completion-token limit is used up, on a root reply without a tool call, when
the server refuses the prompt for its length (``prompt_too_long``), when a child rollout's tree
budget cannot grant its next root turn (``budget_spent``, :mod:`rlmq.producer.root_budget`), or, with
``abort_on_code_timeout``, when a cell times out (``code_timeout``). Once a reply's prompt
reaches ``context_warning_threshold`` of ``root_context_tokens``, the next tool message tells
the model to finish. The rollout's wall-clock deadline is the engine's.

It reads only the rollout's options (:class:`~rlmq.common.settings.RolloutOptions`)
and talks to the root model through :class:`~rlmq.producer.root.RootClient` and to the REPL
through :class:`CellRunner`, so a test runs it against an in-memory model and REPL.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

from rlmq.common.errors import ModelError, PromptTooLongError, ReplError, RootBudgetSpent
from rlmq.common.sampling import root_turn_max_tokens
from rlmq.common.schemas import StopReason
from rlmq.producer.repl.cell import CellResult
from rlmq.producer.rollout import Rollout
from rlmq.producer.root import RootClient
from rlmq.producer.root_tokens import ask_for_tokens, root_turn_tokens
from rlmq.producer.scaffold import context_warning, repl_tool

_Stop = tuple[StopReason, str | None]
"""How the loop ended: the stop reason and the final answer."""


class CellRunner(Protocol):
    """Where the root model's code runs: the rollout's REPL (:class:`~rlmq.producer.repl.Repl`)."""

    async def execute(self, code: str, history: str | None = None) -> CellResult:
        """Run one cell; a timeout or a dead REPL is in the result, not an exception. ``history``:
        the conversation as JSON lines for ``.messages`` (``expose_message_history``), or ``None``.

        Raises:
            ReplError: the REPL could not run the cell.
        """
        ...


def _repl_code(arguments: object) -> str | None:
    """The ``code`` string of a ``call_python_repl`` call's JSON arguments, or ``None``."""
    if not isinstance(arguments, str):
        return None
    try:
        code = json.loads(arguments or "{}")["code"]
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):
        return None
    return code if isinstance(code, str) else None


def _tool_call(tc: Any) -> tuple[str, str, object]:
    """``(id, function name, arguments)`` of a tool call, tolerant of shapes a server may send:
    a non-function ("custom") tool call has no ``function``; its name is taken from ``custom``."""
    call_id = getattr(tc, "id", None) or ""
    function = getattr(tc, "function", None)
    if function is None:
        custom = getattr(tc, "custom", None)
        return call_id, str(getattr(custom, "name", None) or getattr(tc, "type", "") or "?"), None
    return call_id, str(getattr(function, "name", "") or ""), getattr(function, "arguments", None)


def _tokens(usage: Any, field: str) -> int:
    value = getattr(usage, field, None) if usage is not None else None
    return value if isinstance(value, int) and value > 0 else 0


def _usage_pair(usage: Any) -> tuple[int, int] | None:
    """``(prompt_tokens, completion_tokens)`` of a reply's ``usage``; ``None`` when it has none."""
    prompt, completion = getattr(usage, "prompt_tokens", None), getattr(usage, "completion_tokens", None)
    return (prompt, completion) if isinstance(prompt, int) and isinstance(completion, int) else None


async def root_loop(root: RootClient, rollout: Rollout, repl: CellRunner) -> tuple[StopReason, str | None]:
    """Run the root model's turns of ``rollout`` until it stops; returns (stop reason, final answer).

    The final answer is ``answer["content"]`` of the cell that set ``answer["ready"]``; on the
    other stops it is the last non-empty ``answer["content"]`` so far (for ``no_tool_call``
    without one ``""``, as verifiers' RLMEnv 0.1.14 read its answer file; the reply's text is in
    the trajectory, not the final answer). Each root call carries ``sampling_args`` and
    ``max_tokens`` = :func:`~rlmq.common.sampling.root_turn_max_tokens`; under
    ``root_max_completion_tokens`` a turn starts only while that many tokens are left (whole or
    not started), else the rollout stops (``max_turns``) with its current answer. Tool calls other than
    ``call_python_repl(code)`` and malformed arguments get an ``[error]`` tool message, not an
    exception.

    Raises:
        ModelError: the root model failed past its retries (see :class:`RootModel
            <rlmq.producer.root.RootModel>`) or answered without a choice; a prompt the server
            refuses for its length is the stop ``prompt_too_long`` instead.
        RlmqError: the REPL could not run a cell.
    """
    o = rollout.options
    tool = repl_tool(o.repl_language)
    state = _LoopState()
    turn = 0
    while o.max_turns <= 0 or turn < o.max_turns:
        turn += 1
        stop = await _turn(root, rollout, repl, tool, state)
        if stop is not None:
            return stop
    return "max_turns", state.last_answer


@dataclass
class _LoopState:
    """What the loop carries from turn to turn: the last non-empty ``answer["content"]`` and
    whether the context warning was given."""

    last_answer: str | None = None
    warned: bool = False


async def _turn(
    root: RootClient, rollout: Rollout, repl: CellRunner, tool: dict[str, Any], state: _LoopState
) -> _Stop | None:
    """One root turn: the root model's reply, then each of its tool calls; the stop it reached, or
    ``None`` to go on (errors as :func:`root_loop`'s)."""
    kwargs, per_call = _request(rollout, tool)
    note = _root_limit_note(rollout, per_call)
    if note is not None:  # a turn is whole or not started: never a tool call cut by the limit
        rollout.trajectory.append({"type": "note", "text": note})
        return "max_turns", state.last_answer
    t0 = time.perf_counter()
    kwargs = ask_for_tokens(rollout, kwargs)
    try:
        resp = await root.chat(**kwargs)
    except PromptTooLongError as exc:
        rollout.trajectory.append({"type": "note", "text": f"prompt_too_long: {exc}"})
        return "prompt_too_long", state.last_answer
    except RootBudgetSpent as exc:  # a child's root turn the tree budget cannot grant
        rollout.trajectory.append({"type": "note", "text": f"budget_spent: {exc}"})
        return "budget_spent", state.last_answer
    calls, prompt_tokens = _record_reply(root, rollout, resp, kwargs, t0)
    if not calls:
        # the reference's final answer here: answer["content"] so far, "" when never set
        return "no_tool_call", state.last_answer or ""
    for call in calls:
        stop = await _run_call(rollout, repl, tool["function"]["name"], call, state)
        if stop is not None:
            return stop
    _warn_near_context(rollout, prompt_tokens, state)
    return None


def _request(rollout: Rollout, tool: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """The keyword arguments of the next root call, and its ``max_tokens`` (``None``: none sent)."""
    o = rollout.options
    kwargs: dict[str, Any] = {"model": rollout.model, "messages": rollout.messages, "tools": [tool]}
    sampling = dict(o.sampling_args)  # checked: never model, messages, tools, n, stream
    sampling.pop("max_tokens", None)
    per_call = root_turn_max_tokens(o)
    if sampling:
        kwargs["extra_body"] = sampling  # merged into the request body as they are
    if per_call is not None:
        kwargs["max_tokens"] = per_call
    return kwargs, per_call


def _root_limit_note(rollout: Rollout, per_call: int | None) -> str | None:
    """The note that ends the rollout when ``root_max_completion_tokens`` leaves fewer than a
    turn's ``per_call`` tokens; ``None`` while a whole turn fits (or there is no limit)."""
    limit = rollout.options.root_max_completion_tokens
    if limit is None or per_call is None:
        return None
    left = limit - rollout.stats.root_completion_tokens
    if left >= per_call:
        return None
    return f"root completion-token limit reached: {max(0, left)} left, a turn needs {per_call}"


def _record_reply(
    root: RootClient, rollout: Rollout, resp: Any, kwargs: dict[str, Any], t0: float
) -> tuple[list[tuple[str, str, object]], int]:
    """Count the reply's tokens, append its assistant message and its ``root`` event (``t0``: the
    turn's start, ``time.perf_counter()``); returns its tool calls and its prompt tokens.

    Raises:
        ModelError: the reply has no choice.
    """
    stats = rollout.stats
    stats.root_turns += 1
    usage = getattr(resp, "usage", None)
    prompt_tokens, completion_tokens = _tokens(usage, "prompt_tokens"), _tokens(usage, "completion_tokens")
    stats.root_prompt_tokens += prompt_tokens
    stats.root_completion_tokens += completion_tokens
    choices = getattr(resp, "choices", None)
    if not choices:
        raise ModelError(f"the root model answered without a choice: {str(resp)[:200]}")
    msg = choices[0].message
    calls = [_tool_call(tc) for tc in (getattr(msg, "tool_calls", None) or [])]
    content = getattr(msg, "content", None) or ""
    assistant: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        assistant["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else ""},
            }
            for call_id, name, arguments in calls
        ]
    rollout.messages.append(assistant)
    event: dict[str, Any] = {
        "type": "root",
        "content": content,
        "tool_calls": assistant.get("tool_calls", []),
        "seconds": round(time.perf_counter() - t0, 4),
        "usage": {"prompt": prompt_tokens, "completion": completion_tokens},
    }
    sent = getattr(root, "sent_max_tokens", None)  # a child's root turn: its grant
    sent_kwargs = kwargs if sent is None else {**kwargs, "max_tokens": sent}
    tokens = root_turn_tokens(rollout, resp, sent_kwargs, _usage_pair(usage))
    if tokens is not None:
        event["tokens"] = tokens
    rollout.trajectory.append(event)
    return calls, prompt_tokens


async def _run_call(
    rollout: Rollout, repl: CellRunner, tool_name: str, call: tuple[str, str, object], state: _LoopState
) -> _Stop | None:
    """One tool call of a reply: an ``[error]`` tool message for a wrong name or arguments, else its
    cell run in the REPL; the stop the cell reached, or ``None``.

    Raises:
        ReplError: the REPL could not run the cell, or the bash REPL's helpers failed in it.
    """
    o, messages = rollout.options, rollout.messages
    call_id, name, arguments = call
    if name != tool_name:
        out = f"[error] unknown tool {name!r}; the only tool is {tool_name}(code)"
        messages.append({"role": "tool", "tool_call_id": call_id, "content": out})
        return None
    code = _repl_code(arguments)
    if code is None:
        out = f'[error] {tool_name} takes one string argument: {{"code": "..."}}'
        messages.append({"role": "tool", "tool_call_id": call_id, "content": out})
        return None
    if o.expose_message_history:
        history = "".join(json.dumps(m, ensure_ascii=False, default=str) + "\n" for m in messages)
        cell = await repl.execute(code, history)
    else:
        cell = await repl.execute(code)
    rollout.stats.repl_times.append(cell.seconds)
    rollout.trajectory.append(
        {
            "type": "cell",
            "code": code,
            "output": cell.output,
            "seconds": round(cell.seconds, 4),
            "timed_out": cell.timed_out,
            "restarted": cell.restarted,
        }
    )
    messages.append({"role": "tool", "tool_call_id": call_id, "content": cell.output})
    if cell.helper_error:  # its llm_batch & co never ran: no answer of this rollout may stand
        raise ReplError(f"in a cell of the bash REPL, {cell.helper_error}")
    if cell.answer_content:
        state.last_answer = cell.answer_content
    if cell.answer_ready:
        return "answer_ready", cell.answer_content
    if cell.timed_out and o.abort_on_code_timeout:
        rollout.trajectory.append({"type": "note", "text": "code_timeout: a cell ran past code_execution_timeout"})
        return "code_timeout", state.last_answer
    return None


def _warn_near_context(rollout: Rollout, prompt_tokens: int, state: _LoopState) -> None:
    """Once the reply's ``prompt_tokens`` reach ``context_warning_threshold`` of
    ``root_context_tokens``, append the warning to the last tool message (once per rollout)."""
    o = rollout.options
    context = o.root_context_tokens
    if not state.warned and context is not None and prompt_tokens >= o.context_warning_threshold * context:
        state.warned = True
        warning = context_warning(prompt_tokens, context, o.repl_language)
        rollout.messages[-1]["content"] = f"{rollout.messages[-1]['content']}\n\n{warning}"
        rollout.trajectory.append({"type": "note", "text": warning})
