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
from typing import Any

from pydantic import AliasChoices
from pydantic.fields import FieldInfo

__all__ = ["field_env_vars", "invalid_settings", "meta", "too_deep", "unreadable_variable", "variable_set"]


def meta(
    *,
    unit: str | None = None,
    flag: str | None = None,
    metavar: str | None = None,
    commands: tuple[str, ...] | None = None,
    required_by: tuple[str, ...] = (),
    default_text: str | None = None,
    aliases: tuple[str, ...] = (),
) -> dict[str, Any]:
    """What a field declares beyond its type, default and description (``json_schema_extra``).

    Every key is optional; :mod:`rlmq.common.settings_schema` derives what is left out.

    Args:
        unit: the unit of a number (``"completion tokens"``, ``"seconds"``, ``"characters"``).
        flag: the command-line flag when it is not ``--`` + the name with dashes.
        metavar: the flag's value placeholder when the unit does not name it.
        commands: the ``rlmq`` commands that take the flag (default by owner: rollout options
            ``run`` and ``demo``; worker options ``worker``; the process's own: none).
        required_by: commands on which the flag is required.
        default_text: what the default means, when its value does not say it (``None``).
        aliases: more flags for the same setting (short ones, as vf-eval's ``-n``, ``-r``, ``-S``).
    """
    out: dict[str, Any] = {"unit": unit, "flag": flag, "metavar": metavar, "default_text": default_text}
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
