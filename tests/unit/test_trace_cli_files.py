"""Tests of reading traces as an operator meets them: `krproxy trace show|replay` on files that are
empty, cut short, damaged, from a newer krproxy, or not traces at all, records out of order, and
replay's own flags. Each bad input gets exit status 2 and a message naming the file or flag; no
traceback. No server is started: replay's target here is a path nobody listens on (one error, exit
2, checked after the flags and the files), or a socket that never answers."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from krproxy import cli
from krproxy.calls import CallRecord
from krproxy.grpcstatus import Status
from krproxy.trace import format as fmt
from krproxy.trace.files import load
from krproxy.trace.replay import Answer, replay
from tests.unit.test_trace_format import call as format_call
from tests.unit.test_trace_format import trace_bytes

VERSION = "/runtime.v1.RuntimeService/Version"
STATUS = "/runtime.v1.RuntimeService/Status"


def call(n: int, *, path: str = VERSION, started: float | None = None) -> CallRecord:
    """test_trace_format's record with empty messages, a Version call unless said otherwise."""
    at = {} if started is None else {"started": started}
    return format_call(n, path=path, seconds=0.001, request=b"", reply=b"", **at)


def write_trace(path: Path, *calls: CallRecord) -> Path:
    path.write_bytes(trace_bytes(*calls))
    return path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 2
    out, err = capsys.readouterr()
    return code, out, err


class TestFilesAnOperatorMeets:
    def test_empty_file_says_it_is_empty(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """An empty file (what `krproxy serve --record-paused` leaves until SIGUSR1) is named as
        empty, not as "not a krproxy trace file"."""
        empty = tmp_path / "node.krt"
        empty.write_bytes(b"")
        code, _, err = run(["trace", "show", str(empty)], capsys)
        assert 2 == code
        assert f"{empty}: the file is empty" in err and "Traceback" not in err

    def test_newer_format_version_names_both_versions(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        newer = tmp_path / "node.krt"
        data = bytearray(fmt.encode_header({"writer": "krproxy 9"}) + fmt.encode_call(call(1)))
        struct.pack_into(">H", data, 8, 2)
        newer.write_bytes(bytes(data))
        code, _, err = run(["trace", "show", str(newer)], capsys)
        assert 2 == code
        assert f"{newer}: trace format version 2 is not supported (this krproxy reads 1)" in err

    def test_garbage_is_not_a_trace(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        garbage = tmp_path / "node.krt"
        garbage.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
        code, _, err = run(["trace", "replay", str(garbage), "--target", str(tmp_path / "x.sock")], capsys)
        assert 2 == code
        assert f"{garbage}: not a krproxy trace file (no KRPTRACE header)" in err

    def test_header_cut_short(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        cut = tmp_path / "node.krt"
        cut.write_bytes(fmt.encode_header({"writer": "test"})[:20])
        code, _, err = run(["trace", "show", str(cut)], capsys)
        assert (2, True) == (code, "the trace header is truncated" in err)

    def test_torn_last_record_is_skipped_with_a_warning(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A file cut inside its last record (a crash mid-write): the whole records are listed, the
        torn one named on stderr, exit 0."""
        trace = write_trace(tmp_path / "node.krt", call(1), call(2), call(3))
        trace.write_bytes(trace.read_bytes()[:-5])
        code, out, err = run(["trace", "show", str(trace), "--json"], capsys)
        assert (0, 2) == (code, len(out.splitlines()))
        assert "warning:" in err and "torn last record 3" in err

    def test_damaged_record_is_named(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        trace = write_trace(tmp_path / "node.krt", call(1), call(2))
        data = bytearray(trace.read_bytes())
        data[-3] ^= 0xFF
        trace.write_bytes(bytes(data))
        code, out, err = run(["trace", "show", str(trace)], capsys)
        assert 1 == code  # shown without it: every good record, the damaged one named
        assert 2 == len(out.splitlines())  # the header and record 1
        assert f"{trace}: record 2 (byte offset" in err and "CRC mismatch" in err

    def test_a_missing_file_among_several_is_named(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        trace = write_trace(tmp_path / "node.krt", call(1))
        code, _, err = run(["trace", "show", str(tmp_path / "node.krt.1"), str(trace)], capsys)
        assert (2, True) == (code, f"{tmp_path / 'node.krt.1'}: No such file or directory" in err)


class TestOrder:
    def test_replay_sends_in_the_order_calls_started(self, tmp_path: Path) -> None:
        """A file holds calls in the order they ended; a slow call that started first is sent first,
        across rotated files too."""
        older = write_trace(tmp_path / "node.krt.1", call(0, path=STATUS, started=5.0), call(0, started=1.0))
        newer = write_trace(tmp_path / "node.krt", call(0, path=STATUS, started=2.0), call(0, started=9.0))
        sent: list[str] = []

        def transport(path: str, request: bytes, timeout: float) -> Answer:
            sent.append(path)
            return Answer(Status.OK, None, b"")

        report = replay(load([str(older), str(newer)]).records, transport)
        assert [VERSION, STATUS, STATUS, VERSION] == sent
        assert report.ok


def _socket_left_behind(path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))


class TestReplayFlags:
    @pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
    def test_timeout_must_be_a_positive_number_of_seconds(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
    ) -> None:
        """``--timeout 0``/``-1`` made every call fail at once (DEADLINE_EXCEEDED, exit 1, read as
        differences), ``nan`` ended in a traceback: a usage error naming the flag instead."""
        trace = write_trace(tmp_path / "node.krt", call(1))
        argv = ["trace", "replay", str(trace), "--target", str(tmp_path / "x.sock"), f"--timeout={value}"]
        code, out, err = run(argv, capsys)
        assert 2 == code, out
        assert "--timeout" in err and "Traceback" not in err

    @pytest.mark.parametrize("value", ["0", "-2", "nan"])
    def test_speed_must_be_positive(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
    ) -> None:
        """``--speed 0`` or a negative speed silently replayed without the recorded gaps."""
        trace = write_trace(tmp_path / "node.krt", call(1))
        argv = [
            "trace",
            "replay",
            str(trace),
            "--target",
            str(tmp_path / "x.sock"),
            "--timing",
            f"--speed={value}",
        ]
        code, out, err = run(argv, capsys)
        assert 2 == code, out
        assert "--speed" in err

    def test_sound_flags_pass(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """The checks refuse nothing sound: 0.5 s and 10x reach the target (a socket that takes the
        connection and never answers: DEADLINE_EXCEEDED, exit 1)."""
        trace = write_trace(tmp_path / "node.krt", call(1))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
            silent.bind(str(tmp_path / "x.sock"))
            silent.listen(4)
            argv = ["trace", "replay", str(trace), "--target", str(tmp_path / "x.sock"), "--timeout=0.5"]
            code, out, _ = run([*argv, "--timing", "--speed=10", "--progress=never"], capsys)
        assert 1 == code
        assert 'replay "DEADLINE_EXCEEDED"' in out


class TestReplayTarget:
    @pytest.mark.parametrize(
        ("make", "words"),
        [
            (lambda path: None, "No such file or directory"),
            (lambda path: path.write_text(""), "not a socket but a regular file"),
            (_socket_left_behind, "Connection refused"),  # what a crashed runtime leaves
        ],
    )
    def test_a_target_nobody_serves_is_one_error(
        self,
        tmp_path: Path,
        capsys: pytest.CaptureFixture[str],
        make: Callable[[Path], object],
        words: str,
    ) -> None:
        """Against a socket nobody serves, replay reported every call as a difference (status
        UNAVAILABLE, "cannot reach ..."), 18 of them for a short trace, and exit 1 as if the
        runtime had answered differently. Now one line that says which target and why, exit 2,
        and nothing sent."""
        trace = write_trace(tmp_path / "node.krt", call(1), call(2))
        target = tmp_path / "x.sock"
        make(target)
        code, out, err = run(["trace", "replay", str(trace), "--target", f"unix://{target}"], capsys)
        assert (2, "") == (code, out)
        assert f"krproxy trace replay: cannot reach {target}: {words}" in err
        assert "--target" in err
