"""Tests of 59a88ea (trace replay: a target that accepts no connection is one error, exit 2): the
targets an operator mistypes. A directory or a regular file where the socket should be is named as
such: "Connection refused" (what connect(2) says) reads as a runtime that is down."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.unit.test_trace_cli_files import call, run, write_trace


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda path: path.mkdir(), "not a socket but a directory"),  # /run/containerd for its socket
        (lambda path: path.write_text(""), "not a socket but a regular file"),
        (lambda path: path.symlink_to(path.with_name("nowhere")), "No such file or directory"),
        (lambda path: None, "No such file or directory"),
    ],
    ids=["directory", "regular file", "dangling symlink", "nothing"],
)
def test_a_target_that_is_no_socket_says_what_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Callable[[Path], object], words: str
) -> None:
    trace = write_trace(tmp_path / "node.krt", call(1))
    target = tmp_path / "target"
    make(target)
    code, out, err = run(["trace", "replay", str(trace), "--target", str(target)], capsys)
    assert (2, "") == (code, out)
    assert f"krproxy trace replay: cannot reach {target}: {words} (--target" in err


def test_a_path_too_long_for_a_unix_socket_is_one_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "node.krt", call(1))
    target = tmp_path / ("x" * 120 + ".sock")
    code, out, err = run(["trace", "replay", str(trace), "--target", str(target)], capsys)
    assert (2, "") == (code, out)
    assert "path too long" in err


@pytest.fixture
def closing_target(tmp_path: Path) -> Iterator[Path]:
    """A socket whose server accepts each connection and closes it at once."""
    path = tmp_path / "closing.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)

    def accept_and_close() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # the listener shut down: the test is over
                return
            conn.close()

    thread = threading.Thread(target=accept_and_close, daemon=True)
    thread.start()
    yield path
    listener.shutdown(socket.SHUT_RDWR)
    listener.close()
    thread.join(5)


def test_a_target_that_accepts_then_closes_says_why_per_call(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], closing_target: Path
) -> None:
    """The probe only connects, so such a target counts as reached: every call is a difference,
    UNAVAILABLE (the peer closed the connection, or reset it), exit 1, not a hang."""
    trace = write_trace(tmp_path / "node.krt", call(1), call(2))
    argv = [
        "trace",
        "replay",
        str(trace),
        "--target",
        str(closing_target),
        "--timeout=10",
        "--progress=never",
    ]
    code, out, _ = run(argv, capsys)
    assert 1 == code
    assert 2 == out.count('status: recorded "OK", replay "UNAVAILABLE"'), out
