"""The root loop (producer/root_loop.py) against an in-memory root model and REPL: every stop,
the root's token cap, the context warning and tool calls a model may get wrong."""

from __future__ import annotations

from typing import Any

import pytest

from rlmq.common.errors import ModelError, PromptTooLongError
from rlmq.common.schemas import DatasetRow
from rlmq.common.settings import RolloutOptions
from rlmq.producer.rollout import Rollout
from rlmq.producer.root_loop import root_loop
from tests.root_fakes import FakeRepl, FakeRoot, code_turn, completion, repl_call


def rollout(**options: Any) -> Rollout:
    ro = Rollout(
        id="r1",
        row=DatasetRow(id="x", question="q?", context="c"),
        model="root-m",
        sub_model="sub-m",
        queue="q",
        options=RolloutOptions(**options),
    )
    ro.messages.append({"role": "user", "content": "q?"})
    return ro


def tool_messages(ro: Rollout) -> list[str]:
    return [m["content"] for m in ro.messages if m["role"] == "tool"]


async def test_answer_ready_ends_the_rollout_with_the_cells_answer() -> None:
    root, repl, ro = FakeRoot(code_turn("x = 1"), code_turn("answer:42")), FakeRepl(), rollout()
    assert await root_loop(root, ro, repl) == ("answer_ready", "42")
    assert repl.cells == ["x = 1", "answer:42"]
    assert ro.stats.root_turns == 2 and ro.stats.root_prompt_tokens == 20 and ro.stats.root_completion_tokens == 10
    assert [e["type"] for e in ro.trajectory] == ["root", "cell", "root", "cell"]
    assert tool_messages(ro) == ["ran x = 1", ""]
    # every call offers the REPL tool and sends the conversation so far
    assert [c["tools"][0]["function"]["name"] for c in root.calls] == ["call_python_repl"] * 2
    assert root.calls[1]["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "ran x = 1"}
    assert all("max_tokens" not in c for c in root.calls)


async def test_max_turns_stops_with_the_last_answer_content() -> None:
    root, repl, ro = FakeRoot(code_turn("content:draft")), FakeRepl(), rollout(max_turns=3)
    assert await root_loop(root, ro, repl) == ("max_turns", "draft")
    assert len(root.calls) == 3 and ro.stats.root_turns == 3


@pytest.mark.parametrize("limit", [0, -1])
async def test_max_turns_of_zero_or_less_means_no_turn_limit(limit: int) -> None:
    turns = [code_turn(f"step {i}") for i in range(120)] + [code_turn("answer:done")]
    root, repl, ro = FakeRoot(*turns), FakeRepl(), rollout(max_turns=limit)
    assert await root_loop(root, ro, repl) == ("answer_ready", "done")
    assert ro.stats.root_turns == 121  # past the default of 50


async def test_no_tool_call_ends_with_an_earlier_answer_or_empty_as_the_reference() -> None:
    root, ro = FakeRoot(completion("It is 7.")), rollout()
    assert await root_loop(root, ro, FakeRepl()) == ("no_tool_call", "")  # not the reply's text
    root, ro = FakeRoot(code_turn("content:8"), completion("done")), rollout()
    assert await root_loop(root, ro, FakeRepl()) == ("no_tool_call", "8")
    root, ro = FakeRoot(completion(None)), rollout()
    assert await root_loop(root, ro, FakeRepl()) == ("no_tool_call", "")


async def test_a_model_error_is_raised_for_the_engine_to_record() -> None:
    root, ro = FakeRoot(code_turn("x"), ModelError("root model answered 500", 500)), rollout()
    with pytest.raises(ModelError, match="500"):
        await root_loop(root, ro, FakeRepl())
    empty = completion("x").model_copy(update={"choices": []})
    with pytest.raises(ModelError, match="without a choice"):
        await root_loop(FakeRoot(empty), rollout(), FakeRepl())


async def test_a_prompt_refused_for_its_length_is_its_own_stop() -> None:
    refused = PromptTooLongError("root model refused the prompt for its length (400): maximum context length", 400)
    root, ro = FakeRoot(code_turn("content:partial"), refused), rollout()
    assert await root_loop(root, ro, FakeRepl()) == ("prompt_too_long", "partial")
    assert ro.stats.root_turns == 1  # the refused call is no turn
    assert ro.trajectory[-1]["type"] == "note" and "prompt_too_long" in ro.trajectory[-1]["text"]


async def test_a_root_turn_under_the_root_budget_is_whole_or_not_started() -> None:
    # 25 tokens, 10 a turn (sampling max_tokens): turns start with 25, 19 and 13 left (6 spent each);
    # with 7 left a whole turn no longer fits: not started, the rollout ends with its current answer
    root = FakeRoot(code_turn("content:a", completion_tokens=6))
    ro = rollout(root_max_completion_tokens=25, sampling_args={"max_tokens": 10})
    assert await root_loop(root, ro, FakeRepl()) == ("max_turns", "a")
    assert [c["max_tokens"] for c in root.calls] == [10, 10, 10]  # never what is left: a whole turn
    assert ro.trajectory[-1] == {
        "type": "note",
        "text": "root completion-token limit reached: 7 left, a turn needs 10",
    }
    # without a sampling max_tokens a turn is 2048 tokens, and never more than the limit (a limit
    # below the sampling max_tokens still gets one whole turn, not none)
    for sampling in ({}, {"max_tokens": 4096}):
        root = FakeRoot(code_turn("content:b", completion_tokens=6))
        ro = rollout(root_max_completion_tokens=10, sampling_args=sampling)
        assert await root_loop(root, ro, FakeRepl()) == ("max_turns", "b")
        assert [c["max_tokens"] for c in root.calls] == [10]


async def test_a_timed_out_cell_goes_on_by_default_and_ends_the_rollout_when_asked() -> None:
    turns = (code_turn("content:before"), code_turn("hang"), code_turn("answer:after"))
    repl, ro = FakeRepl(), rollout()
    assert await root_loop(FakeRoot(*turns), ro, repl) == ("answer_ready", "after")
    assert repl.cells == ["content:before", "hang", "answer:after"]
    repl, ro = FakeRepl(), rollout(abort_on_code_timeout=True)
    assert await root_loop(FakeRoot(*turns), ro, repl) == ("code_timeout", "before")
    assert repl.cells == ["content:before", "hang"]
    assert tool_messages(ro)[-1].startswith("[timeout]")  # the cell is recorded before the stop


async def test_the_context_warning_comes_once_with_the_next_tool_message() -> None:
    turns = [code_turn(f"s{i}", prompt_tokens=p) for i, p in enumerate((500, 799, 800, 950))]
    ro = rollout(root_context_tokens=1000, max_turns=4)
    root = FakeRoot(*turns)
    await root_loop(root, ro, FakeRepl())
    outs = tool_messages(ro)
    assert [("[context warning]" in o) for o in outs] == [False, False, True, False]
    assert outs[2].startswith("ran s2\n\n[context warning] This conversation uses 800 of your 1,000-token")
    assert 'answer["ready"] = True' in outs[2]
    assert "[context warning]" in root.calls[3]["messages"][-1]["content"]  # the model reads it
    # a lower threshold warns earlier; no known context, no warning
    ro = rollout(root_context_tokens=1000, context_warning_threshold=0.5, max_turns=4)
    await root_loop(FakeRoot(*turns), ro, FakeRepl())
    assert [("[context warning]" in o) for o in tool_messages(ro)] == [True, False, False, False]
    ro = rollout(max_turns=4)
    await root_loop(FakeRoot(*turns), ro, FakeRepl())
    assert not any("[context warning]" in o for o in tool_messages(ro))


@pytest.mark.parametrize(
    ("call", "error"),
    [
        ({"id": "c", "type": "function", "function": {"name": "bash", "arguments": "{}"}}, "unknown tool 'bash'"),
        (repl_call("", arguments="{not json"), "one string argument"),
        (repl_call("", arguments="[1, 2]"), "one string argument"),
        (repl_call("", arguments='"print(1)"'), "one string argument"),
        (repl_call("", arguments='{"code": 5}'), "one string argument"),
        (repl_call("", arguments='{"cmd": "print(1)"}'), "one string argument"),
        (repl_call("", arguments=""), "one string argument"),
        (repl_call("", arguments="[" * 100_000), "one string argument"),  # nesting past the parser's depth
        ({"id": "c", "type": "custom", "custom": {"name": "grep", "input": "x"}}, "unknown tool 'grep'"),
    ],
)
async def test_a_bad_tool_call_gets_an_error_message_and_the_rollout_goes_on(call: dict[str, Any], error: str) -> None:
    root = FakeRoot(completion(tool_calls=[call]), code_turn("answer:ok"))
    repl, ro = FakeRepl(), rollout()
    assert await root_loop(root, ro, repl) == ("answer_ready", "ok")
    first = tool_messages(ro)[0]
    assert first.startswith("[error]") and error in first, first
    assert repl.cells == ["answer:ok"]  # nothing of the bad call ran
    sent = root.calls[1]["messages"]
    assert sent[-2]["tool_calls"][0]["id"] == call["id"] and sent[-1]["tool_call_id"] == call["id"]


async def test_several_tool_calls_of_one_turn_run_in_order_until_the_answer() -> None:
    calls = [repl_call("a", "c1"), repl_call("answer:b", "c2"), repl_call("never", "c3")]
    repl, ro = FakeRepl(), rollout()
    assert await root_loop(FakeRoot(completion(tool_calls=calls)), ro, repl) == ("answer_ready", "b")
    assert repl.cells == ["a", "answer:b"]


async def test_a_reply_without_usage_counts_no_tokens() -> None:
    ro = rollout()
    await root_loop(FakeRoot(code_turn("answer:1", usage=False)), ro, FakeRepl())
    assert (ro.stats.root_prompt_tokens, ro.stats.root_completion_tokens) == (0, 0)
    assert ro.trajectory[0]["usage"] == {"prompt": 0, "completion": 0}
