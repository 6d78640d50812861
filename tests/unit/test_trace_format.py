"""The trace file format: records round-trip, torn tails are skipped, damage is named; the writer rotates."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from krproxy.calls import CallRecord
from krproxy.grpcstatus import Status
from krproxy.hooks.merge import Change
from krproxy.hooks.outcomes import Outcome
from krproxy.hooks.points import HookPoint
from krproxy.trace import format as fmt
from krproxy.trace.files import TraceFileError, load
from krproxy.trace.recorder import TraceWriter

PATH = "/runtime.v1.RuntimeService/CreateContainer"


def call(n: int = 0, **changes: object) -> CallRecord:
    fields: dict[str, object] = {
        "path": PATH,
        "started": 1_700_000_000.0 + n,
        "seconds": 0.004,
        "backend_seconds": 0.001,
        "request": b"\x0a\x03pod" + bytes([n % 256]),
        "forwarded": None,
        "reply": b"\x0a\x02id",
        "replies": 1,
        "status": Status.OK,
        "message": None,
        "hooks": (),
    }
    fields.update(changes)
    return CallRecord(**fields)  # type: ignore[arg-type]


def trace_bytes(*records: CallRecord) -> bytes:
    return fmt.encode_header({"writer": "test"}) + b"".join(fmt.encode_call(r) for r in records)


class TestRoundTrip:
    def test_every_field_survives(self) -> None:
        """A call with forwarded bytes, an error status and hook changes reads back field for field."""
        outcome = Outcome(
            plugin="limits",
            point=HookPoint.PRE_CREATE_CONTAINER,
            result="ok",
            seconds=0.002,
            detail="",
            changes=(Change("resources.cpu_quota", 0, 50000), Change("annotations[a/b]", None, "x")),
        )
        record = call(
            forwarded=b"changed", reply=None, status=Status.NOT_FOUND, message="gone ✓", hooks=(outcome,)
        )
        (read,) = fmt.read_records(trace_bytes(record)).records
        assert (1, PATH, record.started, record.seconds, record.backend_seconds) == (
            read.number,
            read.path,
            read.started,
            read.seconds,
            read.backend_seconds,
        )
        assert (record.request, b"changed", None, 1) == (
            read.request,
            read.forwarded,
            read.reply,
            read.replies,
        )
        assert (Status.NOT_FOUND, "gone ✓") == (read.status, read.message)
        (hook,) = read.hooks
        assert ("limits", "PreCreateContainer", "ok", 0.002) == (
            hook.plugin,
            hook.point,
            hook.result,
            hook.seconds,
        )
        assert (
            fmt.FieldChange("resources.cpu_quota", 0, 50000),
            fmt.FieldChange("annotations[a/b]", None, "x"),
        ) == hook.changes

    def test_absent_and_empty_are_distinct(self) -> None:
        """No forwarded request / no reply / no message read back as None, empty ones as empty."""
        empty, absent = fmt.read_records(
            trace_bytes(
                call(forwarded=b"", reply=b"", message=""), call(forwarded=None, reply=None, message=None)
            )
        ).records
        assert (b"", b"", "") == (empty.forwarded, empty.reply, empty.message)
        assert (None, None, None) == (absent.forwarded, absent.reply, absent.message)

    @given(
        st.lists(
            st.tuples(
                st.binary(max_size=64), st.one_of(st.none(), st.binary(max_size=64)), st.integers(0, 16)
            ),
            max_size=8,
        )
    )
    def test_any_bytes_round_trip(self, parts: list[tuple[bytes, bytes | None, int]]) -> None:
        """Whatever the message bytes, every record reads back unchanged and in order."""
        records = [
            call(i, request=req, reply=reply, status=Status(code))
            for i, (req, reply, code) in enumerate(parts)
        ]
        read = fmt.read_records(trace_bytes(*records)).records
        assert [(r.request, r.reply, r.status) for r in records] == [
            (r.request, r.reply, r.status) for r in read
        ]

    def test_header_metadata(self) -> None:
        """The header carries its version and the writer's metadata."""
        header = fmt.read_records(trace_bytes()).header
        assert (fmt.VERSION, "test") == (header.version, header.meta["writer"])


class TestTornTail:
    def test_every_cut_inside_the_last_record_is_torn(self) -> None:
        """Cut anywhere inside the last record, a file yields the earlier records and reports the tail."""
        data = trace_bytes(call(1), call(2), call(3))
        last = len(fmt.encode_call(call(3)))
        for cut in range(1, last):
            result = fmt.read_records(data[: len(data) - cut])
            assert [1, 2] == [r.number for r in result.records]
            assert result.torn is not None and 3 == result.torn.number
            assert last - cut == result.torn.size

    def test_zero_filled_tail_is_torn(self) -> None:
        """Zeros after the last record (a file system's leftovers after a crash) count as a torn tail."""
        result = fmt.read_records(trace_bytes(call(1)) + bytes(100))
        assert 1 == len(result.records)
        assert result.torn is not None and 2 == result.torn.number

    def test_intact_file_has_no_torn_tail(self) -> None:
        """A file ending on a record boundary reports nothing."""
        assert None is fmt.read_records(trace_bytes(call(1), call(2))).torn


class TestCorruption:
    def test_flipped_byte_names_the_record(self) -> None:
        """A flipped byte inside record 2 raises an error naming record 2 and its offset."""
        header = fmt.encode_header({"writer": "test"})
        first = fmt.encode_call(call(1))
        data = bytearray(trace_bytes(call(1), call(2), call(3)))
        data[len(header) + len(first) + 20] ^= 0xFF
        with pytest.raises(fmt.CorruptRecordError) as caught:
            fmt.read_records(bytes(data))
        assert (2, len(header) + len(first)) == (caught.value.number, caught.value.offset)
        assert "record 2 (byte offset" in str(caught.value)

    def test_impossible_length_is_corrupt(self) -> None:
        """A record length of zero is damage, not a torn write."""
        data = trace_bytes(call(1)) + b"\x00\x00\x00\x00\x12\x34\x56\x78" + b"x" * 10
        with pytest.raises(fmt.CorruptRecordError, match="record 2"):
            fmt.read_records(data)

    def test_inconsistent_parts_with_valid_crc(self) -> None:
        """A payload whose CRC matches but whose part lengths do not add up is corrupt."""
        payload = fmt.encode_call(call(1))[8:] + b"extra"
        frame = len(payload).to_bytes(4, "big") + zlib.crc32(payload).to_bytes(4, "big") + payload
        with pytest.raises(fmt.CorruptRecordError, match="lengths do not add up"):
            fmt.read_records(fmt.encode_header({}) + frame)

    @pytest.mark.parametrize(
        ("data", "message"),
        [
            (b"not a trace at all", "not a krproxy trace"),
            (b"KRPTRACE\x00\x09\x00\x00\x00\x00\x00\x00", "version 9 is not supported"),
            (fmt.encode_header({})[:-1] + b"\x00", "damaged"),
        ],
    )
    def test_bad_headers(self, data: bytes, message: str) -> None:
        """Files that are not traces of this version are refused with a reason."""
        with pytest.raises(fmt.TraceFormatError, match=message):
            fmt.read_records(data)

    def test_unknown_kinds_are_skipped(self) -> None:
        """A record of a kind this reader does not know is skipped and counted."""
        payload = b"\x07future"
        frame = len(payload).to_bytes(4, "big") + zlib.crc32(payload).to_bytes(4, "big") + payload
        result = fmt.read_records(trace_bytes(call(1)) + frame + fmt.encode_call(call(2)))
        assert ([1, 3], 1) == ([r.number for r in result.records], result.unknown_kinds)

    def test_load_names_the_file(self, tmp_path: Path) -> None:
        """Reading a damaged file from disk names the file and the record."""
        path = tmp_path / "t.krt"
        data = bytearray(trace_bytes(call(1), call(2)))
        data[-3] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.raises(
            TraceFileError, match=r"t\.krt: record 2 \(byte offset \d+\) is corrupt: CRC mismatch"
        ):
            load([str(path)])


class TestTraceWriter:
    def test_rotation_keeps_bounded_files(self, tmp_path: Path) -> None:
        """Past max_bytes the file rotates at record boundaries, keeping `keep` old files, all readable."""
        path = str(tmp_path / "t.krt")
        frame = fmt.encode_call(call(0))
        meta = {"writer": "test"}  # not the host's name: the header's size must not depend on the machine
        limit = len(fmt.encode_header(meta)) + 3 * len(frame) + len(frame) // 2  # room for three records
        writer = TraceWriter(path, max_bytes=limit, keep=2, meta=meta)
        writer.write([fmt.encode_call(call(i)) for i in range(20)])
        writer.close()
        assert sorted(["t.krt", "t.krt.1", "t.krt.2"]) == sorted(os.listdir(tmp_path))
        starts = [[r.started for r in load([f"{path}{suffix}"]).records] for suffix in (".2", ".1", "")]
        assert [3, 3, 2] == [len(s) for s in starts]  # 20 records: 3 per file, the newest file has the rest
        flat = [s for chunk in starts for s in chunk]
        assert sorted(flat) == flat and flat[-1] == call(19).started
        assert all(os.path.getsize(f"{path}{s}") <= limit for s in ("", ".1", ".2"))

    def test_reopen_appends_and_cuts_a_torn_tail(self, tmp_path: Path) -> None:
        """Opening a file that ends in a torn record cuts the tail off and appends after the last good one."""
        path = tmp_path / "t.krt"
        path.write_bytes(trace_bytes(call(1), call(2)) + fmt.encode_call(call(3))[:10])
        writer = TraceWriter(str(path), max_bytes=0, keep=1)
        writer.write([fmt.encode_call(call(4))])
        writer.close()
        result = load([str(path)])
        assert ([1, 2, 4], ()) == ([int(r.started) - 1_700_000_000 for r in result.records], result.notes)

    def test_damaged_file_is_set_aside(self, tmp_path: Path) -> None:
        """A file with a corrupt record is rotated away untouched, not appended to."""
        path = tmp_path / "t.krt"
        damaged = bytearray(trace_bytes(call(1), call(2)))
        damaged[-5] ^= 0x10
        path.write_bytes(bytes(damaged))
        writer = TraceWriter(str(path), max_bytes=0, keep=1)
        writer.write([fmt.encode_call(call(3))])
        writer.close()
        assert bytes(damaged) == (tmp_path / "t.krt.1").read_bytes()
        assert [call(3).started] == [r.started for r in load([str(path)]).records]

    def test_files_are_private(self, tmp_path: Path) -> None:
        """A new trace file is readable by its owner only (it may hold secrets from env vars)."""
        path = tmp_path / "t.krt"
        writer = TraceWriter(str(path), max_bytes=0, keep=0)
        writer.write([fmt.encode_call(call(1))])
        writer.close()
        assert 0o600 == path.stat().st_mode & 0o777
