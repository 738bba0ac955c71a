"""Every setting as one record, read from its declaration in :mod:`rlmq.common.settings`.

The ``rlmq`` flags (:mod:`rlmq.cli.flags`), the ``RLMEnv`` arguments, the verifiers harness
knobs and ``docs/settings.md`` are all derived from :func:`knobs`, which reads nothing but
the pydantic fields of :class:`~rlmq.common.settings.Settings` (type, default, description,
constraints) and the :func:`~rlmq.common.settings.meta` a field may add. A field declared as a
plain ``Field(default, description=...)`` gets its flag, environment variable and commands
from its name and owner.

``python -m rlmq.common.settings.schema`` prints ``docs/settings.md``.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, create_model
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rlmq.common.settings import RolloutOptions, Settings, env_vars
from rlmq.common.settings.worker import WorkerOptions

Owner = Literal["rollout", "worker", "process"]
COMMANDS_OF: dict[Owner, tuple[str, ...]] = {"rollout": ("run", "demo"), "worker": ("worker",), "process": ()}
"""The commands whose flags a field gets when its :func:`meta` names none, by owner."""
_DEFAULT_GROUP: dict[Owner, str] = {"rollout": "limits", "worker": "worker", "process": "fleet"}
_METAVAR_OF_UNIT = {"seconds": "SECONDS", "completion tokens": "TOKENS", "characters": "CHARS", "bytes": "BYTES"}


@dataclass(frozen=True)
class Knob:
    """One setting, everything the derived interfaces need.

    Attributes:
        name: the field's name (an ``RLMEnv`` argument, a harness knob).
        owner: ``rollout`` (:class:`RolloutOptions`), ``worker`` (:class:`WorkerOptions`) or
            ``process`` (the connections and secrets of :class:`Settings`).
        annotation: the field's type.
        field: the pydantic field (default, constraints, description).
        flag: its command-line flag (``--max-turns``).
        commands: the ``rlmq`` commands that take the flag.
        env: its environment variables, the first one first.
    """

    name: str
    owner: Owner
    annotation: Any
    field: FieldInfo
    flag: str
    commands: tuple[str, ...]
    env: tuple[str, ...]

    @property
    def extra(self) -> dict[str, Any]:
        """The field's :func:`~rlmq.common.settings.meta` (empty when it declares none)."""
        extra = self.field.json_schema_extra
        return dict(extra) if isinstance(extra, dict) else {}

    @property
    def description(self) -> str:
        """The help text (the field's ``description``; empty when it has none)."""
        return self.field.description or ""

    @property
    def unit(self) -> str | None:
        """The unit of a number (``seconds``, ``completion tokens``), if declared."""
        unit = self.extra.get("unit")
        return str(unit) if unit is not None else None

    @property
    def base_type(self) -> Any:
        """The annotation without ``| None``."""
        args = [a for a in typing.get_args(self.annotation) if a is not type(None)]
        if isinstance(self.annotation, types.UnionType) or typing.get_origin(self.annotation) is typing.Union:
            return args[0] if len(args) == 1 else self.annotation
        return self.annotation

    @property
    def choices(self) -> tuple[str, ...] | None:
        """The values of a ``Literal`` setting, else ``None``."""
        base = self.base_type
        return tuple(typing.get_args(base)) if typing.get_origin(base) is Literal else None

    @property
    def is_list(self) -> bool:
        """A list setting: its flag is repeatable, its variable is JSON."""
        return typing.get_origin(self.base_type) is list

    @property
    def scalar(self) -> type:
        """The Python type a flag's text is converted to: ``int``, ``float``, ``bool`` or ``str``."""
        base = self.base_type
        if self.choices is not None or self.is_list or base is SecretStr:
            return str
        return base if base in (int, float, bool) else str

    @property
    def metavar(self) -> str | None:
        """The flag's value placeholder (``None`` for choices and switches)."""
        if self.choices is not None or self.scalar is bool:
            return None
        explicit = self.extra.get("metavar")
        if explicit:
            return str(explicit)
        if self.unit in _METAVAR_OF_UNIT:
            return _METAVAR_OF_UNIT[self.unit]
        return {int: "N", float: "X"}.get(self.scalar, "TEXT")

    @property
    def default(self) -> Any:
        """The default value (a fresh one for a ``default_factory``)."""
        if self.field.default_factory is not None:
            return self.field.default_factory()  # type: ignore[call-arg]
        return None if self.field.default is PydanticUndefined else self.field.default

    @property
    def default_text(self) -> str:
        """The default as a user reads it (``50``, ``no budget``, ``off``)."""
        explicit = self.extra.get("default_text")
        if explicit:
            return str(explicit)
        value = self.default
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, float):
            return f"{value:g}"
        if isinstance(value, SecretStr):
            return value.get_secret_value()
        if value is None or value == []:
            return "unset"
        return str(value)

    @property
    def aliases(self) -> tuple[str, ...]:
        """More flags for the setting (``-n``), as its :func:`~rlmq.common.settings.meta` declares."""
        return tuple(str(a) for a in self.extra.get("aliases", ()))

    @property
    def group(self) -> str:
        """The ``--help`` group of its flag (a key of :data:`~rlmq.common.settings.fields.HELP_GROUPS`): its
        :func:`~rlmq.common.settings.meta` ``group``, else ``limits``, ``worker`` or ``fleet`` by owner."""
        return str(self.extra.get("group") or _DEFAULT_GROUP[self.owner])

    def required_by(self, command: str) -> bool:
        """Whether ``command`` requires the flag."""
        return command in self.extra.get("required_by", ())

    def help(self) -> str:
        """The flag's help: description, unit, default and variable (``%`` escaped for argparse)."""
        unit = f"{self.unit}; " if self.unit else ""
        text = f"{self.description} ({unit}default: {self.default_text}; env {self.env[0]})"
        return text.replace("%", "%%")


def _owner(name: str) -> Owner:
    if name in RolloutOptions.model_fields:
        return "rollout"
    if name in WorkerOptions.model_fields:
        return "worker"
    return "process"


def knobs() -> list[Knob]:
    """Every :class:`Settings` field as a :class:`Knob`, in declaration order."""
    out = []
    for name, field in Settings.model_fields.items():
        owner = _owner(name)
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        commands = extra.get("commands")
        out.append(
            Knob(
                name=name,
                owner=owner,
                annotation=field.annotation,
                field=field,
                flag=str(extra.get("flag") or "--" + name.replace("_", "-")),
                commands=tuple(str(c) for c in commands) if isinstance(commands, list) else COMMANDS_OF[owner],
                env=tuple(env_vars(name)),
            )
        )
    return out


def knob(name: str) -> Knob:
    """The :class:`Knob` of the field ``name``.

    Raises:
        KeyError: no such field.
    """
    for k in knobs():
        if k.name == name:
            return k
    raise KeyError(name)


def arguments_doc(names: Iterable[str], indent: int = 8) -> str:
    """The ``Args:`` lines of the settings ``names`` for a docstring: ``name: description
    (unit; default: ...)``, from the declaration (so no docstring restates a default by hand).
    Each line is indented by ``indent`` spaces."""
    pad = " " * indent
    lines = []
    for name in names:
        k = knob(name)
        unit = f"{k.unit}; " if k.unit else ""
        lines.append(f"{pad}{name}: {k.description} ({unit}default: {k.default_text}).")
    return "\n".join(lines)


def unset_model(name: str, owner: Owner = "rollout") -> type[BaseModel]:
    """A pydantic model with every ``owner`` setting as an optional field whose default
    ``None`` means "not given": the ``RLMQ_*`` variable or the default decides. Type and help
    text (unit, default, variable) come from the declaration; the value is checked by
    :class:`~rlmq.common.settings.Settings` when it is used (the verifiers harness knobs)."""
    fields: dict[str, Any] = {}
    for k in knobs():
        if k.owner == owner:
            unit = f"{k.unit}; " if k.unit else ""
            text = f"{k.description} ({unit}unset: {k.env[0]}, else {k.default_text})"
            # A JSON object (sampling arguments) comes as text from a command line (vf-eval's);
            # Settings parses and checks it.
            kind = k.annotation | str if typing.get_origin(k.base_type) is dict else k.annotation
            fields[k.name] = (kind | None, Field(None, description=text))
    model: type[BaseModel] = create_model(name, **fields)
    return model


def markdown() -> str:
    """``docs/settings.md``: every setting with its flag, variable, default and unit."""
    lines = [
        "# Settings",
        "",
        "Generated from `common/settings/` by `python -m rlmq.common.settings.schema > docs/settings.md`;",
        "a test fails when this file and the declaration differ.",
        "",
        "One precedence on every path: an explicit value (a flag, an `RLMEnv` argument, a",
        "`--env.agent.harness.*` knob of the verifiers harness) > its environment variable > the default.",
        "Every rollout option is also an `RLMEnv` argument and a harness knob of the same name (the harness's",
        "`max_depth` has the meaning of verifiers' `rlm` harness, one less: [verifiers.md](verifiers.md)). A list",
        "is written as JSON in its variable (`RLMQ_SUB_TOOLS='[\"a.b\"]'`); a flag of a list is repeated.",
        "",
    ]
    titles = {
        "rollout": "Rollout options (per rollout; travel with it)",
        "worker": "Worker options (`rlmq worker`)",
        "process": "Connections and the process's own",
    }
    for owner in ("rollout", "worker", "process"):
        lines += [f"## {titles[owner]}", "", "| setting | flag | variable | default | unit | meaning |"]
        lines.append("|---|---|---|---|---|---|")
        for k in knobs():
            if k.owner != owner:
                continue
            flag = f"`{k.flag}` ({', '.join(k.commands)})" if k.commands else "-"
            env = ", ".join(f"`{v}`" for v in k.env)
            meaning = k.description.replace("|", "\\|")
            lines.append(f"| `{k.name}` | {flag} | {env} | {k.default_text} | {k.unit or '-'} | {meaning} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    print(markdown(), end="")
