"""How a setting is declared beyond its type and default, and how it is named in an error.

A part of :mod:`rlmq.common.settings` (the one declaration), kept apart so the declaration reads
on its own: :func:`meta` (a field's unit, flag, commands, ...) and the names a field is written
under (its ``RLMQ_*`` variables, an argument) in the one-line errors of invalid settings. The
functions take the settings' ``model_fields``, so nothing here imports the declaration.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from pydantic import AliasChoices, BaseModel
from pydantic.fields import FieldInfo

from rlmq.common.errors import ConfigError

__all__ = [
    "HELP_GROUPS", "field_env_vars", "invalid_settings", "meta", "too_deep", "unreadable_variable", "validated",
    "variable_set",
]  # fmt: skip


HELP_GROUPS: dict[str, str] = {
    "common": "common flags",
    "budget": "the sub-LLM budget",
    "recursion": "recursion (rlm_batch, --max-depth)",
    "sampling": "sampling",
    "repl": "REPL, tools, prompts and trajectories",
    "limits": "limits and timeouts",
    "worker": "worker tuning",
    "provider": "provider limits (shared by the whole fleet)",
    "fleet": "Redis, local workers, queues, metrics and checks",
}
"""The groups a command's ``--help`` shows its flags in, in this order (key: the name a field's
:func:`meta` gives as ``group``; value: the title). A field that names none is in ``limits``
(a rollout option), ``worker`` (a worker option) or ``fleet`` (the process's own); a flag a
command requires comes first, under ``required``, whatever its group."""


def meta(
    *,
    group: str | None = None,
    unit: str | None = None,
    flag: str | None = None,
    metavar: str | None = None,
    commands: tuple[str, ...] | None = None,
    required_by: tuple[str, ...] = (),
    default_text: str | None = None,
    aliases: tuple[str, ...] = (),
) -> dict[str, Any]:
    """What a field declares beyond its type, default and description (``json_schema_extra``).

    Every key is optional; :mod:`rlmq.common.settings.schema` derives what is left out.

    Args:
        group: the ``--help`` group of its flag, a key of :data:`HELP_GROUPS` (default by owner).
        unit: the unit of a number (``"completion tokens"``, ``"seconds"``, ``"characters"``).
        flag: the command-line flag when it is not ``--`` + the name with dashes.
        metavar: the flag's value placeholder when the unit does not name it.
        commands: the ``rlmq`` commands that take the flag (default by owner: rollout options
            ``run`` and ``demo``; worker options ``worker``; the process's own: none).
        required_by: commands on which the flag is required.
        default_text: what the default means, when its value does not say it (``None``).
        aliases: more flags for the same setting (short ones, as vf-eval's ``-n``, ``-r``, ``-S``).
    """
    if group is not None and group not in HELP_GROUPS:
        raise ValueError(f"meta(group={group!r}): not one of {sorted(HELP_GROUPS)}")
    out: dict[str, Any] = {
        "group": group, "unit": unit, "flag": flag, "metavar": metavar, "default_text": default_text
    }  # fmt: skip
    out = {k: v for k, v in out.items() if v is not None}
    if commands is not None:
        out["commands"] = list(commands)
    if required_by:
        out["required_by"] = list(required_by)
    if aliases:
        out["aliases"] = list(aliases)
    return out


def invalid_settings(
    exc: Any, fields: Mapping[str, FieldInfo], given: Iterable[str] = (), label: Callable[[str], str] = str
) -> str:
    """One line for a pydantic ``ValidationError`` of the settings whose ``fields`` are given, each error named as the
    user wrote it: ``label(field)`` for a field in ``given`` (a flag, an argument), the
    ``RLMQ_*`` variable for one set in the environment, else the field's name.

    Returns ``invalid setting(s): NAME: message; ...``; input values are never included.
    """
    given = set(given)
    parts = []
    for error in exc.errors(include_input=False):
        loc = error["loc"]
        field = _field_of(fields, str(loc[0])) if loc else None
        if field is None:
            name = ".".join(map(str, loc)) or "settings"
        elif field in given:
            name = label(field)
        else:
            name = variable_set(fields, field) or field
        parts.append(f"{name}: {str(error['msg']).removeprefix('Value error, ')}")
    return f"invalid setting(s): {'; '.join(parts)}"


def unreadable_variable(exc: Exception, fields: Mapping[str, FieldInfo]) -> str:
    """One line for an ``RLMQ_*`` variable the settings could not read: JSON nested past Python's
    recursion limit (``exc`` a :class:`RecursionError`), or not JSON (``exc`` pydantic-settings'
    ``SettingsError``, which names the field; its own message when it names none of ``fields``)."""
    if isinstance(exc, RecursionError):
        deep = next((v for v in os.environ if v.upper().startswith("RLMQ_") and too_deep(os.environ[v])), None)
        return f"invalid setting(s): {(deep or 'an RLMQ_* variable').upper()}: JSON nested too deeply"
    match = re.search(r'field "(\w+)"', str(exc))
    if match is None or match.group(1) not in fields:
        return str(exc)
    variable = variable_set(fields, match.group(1)) or match.group(1)
    return f'invalid setting(s): {variable}: not JSON (a list is written as JSON, e.g. ["a.b"])'


def _field_of(fields: Mapping[str, FieldInfo], loc: str) -> str | None:
    """The field an error location names (its name or one of its aliases)."""
    if loc in fields:
        return loc
    return next((name for name in fields if loc in field_env_vars(fields, name)), None)


def field_env_vars(fields: Mapping[str, FieldInfo], name: str) -> list[str]:
    """The environment variables of the field ``name``, first one first: ``RLMQ_<NAME>``, or
    the names its ``validation_alias`` lists (``REDIS_URL``, ...)."""
    alias = fields[name].validation_alias
    if isinstance(alias, AliasChoices):
        return [str(a) for a in alias.choices if isinstance(a, str)]
    if isinstance(alias, str):
        return [alias]
    return [f"RLMQ_{name.upper()}"]


def variable_set(fields: Mapping[str, FieldInfo], name: str) -> str | None:
    """The environment variable of the field ``name`` that is set (any case, as pydantic reads them)."""
    present = {k.upper() for k in os.environ}
    return next((v for v in field_env_vars(fields, name) if v.upper() in present), None)


def too_deep(text: str) -> bool:
    """Whether ``text`` is JSON nested past Python's recursion limit."""
    import json

    try:
        json.loads(text)
    except RecursionError:
        return True
    except ValueError:
        return False
    return False


_M = TypeVar("_M", bound=BaseModel)


def validated(
    model: type[_M], values: Mapping[str, Any], label: Callable[[str], str] = str, base: Mapping[str, Any] | None = None
) -> _M:
    """``model`` built from ``values`` (over ``base``, a dump of the settings they change; without
    it, over the ``RLMQ_*`` environment and the defaults), every error in one line.

    Raises:
        ConfigError: a key of ``values`` names no field, or a value is invalid (named as
            ``label(field)`` when given, else as its ``RLMQ_*`` variable), or an ``RLMQ_*``
            variable cannot be read.
    """
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    unknown = sorted(set(values) - set(model.model_fields))
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(label(n) for n in unknown)}")
    try:
        return model.model_validate({**base, **values}) if base is not None else model(**values)
    except ValidationError as exc:
        raise ConfigError(invalid_settings(exc, model.model_fields, values, label)) from exc
    except RecursionError as exc:  # an RLMQ_* variable of JSON nested past Python's recursion limit
        raise ConfigError(unreadable_variable(exc, model.model_fields)) from None
    except SettingsError as exc:  # an RLMQ_* variable that is not JSON
        raise ConfigError(unreadable_variable(exc, model.model_fields)) from exc
