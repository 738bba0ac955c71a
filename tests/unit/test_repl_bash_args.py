"""The bash REPL's commands refuse what the reference's helper refuses: ``--json PAYLOAD extra``
(verifiers 0.1.14: ``does not accept extra args``), for ``llm_batch`` and for a root tool."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rlmq.producer.repl_child import bash as repl_bash


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[Any], str]:
    calls: list[Any] = []

    def make(name: str) -> Any:
        def func(*args: Any, **kwargs: Any) -> Any:
            calls.append((name, args, kwargs))
            return ["ok"]

        return func

    status = repl_bash.command(argv, make)
    return status, calls, capsys.readouterr().err


@pytest.mark.parametrize("name", ["llm_batch", "lookup"])
def test_json_payload_with_extra_args_is_refused_and_nothing_is_called(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    payload = json.dumps({"prompts": ["x"]} if name == "llm_batch" else {"args": [1]})
    status, calls, err = _run([name, "--json", payload, "extra"], capsys)
    assert status == 1 and calls == [] and "does not accept extra args: extra" in err


@pytest.mark.parametrize("name", ["llm_batch", "lookup"])
def test_json_payload_alone_still_runs(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    payload = json.dumps({"prompts": ["x"]} if name == "llm_batch" else {"args": [1]})
    status, calls, _ = _run([name, "--json", payload], capsys)
    assert status == 0 and len(calls) == 1
