"""``python -m krproxy.fakes.containerd``: a socket it cannot use is one line naming it, never a traceback."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from krproxy.fakes.containerd.__main__ import main

PROG = "python -m krproxy.fakes.containerd: error: --socket"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``main(argv)`` in this process: (exit status, stderr)."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = int(stop.code or 0)
    return code, capsys.readouterr().err


def test_a_socket_in_use_is_one_line(short_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A socket another process listens on: exit 1, one line naming it and what to do (a trio
    exception-group traceback before)."""
    path = str(short_tmp / "busy.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as busy:
        busy.bind(path)
        busy.listen()
        code, err = run(["--socket", path], capsys)
    assert 1 == code
    assert f"{PROG} {path}: " in err and "another process is listening" in err and "stop that process" in err
    assert "Traceback" not in err


def test_a_directory_is_one_line(short_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A path that is a directory: exit 1, one line saying so; the directory is left as it was."""
    (short_tmp / "dir").mkdir()
    code, err = run(["--socket", str(short_tmp / "dir")], capsys)
    assert 1 == code
    assert f"{PROG} {short_tmp / 'dir'}: " in err and "not a socket" in err
    assert (short_tmp / "dir").is_dir()


def test_a_missing_directory_is_not_created(short_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A socket in a directory that does not exist: a usage error naming it, and nothing created (the
    fake made the directories, as root, silently)."""
    path = short_tmp / "no" / "such" / "fake.sock"
    code, err = run(["--socket", str(path)], capsys)
    assert 2 == code
    assert f"{PROG} {path}: no directory {path.parent}; create it first" in err
    assert not (short_tmp / "no").exists()


@pytest.mark.parametrize(
    ("socket_arg", "reason"),
    [
        ("/" + "s" * 120, "longer than a unix socket path can be"),
        ("relative.sock", "a socket path must be absolute"),
        ("tcp://127.0.0.1:1", "only unix sockets are supported"),
    ],
    ids=["too-long", "relative", "tcp"],
)
def test_a_bad_path_is_a_usage_error(
    socket_arg: str, reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A path no unix socket can have is refused before anything is bound: exit 2 with the reason."""
    code, err = run(["--socket", socket_arg], capsys)
    assert 2 == code
    assert f"{PROG}: " in err and reason in err
