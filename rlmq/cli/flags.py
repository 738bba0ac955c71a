"""The settings flags of the ``rlmq`` commands, generated from the settings declaration.

Every field of :class:`~rlmq.common.settings.Settings` whose commands include a command is
a flag of it (:func:`~rlmq.common.settings.schema.knobs`): its name, type, choices, help
(with unit, default and variable) and metavar come from the field. A flag left out is
``None`` in the parsed arguments, so the ``RLMQ_*`` variable or the default decides.
"""

from __future__ import annotations

import argparse
import math
import typing
from collections.abc import Callable
from typing import Any

from rlmq.common.settings import Settings, build_settings
from rlmq.common.settings.fields import HELP_GROUPS
from rlmq.common.settings.schema import Knob, knobs

REQUIRED_GROUP = "required flags"
SETTINGS_NOTE = "(a flag > its RLMQ_* variable > the default)"


def help_group(parser: argparse.ArgumentParser, name: str) -> Any:
    """The argument group ``name`` of ``parser`` (``required`` or a key of
    :data:`~rlmq.common.settings.fields.HELP_GROUPS`), made on first use; every group is made at once,
    in the order ``--help`` shows them (empty ones are not shown).

    Raises:
        KeyError: ``name`` is not a group.
    """
    groups: dict[str, Any] | None = getattr(parser, "_rlmq_groups", None)
    if groups is None:
        groups = {"required": parser.add_argument_group(REQUIRED_GROUP)}
        for key, title in HELP_GROUPS.items():
            note = SETTINGS_NOTE if key == "common" else None
            groups[key] = parser.add_argument_group(title, note)
        parser._rlmq_groups = groups  # type: ignore[attr-defined]
    return groups[name]


class Parser(argparse.ArgumentParser):
    """An ``argparse`` parser whose error is one line naming the flag (exit code 2, as argparse's)."""

    def error(self, message: str) -> typing.NoReturn:
        """Print ``<prog>: <message> (<prog> --help lists the flags)`` to stderr; exit 2."""
        self.exit(2, f"{self.prog}: {message} ({self.prog} --help lists the flags)\n")


def bounded(
    kind: type[int] | type[float], low: float, high: float = math.inf, *, above: bool = False
) -> Callable[[str], Any]:
    """An argparse ``type`` for a command's own number flag: ``kind`` of the text, checked to be
    ``>= low`` (``> low`` when ``above``) and ``<= high``; NaN and infinities are refused.

    A bad value is argparse's one line naming the flag (exit 2), before anything starts.
    """

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if kind is int else ''}number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value < low or (above and value == low):
            raise argparse.ArgumentTypeError(f"must be {'above' if above else 'at least'} {low:g}, not {text}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high:g}, not {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


PORT = bounded(int, 0, 65535)
"""A TCP port flag (0: any free port)."""


def add_settings_flags(parser: argparse.ArgumentParser, command: str) -> list[Knob]:
    """Add a flag to ``parser`` for every setting ``command`` takes; return those settings.

    Raises:
        argparse.ArgumentError: a flag is already on the parser (a setting flag written by hand).
    """
    taken = [k for k in knobs() if command in k.commands]
    for k in taken:
        group = help_group(parser, "required" if k.required_by(command) else k.group)
        kwargs: dict[str, Any] = {"dest": k.name, "default": None, "help": k.help()}
        if k.scalar is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif k.is_list:
            kwargs.update(action="append", metavar=k.metavar)
        elif k.choices is not None:
            kwargs["choices"] = list(k.choices)
        else:
            kwargs.update(type=k.scalar, metavar=k.metavar)
        if k.required_by(command):
            kwargs["required"] = True
        group.add_argument(k.flag, *k.aliases, **kwargs)
    return taken


def flag_values(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The settings given as flags of ``command`` (field name -> value), leaving out those not given."""
    values = {k.name: getattr(args, k.name, None) for k in knobs() if command in k.commands}
    return {name: value for name, value in values.items() if value is not None}


def flag_label(name: str) -> str:
    """How the command line names the setting ``name`` in an error: its flag."""
    return next((k.flag for k in knobs() if k.name == name), name)


def settings_from_flags(args: argparse.Namespace, command: str, **extra: Any) -> Settings:
    """:class:`Settings` from the flags of ``command`` given in ``args`` and ``extra`` (field
    name -> value, e.g. a command's own fixed choice) over the ``RLMQ_*`` variables.

    Raises:
        ConfigError: a bad value, one line naming its flag (or its variable).
    """
    return build_settings({**flag_values(args, command), **extra}, label=flag_label)
