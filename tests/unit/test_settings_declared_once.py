"""Each default and bound of a setting is declared once (``common/settings/__init__.py``, and
``common/settings/worker.py`` for a worker's own) and referred to.

Two guards, each of which would have caught ``rlmq run --sub-llm-max-turns 200``: accepted at
start-up, then every ``llm_batch`` failed with HTTP 503, because the wire model
(``SubCallOptions.max_turns``) typed its own, narrower bound (``le=100``).

* A parameter (or a dataclass / model field) named like a setting may not have a literal
  default: it refers to the declaration (:func:`rlmq.common.settings.setting_default`) or is
  required.
* Every rollout option at the edges of its declared range builds valid wire payloads through
  the producer's own code (:meth:`LlmBatchService.spec`): no wire bound is narrower.

No Redis and no optional extra is needed.
"""

from __future__ import annotations

import ast
import types
from pathlib import Path
from typing import Any

import pytest
from annotated_types import Ge, Gt, Le, Lt
from pydantic import ValidationError

from rlmq.cli.flags import settings_from_flags
from rlmq.cli.main import build_parser
from rlmq.common.errors import ConfigError
from rlmq.common.sampling import sub_call_max_tokens
from rlmq.common.settings import RolloutOptions, Settings, setting_default
from rlmq.producer.llm_batch import LlmBatchService

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    {
        *(p for folder in ("common", "producer", "workers") for p in (ROOT / folder).rglob("*.py")),
        *(ROOT / "rlmq").glob("*.py"),
        *(p for folder in ("cli", "scripted", "verifiers_plugin") for p in (ROOT / "rlmq" / folder).rglob("*.py")),
    }
    - {ROOT / "common" / "settings" / name for name in ("__init__.py", "rollout.py", "worker.py")}
)
"""Every module below the declaration (``rlmq/common`` etc. are links to the top-level folders)."""

NOT_THE_SETTING = {
    ("rlmq/cli/local.py", "LocalFleet.__init__", "model"): "the local mock server's model name, not a default",
    ("common/schemas.py", "SubCallOptions", "include_sub_llm_in_trajectory"): "the wire's: a job that does not "
    "say so asks its server for no token, whatever the rollouts' default",
}
"""Parameters named like a setting that mean something else, with the reason."""


def _literal(node: ast.expr | None) -> bool:
    """A default typed as a value (``600``, ``64 * 1024 * 1024``, ``"EMPTY"``), not ``None``."""
    if node is None or (isinstance(node, ast.Constant) and node.value is None):
        return False
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Field":
        given = [k.value for k in node.keywords if k.arg == "default"]
        return bool(given) and _literal(given[0])
    return all(
        isinstance(n, ast.Constant | ast.BinOp | ast.UnaryOp | ast.operator | ast.unaryop) for n in ast.walk(node)
    )


def _defaults(tree: ast.Module) -> list[tuple[str, str, ast.expr]]:
    """(qualified owner, parameter or field name, default) for every default in ``tree``."""
    out: list[tuple[str, str, ast.expr]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                a, name = child.args, prefix + child.name
                positional = a.posonlyargs + a.args
                pairs = list(zip(positional[len(positional) - len(a.defaults) :], a.defaults, strict=True))
                pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None]
                out.extend((name, arg.arg, d) for arg, d in pairs)
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                for st in child.body:
                    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None:
                        out.append((prefix + child.name, st.target.id, st.value))
                visit(child, prefix + child.name + ".")

    visit(tree, "")
    return out


def test_the_scan_reads_every_layer() -> None:
    """The guard below reads the modules it must (a moved folder would empty it silently)."""
    names = {p.relative_to(ROOT).as_posix() for p in SOURCES}
    assert {"common/jobs/store.py", "producer/repl/session.py", "workers/model.py", "rlmq/cli/local.py"} <= names


def test_no_parameter_named_like_a_setting_has_a_literal_default() -> None:
    offenders = []
    for path in SOURCES:
        rel = path.relative_to(ROOT).as_posix()
        for owner, name, default in _defaults(ast.parse(path.read_text(encoding="utf-8"))):
            if name in Settings.model_fields and _literal(default) and (rel, owner, name) not in NOT_THE_SETTING:
                offenders.append(f"{rel}: {owner}({name}={ast.unparse(default)})")
    assert not offenders, (
        "a setting's default typed again below its declaration: refer to it "
        f'(setting_default("<name>")) or make it required: {offenders}'
    )


UNDER_OTHER_NAMES = {
    ("common/budget/ledger.py", "BudgetLedger.__init__", "ttl"): "rollout_key_ttl",
    ("producer/dispatch.py", "BatchSpec", "reply_ttl"): "rollout_key_ttl",
    ("common/jobs/store.py", "", "DEFAULT_REPLY_TTL"): "rollout_key_ttl",
}
"""Defaults of a setting under another name (the keys of a rollout's ledger and its batches' reply
streams live ``rollout_key_ttl``), with the setting each refers to."""


def test_a_setting_under_another_name_refers_to_its_declaration() -> None:
    for (rel, owner, name), setting in UNDER_OTHER_NAMES.items():
        tree = ast.parse((ROOT / rel).read_text(encoding="utf-8"))
        found = [d for o, n, d in _defaults(tree) if (o, n) == (owner, name)]
        found += [
            st.value
            for st in tree.body
            if not owner and isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
            and st.target.id == name and st.value is not None
        ]  # fmt: skip
        assert [ast.unparse(d) for d in found] == [f"setting_default('{setting}')"], (rel, owner, name)


def test_the_literal_guard_catches_a_retyped_default() -> None:
    """The guard itself: the bug's kind of line is found, a reference and ``None`` are not."""
    tree = ast.parse(
        "def f(result_ttl: int = 600, max_batch_bytes: int = 64 * 1024 * 1024, tenant=None,\n"
        '      max_turns: int = setting_default("max_turns")): ...\n'
        "class C:\n    sub_llm_max_turns: int = Field(default=5, ge=1, le=100)\n"
    )
    found = {name for _, name, d in _defaults(tree) if _literal(d)}
    assert found == {"result_ttl", "max_batch_bytes", "sub_llm_max_turns"}


def _bounds(name: str) -> tuple[float | None, float | None]:
    """The declared (lowest, highest) valid number of the rollout option ``name``."""
    low = high = None
    for m in RolloutOptions.model_fields[name].metadata:
        if isinstance(m, Ge):
            low = m.ge
        elif isinstance(m, Gt):
            low = m.gt + 1
        elif isinstance(m, Le):
            high = m.le
        elif isinstance(m, Lt):
            high = m.lt - 1
    return low, high


def _edges() -> list[Any]:
    """(option, value) at each edge of every whole-number rollout option's declared range (a
    large number where the declaration sets no upper bound)."""
    cases = []
    for name, field in RolloutOptions.model_fields.items():
        if int not in (field.annotation, *getattr(field.annotation, "__args__", ())):
            continue
        low, high = _bounds(name)
        for value in {low if low is not None else -(10**6), high if high is not None else 10**9}:
            cases.append(pytest.param(name, int(value), id=f"{name}={int(value)}"))
    return cases


def _rollout(options: RolloutOptions) -> Any:
    """What :meth:`LlmBatchService.spec` reads of a rollout (a plain record; no Redis)."""
    return types.SimpleNamespace(
        id="r1",
        queue="q@t",
        ledger_id=None,
        nodes=[],
        inflight=None,
        sub_model="m",
        budget=None,
        options=options,
        hosted_tools=(),
    )


@pytest.mark.parametrize(("name", "value"), _edges())
def test_every_rollout_option_at_its_declared_edge_makes_a_valid_wire_request(name: str, value: int) -> None:
    """No wire model's bound is narrower than its setting's: a value the setting accepts
    reaches the queue (``SubCallOptions`` is validated as the batch is built)."""
    options = RolloutOptions(**{name: value})
    spec = LlmBatchService(dispatcher=None, result_ttl=setting_default("result_ttl")).spec(_rollout(options), "b1")  # type: ignore[arg-type]
    assert spec.call.max_turns == options.sub_llm_max_turns
    assert spec.call.max_completion_tokens == sub_call_max_tokens(options)  # always sent


def test_the_edge_guard_catches_a_narrower_wire_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard itself: a wire bound narrower than the setting's (the bug) fails the build."""
    from rlmq.common import schemas

    class Narrow(schemas.SubCallOptions):
        max_turns: int = schemas.Field(default=5, ge=1, le=schemas.SUB_LLM_MAX_TURNS_LIMIT - 1)

    monkeypatch.setattr("rlmq.producer.llm_batch.SubCallOptions", Narrow)
    options = RolloutOptions(sub_llm_max_turns=_bounds("sub_llm_max_turns")[1])
    with pytest.raises(ValidationError, match="max_turns"):
        LlmBatchService(dispatcher=None).spec(_rollout(options), "b1")  # type: ignore[arg-type]


def test_sub_llm_max_turns_past_the_workers_limit_is_refused_at_start_up_in_one_line() -> None:
    """The reported case: 200 turns is refused by ``rlmq run`` before anything starts, naming
    the flag; the limit itself is accepted and reaches the wire."""
    argv = ["run", "rows.jsonl", "--base-url", "http://root:1/v1", "--model", "root", "--sub-llm-max-turns"]
    with pytest.raises(ConfigError) as info:
        settings_from_flags(build_parser().parse_args([*argv, "200"]), "run")
    text = str(info.value)
    assert "\n" not in text and text.startswith("invalid setting(s): --sub-llm-max-turns: "), text
    limit = _bounds("sub_llm_max_turns")[1]
    assert limit is not None
    settings = settings_from_flags(build_parser().parse_args([*argv, str(int(limit))]), "run")
    spec = LlmBatchService(dispatcher=None).spec(_rollout(settings.rollout_options()), "b1")  # type: ignore[arg-type]
    assert spec.call.max_turns == limit


def test_the_root_models_timeout_is_one_setting_for_top_and_child_rollouts() -> None:
    """``RLMEnv`` and a worker hosting child rollouts make their root client with one function
    (:func:`rlmq.producer.host.root_model`), whose timeout is ``root_model_timeout``; the
    client's own default refers to the same declaration."""
    import inspect

    from rlmq.common.settings import build_settings
    from rlmq.producer import env
    from rlmq.producer.host import root_model
    from rlmq.producer.root import RootModel
    from rlmq.workers import child_host

    settings = build_settings({"base_url": "http://root:1/v1", "root_model_timeout": 42.5})
    assert root_model(settings, needed_for="-").client.timeout == 42.5
    assert inspect.signature(RootModel).parameters["timeout"].default == setting_default("root_model_timeout")
    for module in (env, child_host):  # neither makes a RootModel of its own
        source = inspect.getsource(module)
        assert "root_model(" in source and "RootModel(" not in source, module.__name__
    with pytest.raises(ConfigError, match="needs a base url"):
        root_model(build_settings({}), needed_for="needs a base url")
