"""krproxy's argument parser: a misspelling is answered with the nearest name, an error with a short usage."""

from __future__ import annotations

import pytest

from krproxy import cli
from krproxy._argparse import Parser

from .test_cli import _run


class TestNearest:
    @pytest.mark.parametrize(
        ("argv", "expected"),
        [
            (
                ["serve", "--remote-runtime-endpoint=/x"],
                "unrecognized arguments: --remote-runtime-endpoint=/x"
                " (did you mean --remote-runtime-service-endpoint?)",
            ),
            (["--hook-dirs", "/x"], "unrecognized arguments: --hook-dirs (did you mean --hook-dir?) /x"),
            (["trace", "show", "t.krt", "--jsn"], "unrecognized arguments: --jsn (did you mean --json?)"),
        ],
        ids=["serve", "implied-serve", "trace-show"],
    )
    def test_a_misspelt_flag_names_the_nearest(
        self, argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """An unknown flag is reported with the nearest flag of the subcommand it followed."""
        code, err = _run(argv, capsys)
        assert 2 == code
        assert expected in err

    @pytest.mark.parametrize(
        ("argv", "expected"),
        [
            (["serv"], "invalid choice: 'serv' (did you mean 'serve'? choose from "),
            (["hooks", "server"], "invalid choice: 'server' (did you mean 'serve'? choose from "),
            (["serve", "--log-level=warn"], "invalid choice: 'warn' (did you mean 'warning'? choose from "),
        ],
        ids=["command", "hooks-command", "choice"],
    )
    def test_a_misspelt_choice_names_the_nearest(
        self, argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A misspelt subcommand or choice is answered with the nearest one, and every choice."""
        code, err = _run(argv, capsys)
        assert 2 == code
        assert expected in err

    def test_nothing_near_adds_no_guess(self, capsys: pytest.CaptureFixture[str]) -> None:
        """A flag like none of the subcommand's is reported as it is."""
        code, err = _run(["serve", "--zzzzzz"], capsys)
        assert 2 == code
        assert err.rstrip().endswith("krproxy serve: error: unrecognized arguments: --zzzzzz")


class TestUsage:
    def test_a_long_usage_is_one_line(self, capsys: pytest.CaptureFixture[str]) -> None:
        """`krproxy serve`'s error shows one usage line pointing at --help, not its forty flags (nineteen
        lines before), then the error."""
        code, err = _run(["serve", "--bogus"], capsys)
        assert 2 == code
        assert 3 < cli.build_parser().parse_args(["serve"])._parser.format_usage().count("\n")  # long
        assert [
            "usage: krproxy serve [OPTIONS]   (krproxy serve --help lists the options)",
            "krproxy serve: error: unrecognized arguments: --bogus",
        ] == err.splitlines()

    def test_the_short_usage_keeps_the_positionals(self) -> None:
        """The one-line usage still names the positional arguments."""
        parser = Parser(prog="tool")
        for flag in range(30):
            parser.add_argument(f"--flag-{flag}", metavar="VALUE")
        parser.add_argument("files", nargs="+", metavar="FILE")
        assert (
            "usage: tool [OPTIONS] FILE [FILE ...]   (tool --help lists the options)\n"
            == parser._short_usage()
        )

    def test_a_short_usage_is_argparse_s(self, capsys: pytest.CaptureFixture[str]) -> None:
        """A usage of a few lines is shown whole, as argparse writes it."""
        code, err = _run(["hooks"], capsys)
        assert 2 == code
        assert err.startswith("usage: krproxy hooks [-h] COMMAND ...\n")
