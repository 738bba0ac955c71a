"""The root model is told what the sub-LLMs of ``llm_batch`` can call (verifiers 0.1.14's
``RLMEnv`` adds an ``llm_batch`` tools section to the root prompt)."""

from __future__ import annotations

from rlmq.producer.scaffold import root_system_prompt, sub_tool_lines


def test_sub_tools_are_listed_with_signature_and_first_doc_line() -> None:
    lines = sub_tool_lines(["json:dumps", "os.path.join"])
    assert lines[0].startswith("dumps(obj, *,") and "Serialize ``obj``" in lines[0]
    assert lines[1].startswith("join(")
    prompt = root_system_prompt("ctx", sub_tools=lines)
    assert "llm_batch tools" in prompt and "- dumps(obj" in prompt


def test_a_sub_tool_the_producer_cannot_import_is_listed_by_name() -> None:
    assert sub_tool_lines(["no_such_module_here:lookup"]) == ["lookup(...)"]


def test_no_sub_tools_no_section() -> None:
    assert "llm_batch tools" not in root_system_prompt("ctx")
