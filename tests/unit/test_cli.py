"""The command lines explain themselves, and refuse bad input with a message that says how to fix it.

Every test here stops before a daemon would run: at argument parsing, or at a start-up check.
"""

from __future__ import annotations

import argparse
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from krproxy import _argparse, cli, config
from krproxy.fakes.containerd.__main__ import _parser as fake_containerd_parser
from krproxy.fakes.plugin.__main__ import _parser as fake_plugin_parser
from krproxy.unixsock import SocketInUseError, bind_unix_socket


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every subcommand's parser below it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def _options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        if action.option_strings and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield action


ALL_PARSERS = [
    *_parsers(cli.build_parser()),
    fake_containerd_parser(),
    fake_plugin_parser(),
]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``krproxy ARGV`` in this process: (exit status, stderr)."""
    try:
        code = cli.main(argv)
    except SystemExit as stop:
        code = int(stop.code or 0)
    return code, capsys.readouterr().err


class TestHelp:
    @pytest.mark.parametrize("parser", ALL_PARSERS, ids=lambda p: p.prog)
    def test_every_option_has_help_and_shows_its_default(self, parser: argparse.ArgumentParser) -> None:
        """Each option of each (sub)command has help text, and that text shows its default."""
        formatter = parser._get_formatter()
        assert isinstance(formatter, _argparse.HelpFormatter)
        lacking = [
            action.option_strings[-1]
            for action in _options(parser)
            if not action.help or "default" not in (formatter._get_help_string(action) or "")
        ]
        assert [] == lacking

    def test_a_switch_shows_off_and_a_value_its_default(self) -> None:
        """``(default: off)`` for a switch, the value (with a literal %) otherwise."""
        parser = _argparse.Parser(prog="t")
        parser.add_argument("--flag", action="store_true", help="a switch")
        parser.add_argument("--ratio", default="50%", help="a share")
        text = parser.format_help()
        assert "a switch (default: off)" in text
        assert "a share (default: 50%)" in text

    def test_an_empty_default_shows_none(self) -> None:
        """An option whose default is the empty string shows ``(default: none)``, not ``(default: )``."""
        parser = _argparse.Parser(prog="t")
        parser.add_argument("--record", default="", help="a file")
        assert "a file (default: none)" in " ".join(parser.format_help().split())

    def test_hooks_serve_lists_the_stages_it_can_disable(self) -> None:
        """`krproxy hooks serve --help` names the valid --disable-stages values."""
        [hooks_serve] = [p for p in ALL_PARSERS if p.prog == "krproxy hooks serve"]
        assert "PreCreateContainer" in " ".join(hooks_serve.format_help().split())

    def test_top_level_help_says_flags_alone_mean_serve(self, capsys: pytest.CaptureFixture[str]) -> None:
        """`krproxy --help` tells that flags without a command mean `krproxy serve`."""
        with pytest.raises(SystemExit) as stop:
            cli.main(["--help"])
        assert 0 == stop.value.code
        assert "Flags without a COMMAND mean `krproxy serve`" in " ".join(capsys.readouterr().out.split())


class TestParsing:
    def test_hooks_without_a_command_shows_hooks_usage(self, capsys: pytest.CaptureFixture[str]) -> None:
        """`krproxy hooks` says a COMMAND is required, with hooks' usage, not an internal name."""
        code, err = _run(["hooks"], capsys)
        assert 2 == code
        assert "hooks_command" not in err
        assert "usage: krproxy hooks [-h] COMMAND" in err
        assert "the following arguments are required: COMMAND" in err

    @pytest.mark.parametrize("argv", [["serve", "--bogus"], ["--hook-dir=/x", "--bogus"]])
    def test_an_unknown_flag_after_serve_shows_serves_usage(
        self, argv: list[str], capsys: pytest.CaptureFixture[str]
    ) -> None:
        """An unknown option is reported by serve, with serve's usage (also when serve is implied)."""
        code, err = _run(argv, capsys)
        assert 2 == code
        assert "usage: krproxy serve" in err
        assert "krproxy serve: error: unrecognized arguments: --bogus" in err

    def test_an_unknown_flag_after_trace_show_shows_its_usage(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Nested subcommands too: the innermost parser reports it."""
        code, err = _run(["trace", "show", "x.krt", "--bogus"], capsys)
        assert 2 == code
        assert "krproxy trace show: error: unrecognized arguments: --bogus" in err

    @pytest.mark.parametrize(
        "argv", [["serve", "--record-k", "3"], ["serve", "--koord-runtimeproxy", "/x.sock"]]
    )
    def test_abbreviated_flags_are_refused(self, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
        """A prefix of a long flag is not taken for the flag (koord-runtime-proxy's names must match)."""
        code, err = _run(argv, capsys)
        assert 2 == code
        assert f"unrecognized arguments: {argv[1]}" in err

    @pytest.mark.parametrize("given", ["DEBUG", "Debug", "debug"])
    def test_log_level_takes_any_case(self, given: str) -> None:
        """--log-level is case-insensitive in krproxy and in the fakes, each keeping its own spelling."""
        parser = cli.build_parser()
        assert "debug" == parser.parse_args(["serve", f"--log-level={given}"]).log_level
        assert "debug" == parser.parse_args(["demo", f"--log-level={given}"]).log_level
        assert (
            "DEBUG" == fake_containerd_parser().parse_args(["--socket=/s", f"--log-level={given}"]).log_level
        )
        plugin_args = ["--socket=/s", "--hook-dir=/h", f"--log-level={given}"]
        assert "DEBUG" == fake_plugin_parser().parse_args(plugin_args).log_level

    def test_a_wrong_log_level_still_lists_the_choices(self, capsys: pytest.CaptureFixture[str]) -> None:
        code, err = _run(["serve", "--log-level=loud"], capsys)
        assert 2 == code
        assert "invalid choice: 'loud'" in err
        assert "'debug', 'info', 'warning', 'error'" in err


@pytest.mark.parametrize("command", ["serve", "nri"])
def test_the_shared_flags_reach_either_config(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``serve`` and ``nri`` hand their shared flags (hook dir, skip label, admin, required servers) to their
    configuration alike."""
    from krproxy import config
    from krproxy.nri import plugin

    seen: dict[str, object] = {}

    def record(**fields: object) -> None:
        seen.update(fields)
        raise ValueError("stop before starting")

    monkeypatch.setattr(config, "ProxyConfig", record)
    monkeypatch.setattr(plugin, "NriConfig", record)
    flags = ["--hook-dir=/h", "--runtime-hook-server-key=k", "--runtime-hook-server-val=v"]
    flags += ["--insecure-registration-files", "--metrics-address=127.0.0.1:9", "--metrics-allow-remote"]
    code, err = _run([command, *flags, "--required-hook-server=koordlet"], capsys)

    assert (2, "stop before starting") == (code, err.strip().rpartition(": ")[2])
    requirements = seen.pop("requirements")
    shared = {k: seen[k] for k in ("hook_dir", "skip_label", "insecure_registration_files")}
    shared |= {k: seen[k] for k in ("metrics_address", "metrics_allow_remote")}
    assert {
        "hook_dir": "/h",
        "skip_label": ("k", "v"),
        "insecure_registration_files": True,
        "metrics_address": "127.0.0.1:9",
        "metrics_allow_remote": True,
    } == shared
    assert ["koordlet"] == [server.name for server in requirements.servers]  # type: ignore[attr-defined]


class TestServeRefuses:
    """Bad paths are refused before anything starts, naming the flag and what to do."""

    def test_a_relative_hook_dir(self, capsys: pytest.CaptureFixture[str]) -> None:
        code, err = _run(["serve", "--hook-dir=hooks.d"], capsys)
        assert 2 == code
        assert "--hook-dir: a directory must be an absolute path, not 'hooks.d'" in err

    def test_a_relative_oci_hooks_dir(self, capsys: pytest.CaptureFixture[str]) -> None:
        code, err = _run(["serve", "--oci-hooks-dir=hooks.d"], capsys)
        assert 2 == code
        assert "--oci-hooks-dir: a directory must be an absolute path" in err

    @pytest.mark.parametrize(
        ("argv", "expected"),
        [
            (
                ["--max-request-message-size=0"],
                "argument --max-request-message-size: must be at least 1024, not '0'",
            ),
            (["--record-max-bytes=-1"], "argument --record-max-bytes: must be at least 0, not '-1'"),
            (["--record-keep=-1"], "argument --record-keep: must be at least 0, not '-1'"),
            (["--grace-period=-1"], "argument --grace-period: must be at least 0, not '-1'"),
            (["--grace-period=nan"], "argument --grace-period: must be a number, not 'nan'"),
            (
                ["--required-startup-grace=nan"],
                "argument --required-startup-grace: must be a number, not 'nan'",
            ),
            (["--record-keep=many"], "argument --record-keep: must be a whole number, not 'many'"),
            (["--metrics-address=localhost"], "argument --metrics-address: 'localhost' is not HOST:PORT"),
            (
                ["--metrics-address=127.0.0.1:99999"],
                "argument --metrics-address: '127.0.0.1:99999': the port",
            ),
        ],
    )
    def test_a_bad_number_or_address_names_its_flag(
        self, argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """An out-of-range number or a malformed address is refused naming the flag as written
        (it used to name the attribute, ``'record_keep' must be >= 0: -1``, or no flag at all)."""
        code, err = _run(["serve", *argv], capsys)
        assert 2 == code
        assert f"krproxy serve: error: {expected}" in err

    @pytest.mark.parametrize(
        "flag",
        [
            "--koord-runtimeproxy-endpoint",
            "--remote-runtime-service-endpoint",
            "--remote-image-service-endpoint",
        ],
    )
    def test_a_socket_path_too_long(
        self, flag: str, short_tmp: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A path a unix socket cannot have is refused at start, naming flag and path; no directory is made."""
        parent = short_tmp / ("d" * 60)
        path = parent / ("s" * 60 + ".sock")
        code, err = _run(["serve", f"{flag}=unix://{path}"], capsys)
        assert 2 == code
        assert f"krproxy serve: error: {flag}: '{path}' is {len(str(path))} bytes long" in err
        assert "choose a shorter path" in err
        assert not parent.exists()

    def test_a_record_file_that_cannot_be_written(
        self, short_tmp: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """--record into a directory that does not exist refuses to start (it used to run unrecorded)."""
        listen = short_tmp / "p.sock"
        trace = short_tmp / "missing" / "t.krt"
        code, err = _run(["serve", f"--koord-runtimeproxy-endpoint={listen}", f"--record={trace}"], capsys)
        assert 2 == code
        assert f"--record {trace}: cannot write the trace file (No such file or directory)" in err
        assert not listen.exists()

    def test_a_listen_path_whose_directory_cannot_be_made(
        self, short_tmp: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A parent that is a file: the error names the flag and the path."""
        listen = short_tmp / "made" / "file" / "p.sock"
        os.makedirs(short_tmp / "made")
        (short_tmp / "made" / "file").write_text("")
        code, err = _run(["serve", f"--koord-runtimeproxy-endpoint={listen}"], capsys)
        assert 1 == code
        assert "event=startup_failed flag=--koord-runtimeproxy-endpoint" in err
        assert str(listen.parent) in err

    def test_a_metrics_address_in_use_says_what_to_do(
        self, short_tmp: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Another process on --metrics-address: the message names the flag and the address and says
        what to do; neither the proxy socket nor its new directory is left behind (the socket file
        was, and the message had ``path=""`` and only ``Address already in use``)."""
        listen = short_tmp / "new" / "p.sock"
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            address = f"127.0.0.1:{taken.getsockname()[1]}"
            code, err = _run(
                ["serve", f"--koord-runtimeproxy-endpoint={listen}", f"--metrics-address={address}"], capsys
            )
        assert 1 == code
        assert f"event=startup_failed flag=--metrics-address address={address}" in err
        assert "another process listens there: stop it, or choose another --metrics-address" in err
        assert not listen.parent.exists()

    def test_a_socket_in_use_says_so_in_full(
        self, short_tmp: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Another process listening: the message is whole and says what to do."""
        listen = str(short_tmp / "p.sock")
        other = bind_unix_socket(listen)
        try:
            code, err = _run(["serve", f"--koord-runtimeproxy-endpoint={listen}"], capsys)
        finally:
            other.close()
        assert 1 == code
        assert "event=socket_in_use" in err
        assert (
            "another process is listening on this socket: stop that process first, or choose another" in err
        )


class TestBindUnixSocket:
    def test_a_failed_bind_names_the_path_and_leaves_no_directory(self, short_tmp: Path) -> None:
        """Binding a path too long for a unix socket: the OSError names it, the new directories are gone."""
        top = short_tmp / "a"
        path = str(top / "b" / ("c" * 120))
        with pytest.raises(OSError) as raised:
            bind_unix_socket(path)
        assert path == raised.value.filename
        assert not top.exists()

    def test_the_file_appears_listening_with_its_mode(self, short_tmp: Path) -> None:
        """Bound under a temporary name and renamed once listening: only the socket itself is left,
        with the mode asked for, and it accepts a connection."""
        path = short_tmp / "s.sock"
        sock = bind_unix_socket(str(path), mode=0o600)
        try:
            assert ["s.sock"] == sorted(os.listdir(short_tmp))
            assert 0o600 == stat.S_IMODE(os.stat(path).st_mode)
            probe = socket.socket(socket.AF_UNIX)
            probe.connect(str(path))
            probe.close()
        finally:
            sock.close()

    def test_a_path_taken_while_binding_is_not_replaced(
        self, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Two daemons starting at once: the one that loses the race gets SocketInUseError and
        leaves the winner's socket (and no temporary file) in place."""
        path = short_tmp / "s.sock"
        winner: list[socket.socket] = []
        listen = socket.socket.listen

        def listen_after_a_rival(self: socket.socket, backlog: int) -> None:
            listen(self, backlog)
            if not winner:  # another process binds the path between our bind and our link
                winner.append(socket.socket(socket.AF_UNIX))
                winner[0].bind(str(path))
                listen(winner[0], 1)

        monkeypatch.setattr(socket.socket, "listen", listen_after_a_rival)
        try:
            with pytest.raises(SocketInUseError):
                bind_unix_socket(str(path))
            assert ["s.sock"] == os.listdir(short_tmp)
            probe = socket.socket(socket.AF_UNIX)
            probe.connect(str(path))  # reaches the winner, not a socket of ours
            winner[0].settimeout(5)
            accepted, _ = winner[0].accept()
            accepted.close()
            probe.close()
        finally:
            for sock in winner:
                sock.close()

    def test_a_live_socket_is_not_taken_over(self, short_tmp: Path) -> None:
        path = str(short_tmp / "s.sock")
        first = bind_unix_socket(path)
        try:
            with pytest.raises(OSError, match="another process is listening on this socket"):
                bind_unix_socket(path)
            probe = socket.socket(socket.AF_UNIX)
            probe.connect(path)  # still the first one's
            probe.close()
        finally:
            first.close()


def test_trace_replay_runs_without_grpcio(tmp_path: Path) -> None:
    """`krproxy trace replay` needs no grpcio (it used to, from an extra): with grpcio unimportable
    it replays, here to a socket that takes connections and never answers, every call cut at its
    deadline (exit 1)."""
    trace = Path(__file__).resolve().parents[1] / "data" / "traces" / "fake-lifecycle.krt"
    target = str(tmp_path / "x.sock")
    code = (
        "import sys; sys.modules['grpc'] = None\n"
        "from krproxy import cli\n"
        f"sys.exit(cli.main(['trace', 'replay', {str(trace)!r}, '--target', {target!r}, '--progress', 'never', "
        "'--timeout', '0.2']))"
    )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.bind(target)
        silent.listen(4)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert 1 == done.returncode, done.stderr
    assert 'status: recorded "OK", replay "DEADLINE_EXCEEDED"' in done.stdout
    assert done.stdout.rstrip().endswith(
        "MISMATCH 18 calls: 0 identical, 18 different, 0 skipped; 0 ids mapped"
    )


#: What ``krproxy status`` (the DaemonSets' probe) has no use for: the event loop, protobuf, the SDK,
#: the trace tools, and the hook server's policy files.
_NOT_FOR_STATUS = ("trio", "google.protobuf", "betterproto2", "yaml", "krproxy.hookserver", "krproxy.trace")


def test_status_loads_none_of_the_daemons_machinery() -> None:
    """`krproxy status` parses its command line without the hooks and trace parsers, whose modules
    load trio, protobuf and the SDK (2 to 3 s of a probe's 5 s on a loaded node): none is imported."""
    code = (
        "import sys\n"
        "from krproxy import cli\n"
        "code = cli.main(['status', '--metrics-address', '127.0.0.1:1', '--timeout', '0.5'])\n"
        f"print(code, sorted(m for m in sys.modules if m.startswith({_NOT_FOR_STATUS!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "2 []" == done.stdout.strip(), done.stderr  # 2: nothing listens there


@pytest.mark.parametrize(("command", "other"), [("status", "hooks"), ("hooks", "trace"), ("trace", "hooks")])
def test_a_command_s_help_is_the_same_alone(command: str, other: str) -> None:
    """A command's parser built for that command alone formats the help it has in the whole command
    line's parser, and the parser built for it leaves out a command it does not need."""
    whole = cli.build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    alone = cli.build_parser(command)._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert whole[command].format_help() == alone[command].format_help()
    assert other not in alone


def test_a_misspelt_command_still_gets_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    """A first word that names no subcommand gets the whole parser, whose error suggests one."""
    with pytest.raises(SystemExit):
        cli.main(["tarce", "show"])
    assert "did you mean 'trace'?" in capsys.readouterr().err


class TestStartupFailedNamesTheFlag:
    def test_a_default_path_is_named_with_its_value(self) -> None:
        """A non-root ``krproxy serve`` failing on a default path (the listen socket's directory under
        /var/run, the hook dir under /etc): ``flag=`` names the flag and ``default=`` the default it
        used (it said ``flag=""``)."""
        args = cli.build_parser().parse_args(["serve"])
        cfg = config.ProxyConfig(listen=args.listen, runtime_endpoint=args.runtime, hook_dir=args.hook_dir)
        listen_dir = os.path.dirname(cfg.listen)
        said = {"flag": "--koord-runtimeproxy-endpoint", "default": cfg.listen}
        assert said == cli._flag_of(listen_dir, cfg, args)
        assert {"flag": "--hook-dir", "default": cfg.hook_dir} == cli._flag_of(cfg.hook_dir, cfg, args)
        assert {"flag": ""} == cli._flag_of("/somewhere/else", cfg, args)

    def test_a_given_path_is_named_without_default(self, short_tmp: Path) -> None:
        """A path the user gave is named with its value, not called the default."""
        hooks = str(short_tmp / "hooks")
        args = cli.build_parser().parse_args(["serve", f"--hook-dir={hooks}"])
        cfg = config.ProxyConfig(listen=args.listen, runtime_endpoint=args.runtime, hook_dir=args.hook_dir)
        assert {"flag": "--hook-dir"} == cli._flag_of(hooks, cfg, args)


def test_a_bare_krproxy_serves_on_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """``krproxy`` with no arguments is ``krproxy serve`` on koord-runtime-proxy's default sockets, as
    koord-runtime-proxy with none serves (a drop-in's unit or DaemonSet may run it bare); it printed
    help and exited 2."""
    seen: list[argparse.Namespace] = []

    def serve(args: argparse.Namespace) -> int:
        seen.append(args)
        return 0

    monkeypatch.setattr(cli, "_serve", serve)
    monkeypatch.setattr(cli.log, "configure", lambda *a: None)
    assert 0 == cli.main([])
    [args] = seen
    assert "serve" == args.command
    assert "/var/run/koord-runtimeproxy/runtimeproxy.sock" in args.listen
    assert "/var/run/containerd/containerd.sock" in args.runtime
