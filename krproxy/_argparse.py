"""The argument parser every krproxy command line uses (krproxy, its subcommands, the fakes).

- Every option's help ends with its default (``(default: 0660)``, ``(default: off)`` for a
  switch) unless the help already says it.
- Abbreviated long options are refused: koord-runtime-proxy's flag names must match exactly,
  and ``--record`` must not quietly stand for ``--record-paused``.
- An option a subcommand does not know is reported with *that* subcommand's usage
  (``krproxy serve --bogus`` shows serve's), see :meth:`Parser.parse_known_args`.
- A misspelt option, subcommand or choice is answered with the nearest one
  (``unrecognized arguments: --hook-dirs (did you mean --hook-dir?)``), and an error shows a
  one-line usage where the full one would run over a few lines (``krproxy serve`` has some forty
  flags: nineteen lines of them hid the one line that mattered), with the ``--help`` to ask for.
"""

from __future__ import annotations

import argparse
import difflib
import math
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

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
        """As argparse's, but unknown options are reported by the subcommand they followed, each with
        the nearest option that subcommand has."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser: argparse.ArgumentParser = parsed._parser
            options = [o for o in parser._option_string_actions if o.startswith("--")]
            named = [_with_nearest(extra, options) if extra.startswith("--") else extra for extra in extras]
            parser.error(f"unrecognized arguments: {' '.join(named)}")
        return parsed

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        """argparse's check of a value against ``choices`` (subcommands too), naming the nearest choice."""
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(repr, action.choices))
            nearest = _nearest(str(value), [str(c) for c in action.choices])
            hint = f"did you mean {nearest!r}? " if nearest else ""
            raise argparse.ArgumentError(action, f"invalid choice: {value!r} ({hint}choose from {choices})")

    def error(self, message: str) -> NoReturn:
        """Print a usage (one line when the full one is long) and the error to stderr; exit 2."""
        usage = self.format_usage()
        if usage.count("\n") > _LONG_USAGE:
            usage = self._short_usage()
        sys.stderr.write(usage)
        self.exit(2, f"{self.prog}: error: {message}\n")

    def _short_usage(self) -> str:
        """``usage: krproxy serve [OPTIONS]`` with the positionals, and where the options are listed."""
        formatter = self._get_formatter()
        positionals = [
            formatter._format_args(action, action.dest.upper())
            for action in self._actions
            if not action.option_strings
        ]
        line = " ".join([self.prog, "[OPTIONS]", *positionals])
        return f"usage: {line}   ({self.prog} --help lists the options)\n"


#: Lines of usage above which an error shows the one-line form instead.
_LONG_USAGE = 3


def _nearest(word: str, candidates: Sequence[str]) -> str | None:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return close[0] if close else None


def _with_nearest(extra: str, options: Sequence[str]) -> str:
    """``--hook-dirs`` -> ``--hook-dirs (did you mean --hook-dir?)``; a value after ``=`` is ignored."""
    nearest = _nearest(extra.partition("=")[0], options)
    return f"{extra} (did you mean {nearest}?)" if nearest else extra


def choice_of(choices: Sequence[str]) -> Any:
    """An argparse ``type`` taking any case of ``choices`` (``--log-level=INFO`` or ``info``)."""
    by_folded = {c.casefold(): c for c in choices}

    def convert(text: str) -> str:
        return by_folded.get(text.casefold(), text)  # argparse's choices check reports the rest

    convert.__name__ = "choice"
    return convert
