"""The argument parser every krproxy command line uses (krproxy, its subcommands, the fakes).

- Every option's help ends with its default (``(default: 0660)``, ``(default: off)`` for a
  switch) unless the help already says it.
- Abbreviated long options are refused: koord-runtime-proxy's flag names must match exactly,
  and ``--record`` must not quietly stand for ``--record-paused``.
- An option a subcommand does not know is reported with *that* subcommand's usage
  (``krproxy serve --bogus`` shows serve's), see :meth:`Parser.parse_known_args`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

__all__ = ["HelpFormatter", "Parser", "above", "at_least", "choice_of"]


def _shown(default: Any) -> str:
    if default is None or default == "" or default == [] or default == ():
        return "none"
    if default is False:
        return "off"
    if default is True:
        return "on"
    if isinstance(default, (list, tuple)):
        return " ".join(str(getattr(d, "value", d)) for d in default)
    return str(default)


def _number(text: str, kind: type[int] | type[float]) -> int | float:
    try:
        return kind(text)
    except ValueError:
        noun = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"must be {noun}, not {text!r}") from None


def at_least(minimum: int, kind: type[int] | type[float] = int) -> Any:
    """An argparse ``type`` for a number not below ``minimum``: the error names the flag (argparse
    prefixes ``argument --flag:``) and the bound, as ``must be at least 0, not '-1'``."""

    def convert(text: str) -> int | float:
        value = _number(text, kind)
        if math.isnan(value):  # compares with nothing: it would pass the bound (a timeout raises at use)
            raise argparse.ArgumentTypeError(f"must be a number, not {text!r}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {text!r}")
        return value

    return convert


def above(minimum: float) -> Any:
    """An argparse ``type`` for a finite number greater than ``minimum`` (a deadline, a speed): as
    :func:`at_least`, ``must be a finite number above 0, not 'nan'``."""

    def convert(text: str) -> float:
        value = _number(text, float)
        if not minimum < value < math.inf:
            raise argparse.ArgumentTypeError(f"must be a finite number above {minimum:g}, not {text!r}")
        return value

    return convert


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, with each option's default appended to its help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not action.option_strings
            or action.default is argparse.SUPPRESS
            or "default" in text
            or isinstance(action, (argparse._HelpAction, argparse._VersionAction))
        ):
            return action.help
        shown = _shown(action.default).replace("%", "%%")
        return f"{text} (default: {shown})".lstrip()


class Parser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` with krproxy's rules (see the module docstring).

    Subparsers made with ``add_subparsers().add_parser(...)`` are of this class too.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """As argparse's; the namespace also names, as ``_parser``, the innermost parser used."""
        parsed, extras = super().parse_known_args(args, namespace)
        if not hasattr(parsed, "_parser"):  # a subcommand's parser ran first and set itself
            parsed._parser = self
        return parsed, extras

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """As argparse's, but unknown options are reported by the subcommand they followed."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser: argparse.ArgumentParser = parsed._parser
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def choice_of(choices: Sequence[str]) -> Any:
    """An argparse ``type`` taking any case of ``choices`` (``--log-level=INFO`` or ``info``)."""
    by_folded = {c.casefold(): c for c in choices}

    def convert(text: str) -> str:
        return by_folded.get(text.casefold(), text)  # argparse's choices check reports the rest

    convert.__name__ = "choice"
    return convert
