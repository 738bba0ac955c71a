"""Root tools refused at construction, and the bounded encoding of their results."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import Any

import pytest

from rlmq.common.errors import ConfigError
from rlmq.common.settings import load_settings
from rlmq.producer.env import RLMEnv
from rlmq.producer.root_tools import RootToolbox, ToolFailure, encode_result


def _named(name: str) -> Any:
    def fn() -> int:
        return 1

    fn.__name__ = name
    return fn


@pytest.mark.parametrize("name", ["llm_batch", "rlm_batch", "context", "answer"])
def test_a_tool_named_like_a_fixed_repl_global_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match=f"'{name}' collides with a fixed REPL name"):
        RLMEnv(settings=load_settings(), root_tools=[_named(name)])


@pytest.mark.parametrize("name", ["print", "_secret", "class"])
def test_a_builtin_private_or_keyword_name_is_refused(name: str) -> None:
    with pytest.raises(ConfigError):
        RLMEnv(settings=load_settings(), root_tools=[_named(name)])


def test_two_tools_of_one_name_and_a_shared_lambda_are_refused() -> None:
    with pytest.raises(ConfigError, match="two tools are named 'same'"):
        RLMEnv(settings=load_settings(), root_tools=[_named("same"), _named("same")])
    with pytest.raises(ConfigError, match="no import path"):
        RLMEnv(settings=load_settings(), tools=[lambda: 1])
    with pytest.raises(ConfigError, match="cannot import it"):
        RLMEnv(settings=load_settings(), root_tools=["no_such_module_xyz:f"])


def test_tools_from_settings_are_dotted_paths_and_shared_ones_reach_the_sub_llms() -> None:
    env = RLMEnv(settings=load_settings(tools=["rlmq.workers.tools:count_words"], root_tools=["json:dumps"]))
    assert env.toolbox.names == ["count_words", "dumps"]
    assert env.settings.tools == ["rlmq.workers.tools:count_words"]


def test_results_are_json_or_their_repr_and_bounded() -> None:
    assert encode_result({"a": [1, "b", None]}, 1024) == '{"a": [1, "b", null]}'
    assert encode_result({1, 2}, 1024) == '"{1, 2}"'
    assert encode_result(math.nan, 1024) == '"nan"'
    with pytest.raises(ToolFailure, match="over the limit of 1024 bytes"):
        encode_result("x" * 2000, 1024)
    with pytest.raises(ToolFailure):
        encode_result([["y" * 100] * 100] * 100, 1024)


async def test_hung_sync_tools_hold_their_threads_and_later_calls_fail_at_once() -> None:
    release = threading.Event()

    def stuck() -> str:
        release.wait(30)
        return "late"

    def fine() -> int:
        return 1

    def times_out_itself() -> None:
        raise TimeoutError("the index server did not answer")

    box = RootToolbox([stuck, fine, times_out_itself], timeout=0.2, max_result_bytes=1024, max_threads=1)
    try:
        with pytest.raises(ToolFailure, match="stuck did not return within its timeout of 0.2 s"):
            await box.call("stuck", [], {})
        with pytest.raises(ToolFailure, match="all 1 threads of the root tools are busy"):
            await box.call("fine", [], {})
        release.set()
        deadline = time.monotonic() + 10
        while box._threads.count:  # the stuck thread returns once released
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert await box.call("fine", [], {}) == "1"
        with pytest.raises(ToolFailure, match="times_out_itself raised TimeoutError: the index server"):
            await box.call("times_out_itself", [], {})
    finally:
        release.set()
        box.close()


async def test_a_tool_error_message_is_cut_and_a_broken_one_is_survived() -> None:
    class Weird(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no message")

    def long_error() -> None:
        raise ValueError("e" * 1_000_000)

    def weird_error() -> None:
        raise Weird

    box = RootToolbox([long_error, weird_error], timeout=5, max_result_bytes=1024)
    try:
        with pytest.raises(ToolFailure) as long_info:
            await box.call("long_error", [], {})
        assert len(str(long_info.value)) < 2100 and str(long_info.value).endswith("(998000 more characters)")
        with pytest.raises(ToolFailure, match=r"weird_error raised Weird: \(its message could not be read\)"):
            await box.call("weird_error", [], {})
    finally:
        box.close()


@pytest.mark.parametrize("seconds", [math.inf, 1e300])
def test_an_endless_root_tool_timeout_is_refused(seconds: float) -> None:
    # Taken, it broke every call: the REPL's socket timeout (derived from it) overflowed.
    with pytest.raises(ConfigError, match="root_tool_timeout"):
        RLMEnv(settings=load_settings(), root_tool_timeout=seconds)
