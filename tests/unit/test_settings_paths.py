"""Every setting through every path: ``rlmq`` flags, ``RLMEnv`` arguments, ``RLMQ_*`` variables
(the verifiers harness knobs: ``test_settings_harness.py``, which needs the verifiers extra; this
file runs without any optional extra). Parametrized over the declaration (``common/settings/``),
so a new field is driven here without a line added: its value must reach the rollout's
``RolloutOptions`` (or the worker's settings), with one precedence on each path: explicit >
variable > default. No Redis is needed: each path is followed up to the settings a rollout or
a worker is built from.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import types
import typing
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import SecretStr

from rlmq.cli.flags import settings_from_flags
from rlmq.cli.main import build_parser
from rlmq.common.errors import ConfigError
from rlmq.common.settings import RolloutOptions, Settings, build_settings, load_settings
from rlmq.common.settings.schema import Knob, knobs
from rlmq.common.settings.worker import WorkerOptions
from rlmq.producer.env import FROM_SETTINGS, RLMEnv

REQUIRED_ARGV = {"run": ["rows.jsonl", "--base-url", "http://root:1/v1", "--model", "root"]}
"""What a command needs besides the flag under test."""


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No ``RLMQ_*`` (or ``REDIS_URL`` / ``OPENAI_API_KEY``) of the machine leaks into a case."""
    for name in list(os.environ):
        if name.startswith("RLMQ_") or name in ("REDIS_URL", "OPENAI_API_KEY"):
            monkeypatch.delenv(name)
    yield


def sample(k: Knob, which: int) -> Any:
    """A valid value of ``k``, a different one for each ``which`` (1, 2); not the default, but
    for a switch, whose explicit 1 is its default (so that it must beat the variable's 2)."""
    base = k.base_type
    if k.choices is not None:
        others = [c for c in k.choices if c != k.default]
        return others[(which - 1) % len(others)]
    if k.is_list and k.metavar == "MODULE:FUNCTION":  # imported by the producer: they must exist
        return [["json:dumps"], ["json:loads"]][which - 1]
    if k.is_list:
        return [f"pkg{which}.mod.fn", f"pkg{which}.other"]
    if typing.get_origin(base) is dict:  # a JSON object (sampling arguments)
        return {"temperature": 0.25 * which, "top_p": 0.5}
    if base is bool:
        return bool(k.default) if which == 1 else not k.default  # explicit default (1) must beat the variable (2)
    if base is int:
        start = k.default if isinstance(k.default, int) else 0
        top = next((m.le for m in k.field.metadata if getattr(m, "le", None) is not None), None)
        return start + which if top is not None else start + 10 * which + 7  # within an upper bound
    if base is float:
        start = k.default if isinstance(k.default, float | int) else 0.0
        top = next((m.le for m in k.field.metadata if getattr(m, "le", None) is not None), None)
        return start + (top - start) * which / 3 if top is not None else start + 2.5 * which  # within an upper bound
    if "url" in k.name:
        scheme = "redis" if "redis" in k.name else "http"
        return f"{scheme}://sample{which}:1/0"
    if base is SecretStr:
        return f"sk-sample-{which}"
    return f"sample-{which}"


def env_text(value: Any) -> str:
    """``value`` as an ``RLMQ_*`` variable holds it (a list as JSON)."""
    if isinstance(value, list | dict):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def flag_argv(k: Knob, value: Any) -> list[str]:
    """``value`` as ``k``'s flag on the command line."""
    if isinstance(value, bool):
        return [k.flag if value else "--no-" + k.flag.removeprefix("--")]
    if isinstance(value, list):
        return [part for item in value for part in (k.flag, str(item))]
    if isinstance(value, dict):
        return [k.flag, json.dumps(value)]
    return [k.flag, str(value)]


def plain(value: Any) -> Any:
    return value.get_secret_value() if isinstance(value, SecretStr) else value


def reached(k: Knob, settings: Settings) -> Any:
    """The value of ``k`` where its consumer reads it: the rollout's options, or the settings."""
    if k.owner == "rollout":
        return getattr(settings.rollout_options(), k.name)
    return plain(getattr(settings, k.name))


CLI_CASES = [pytest.param(k, c, id=f"{c}:{k.flag}") for k in knobs() for c in k.commands]
ROLLOUT_CASES = [pytest.param(k, id=k.name) for k in knobs() if k.owner == "rollout"]


def cli_settings(command: str, k: Knob, value: Any = None) -> Settings:
    argv = [command, *REQUIRED_ARGV.get(command, []), *(flag_argv(k, value) if value is not None else [])]
    args: argparse.Namespace = build_parser().parse_args(argv)
    return settings_from_flags(args, command)


@pytest.mark.parametrize(("k", "command"), CLI_CASES)
def test_every_flag_reaches_the_rollout_or_worker_and_beats_the_variable_which_beats_the_default(
    k: Knob, command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    one, two = sample(k, 1), sample(k, 2)
    assert reached(k, cli_settings(command, k, one)) == one  # the flag's value arrives
    monkeypatch.setenv(k.env[0], env_text(two))
    assert reached(k, cli_settings(command, k, one)) == one  # flag > variable
    if not k.required_by(command):
        assert reached(k, cli_settings(command, k)) == two  # variable > default
        monkeypatch.delenv(k.env[0])
        assert reached(k, cli_settings(command, k)) == plain(k.default)


@pytest.mark.parametrize("k", ROLLOUT_CASES)
def test_every_rlmenv_argument_reaches_the_rollout_and_beats_the_variable_which_beats_the_default(
    k: Knob, monkeypatch: pytest.MonkeyPatch
) -> None:
    one, two = sample(k, 1), sample(k, 2)
    assert getattr(RLMEnv(**{k.name: one}).settings.rollout_options(), k.name) == one
    monkeypatch.setenv(k.env[0], env_text(two))
    assert getattr(RLMEnv(**{k.name: one}).settings.rollout_options(), k.name) == one  # argument > variable
    assert getattr(RLMEnv().settings.rollout_options(), k.name) == two  # variable > default
    monkeypatch.delenv(k.env[0])
    assert getattr(RLMEnv().settings.rollout_options(), k.name) == k.default


def test_rlmenv_takes_every_rollout_option_with_its_declared_type() -> None:
    """The ``RLMEnv`` signature is written out (typed for callers); this holds it to the declaration."""
    hints = typing.get_type_hints(RLMEnv.__init__)
    import inspect

    every = inspect.signature(RLMEnv.__init__).parameters
    params = {n: p for n, p in every.items() if p.default is FROM_SETTINGS}
    wider = {"tools", "root_tools"}  # they take callables too: typed for those, default None (settings)
    assert wider <= set(every) and wider <= set(RolloutOptions.model_fields)
    missing = sorted(set(RolloutOptions.model_fields) - set(params) - wider)
    assert not missing, (
        f"RLMEnv.__init__ lacks argument(s) {missing}: add `name: <type> | _FromSettings = FROM_SETTINGS`"
    )
    extra = sorted(set(params) - set(RolloutOptions.model_fields))
    assert not extra, f"RLMEnv setting argument(s) {extra} are no RolloutOptions field"

    def members(t: Any) -> set[Any]:
        union = typing.get_origin(t) in (typing.Union, types.UnionType)
        return set(typing.get_args(t)) if union else {t}

    # the verifiers RLMEnv's forms, taken too: sub_tools=None, pip_install_packages as one str
    reference_forms = {"sub_tools": {type(None)}, "pip_install_packages": {str}}
    for name, field in RolloutOptions.model_fields.items():
        if name in wider:
            continue
        declared = members(field.annotation)
        got = members(hints[name]) - {type(FROM_SETTINGS)} - reference_forms.get(name, set())
        assert got == declared, f"RLMEnv argument {name}: {got} is not the declared {declared}"


def test_every_field_has_help_and_every_number_a_unit() -> None:
    """What the derived flags, docs and knobs need from the declaration."""
    for k in knobs():
        assert k.description, f"{k.name}: Field(..., description='help text with its unit') is missing"
        if k.scalar in (int, float) and not k.is_list:
            assert k.unit, f"{k.name}: a number needs json_schema_extra=meta(unit='seconds' | 'turns' | ...)"
    owners = [set(RolloutOptions.model_fields), set(WorkerOptions.model_fields)]
    assert not owners[0] & owners[1], "a field is declared by both RolloutOptions and WorkerOptions"


def test_the_help_shows_unit_default_and_variable_with_readable_metavars() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = {name: parser.format_help() for name, parser in sub.choices.items()}
    all_env = {v for k in knobs() for v in k.env}
    assert "--allow-tool DOTTED.PATH" in text["worker"] and "--allow-tool ALLOWED_SUB_TOOLS" not in text["worker"]
    assert "--max-turns N" in text["run"] and "default: 50; env RLMQ_MAX_TURNS" in " ".join(text["run"].split())
    budget = " ".join(text["run"].split())
    assert "--sub-llm-max-completion-tokens TOKENS" in budget and "default: no budget" in budget
    for name, help_text in text.items():
        shown = re.sub(r"\b[A-Z]+_[A-Z_]+\b", lambda m: "" if m.group(0) in all_env else m.group(0), help_text)
        for k in knobs():
            if name in k.commands:
                assert k.name.upper() not in shown, f"{name}: {k.name} shown as a metavar"


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["worker", "--concurrency", "0"], "--concurrency"),
        (["demo", "--sub-llm-max-turns", "0"], "--sub-llm-max-turns"),  # (--max-turns 0 is no limit)
        (["demo", "--sub-llm-max-completion-tokens", "0"], "--sub-llm-max-completion-tokens"),
        (["run", *REQUIRED_ARGV["run"], "--max-output-length", "5"], "--max-output-length"),
    ],
)
def test_a_bad_flag_value_is_one_line_naming_the_flag(argv: list[str], named: str) -> None:
    args = build_parser().parse_args(argv)
    with pytest.raises(ConfigError) as info:
        settings_from_flags(args, argv[0])
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"invalid setting(s): {named}: "), text


def test_a_bad_variable_and_a_bad_argument_are_named_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLMQ_SUB_LLM_MAX_TURNS", "0")  # (RLMQ_MAX_TURNS=0 is no turn limit)
    with pytest.raises(ConfigError, match=r"^invalid setting\(s\): RLMQ_SUB_LLM_MAX_TURNS: "):
        RLMEnv()
    monkeypatch.setenv("RLMQ_SUB_TOOLS", "not json")
    with pytest.raises(ConfigError, match=r"RLMQ_SUB_TOOLS: not JSON"):
        RLMEnv(sub_llm_max_turns=3)
    monkeypatch.delenv("RLMQ_SUB_TOOLS")
    with pytest.raises(ConfigError, match=r"^invalid setting\(s\): RLMEnv argument max_output_length: "):
        RLMEnv(sub_llm_max_turns=3, max_output_length=5)


def test_the_parser_error_is_one_line_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["run", *REQUIRED_ARGV["run"], "--max-turns", "many"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --max-turns: invalid int value: 'many'" in err, err


def test_docs_settings_md_is_the_declarations_table() -> None:
    """``docs/settings.md`` is generated; regenerate it with the command it names."""
    from pathlib import Path

    from rlmq.common.settings.schema import markdown

    docs = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
    assert docs.read_text(encoding="utf-8") == markdown(), (
        "docs/settings.md differs from common/settings/: python -m rlmq.common.settings.schema > docs/settings.md"
    )
    for k in knobs():
        assert f"| `{k.name}` |" in docs.read_text(encoding="utf-8")


FLOAT_KNOBS = [pytest.param(k, id=k.name) for k in knobs() if k.base_type is float]


@pytest.mark.parametrize("k", FLOAT_KNOBS)
@pytest.mark.parametrize("text", ["inf", "nan", "-inf"])
def test_no_float_setting_takes_inf_or_nan(k: Knob, text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An endless timeout would switch its bound off silently (and overflow a socket timeout
    derived from it): ``inf`` and ``nan`` are refused as an argument and as a variable."""
    with pytest.raises(ConfigError, match=k.name):
        build_settings({k.name: float(text)})
    monkeypatch.setenv(k.env[0], text)
    with pytest.raises(ConfigError, match=k.env[0]):
        load_settings()


def test_run_and_worker_help_start_with_usage_and_an_example_then_groups() -> None:
    """The first screen (24 lines) of ``rlmq run --help`` holds the usage, an example and the two
    flags every run needs; the settings fall into the groups their declaration names, in order."""
    from rlmq.common.settings.fields import HELP_GROUPS

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command, needed in (("run", ("--base-url URL", "--model NAME")), ("worker", ("--base-url", "--model"))):
        parser = sub.choices[command]
        text = parser.format_help()
        lines = text.splitlines()
        assert lines[0].startswith(f"usage: rlmq {command} ") and len(lines[0]) <= 120, lines[0]
        assert "example:" in lines[:12] and any(
            f"  rlmq {command} " in x or f" rlmq {command} " in x for x in lines[:12]
        )
        if command == "run":
            first_screen = "\n".join(lines[:24])
            assert all(flag in first_screen for flag in needed), first_screen
        else:
            assert all(flag in text for flag in needed)
        titles = [g.title for g in parser._action_groups if g._group_actions]
        shown = [t for t in titles if t in HELP_GROUPS.values()]
        assert shown == [t for t in HELP_GROUPS.values() if t in shown], titles  # the declared order
        for group in parser._action_groups:  # each settings flag sits in the group its field names
            for action in group._group_actions:
                k = next((k for k in knobs() if action.dest == k.name), None)
                if k is not None and not k.required_by(command):
                    assert group.title == HELP_GROUPS[k.group], (k.name, group.title)
    assert all(k.group in HELP_GROUPS for k in knobs())
