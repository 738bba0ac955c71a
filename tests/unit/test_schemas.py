"""Where a sub-call's hosted tool calls go (:attr:`SubLLMRequest.tool_host`): the process of the
rollout whose ledger the call charges, never a rollout its payload merely names."""

from __future__ import annotations

import time

from rlmq.common.schemas import SubLLMRequest


def request(**kw: object) -> SubLLMRequest:
    now = time.time()
    fields: dict[str, object] = {
        "rollout_id": "own", "batch_id": "b", "index": 0, "prompt": "p", "model": "m",
        "enqueued_at": now, "deadline": now + 30,
    }  # fmt: skip
    return SubLLMRequest.model_validate({**fields, **kw})


def test_a_top_rollouts_call_sends_its_tool_calls_to_its_own_process() -> None:
    assert request().tool_host == "own"


def test_a_child_rollouts_call_sends_them_to_the_top_whose_ledger_it_charges() -> None:
    child = request(rollout_id="child-1", ledger_id="top", nodes=["top", "child-1"])
    assert child.tool_host == "top" and child.must_be_budgeted  # the ledger checks it is of that tree


def test_a_chain_that_names_another_rollout_without_charging_its_ledger_reaches_only_its_own() -> None:
    forged = request(nodes=["someone-elses-top", "own"])
    assert forged.tool_host == "own"
