"""Where a sub-call's hosted tool calls go (:attr:`SubLLMRequest.tool_host`): the process of the
rollout whose ledger the call charges, never a rollout its payload merely names."""

from __future__ import annotations

import json
import time

import pytest
from pydantic import ValidationError

from rlmq.common.schemas import SubLLMRequest


def _fields() -> dict[str, object]:
    now = time.time()
    return {
        "rollout_id": "own", "batch_id": "b", "index": 0, "prompt": "p", "model": "m",
        "enqueued_at": now, "deadline": now + 30,
    }  # fmt: skip


def request(**kw: object) -> SubLLMRequest:
    return SubLLMRequest.model_validate({**_fields(), **kw})


def test_a_top_rollouts_call_sends_its_tool_calls_to_its_own_process() -> None:
    assert request().tool_host == "own"


def test_a_child_rollouts_call_sends_them_to_the_top_whose_ledger_it_charges() -> None:
    child = request(rollout_id="child-1", ledger_id="top", nodes=["top", "child-1"])
    assert child.tool_host == "top" and child.must_be_budgeted  # the ledger checks it is of that tree


def test_a_chain_that_names_another_rollout_without_charging_its_ledger_reaches_only_its_own() -> None:
    forged = request(nodes=["someone-elses-top", "own"])
    assert forged.tool_host == "own"


@pytest.mark.parametrize(
    ("older", "on"),
    [
        ({"include_tokens": True, "include_messages": True}, True),
        ({"include_tokens": False, "include_messages": False}, False),
    ],
)
def test_an_older_producers_two_fields_are_read_as_the_one(older: dict[str, object], on: bool) -> None:
    req = request(**older)
    assert req.include_sub_llm_in_trajectory is on
    assert SubLLMRequest.model_validate_json(json.dumps(older | _fields())).include_sub_llm_in_trajectory is on
    dumped = req.model_dump_json()
    assert "include_tokens" not in dumped and "include_messages" not in dumped  # written under the one name


def test_the_option_travels_under_its_one_name_and_an_older_field_stays_checked() -> None:
    wire = request(include_sub_llm_in_trajectory=True).model_dump_json()
    assert '"include_sub_llm_in_trajectory":true' in wire
    assert SubLLMRequest.model_validate_json(wire).include_sub_llm_in_trajectory
    for bad in (
        {"include_tokens": "many"},
        {"include_messages": "many"},
        {"older_include_messages": True},  # not a wire name
        {"include_tokens": True, "include_sub_llm_in_trajectory": True},  # no producer writes both
    ):
        with pytest.raises(ValidationError):
            request(**bad)
