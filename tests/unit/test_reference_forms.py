"""Arguments an environment written for verifiers' RLMEnv (0.1.14) passes in the reference's own
forms, and a verifiers task's ``info`` becoming the REPL's files."""

from __future__ import annotations

import pytest

from rlmq.common.errors import ConfigError
from rlmq.producer.env import RLMEnv
from rlmq.producer.repl.files import context_files, repl_context


def test_sub_tools_none_and_pip_packages_as_one_string() -> None:
    env = RLMEnv(sub_tools=None, pip_install_packages="  numpy  pandas>=2 ")
    assert env.settings.sub_tools == []
    assert env.settings.pip_install_packages == ["numpy", "pandas>=2"]
    assert RLMEnv(pip_install_packages="").settings.pip_install_packages == []
    assert RLMEnv(pip_install_packages=["a b"]).settings.pip_install_packages == ["a b"]  # a list is taken as it is


def test_a_wrong_type_is_still_refused_naming_the_argument() -> None:
    with pytest.raises(ConfigError, match="sub_tools"):
        RLMEnv(sub_tools=7)


def test_a_verifiers_task_with_its_context_in_info_gets_it_as_file_and_variable() -> None:
    from rlmq.verifiers_plugin.harness import dataset_row  # verifiers: the test extra installs it
    from rlmq.verifiers_plugin.taskset import RlmqTaskData

    data = RlmqTaskData.model_validate({"id": "t1", "prompt": "p", "info": {"context": {"haystack": ["a", "b"]}}})
    row = dataset_row(data, "find it")
    assert repl_context(row) == {"haystack": ["a", "b"]}
    files = context_files(row)
    assert (files.name, files.text, files.source) == ("context.json", '{"haystack": ["a", "b"]}', "info.context")


def test_sub_answers_are_boxed_extracted_as_the_reference() -> None:
    from rlmq.workers.subllm import boxed_answer

    assert boxed_answer(r"Reasoning... so \boxed{42}.") == "42"
    assert boxed_answer(r"\boxed{a} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"  # the last, braces balanced
    assert boxed_answer("no box here") == "no box here"
    assert boxed_answer(r"cut \boxed{open") == r"cut \boxed{open"
