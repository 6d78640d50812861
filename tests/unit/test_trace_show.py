"""``krproxy trace show``: a damaged record hides none of the good ones; ``--details`` prints text as text."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from krproxy import cli
from krproxy.proto.runtime import v1 as cri
from krproxy.trace import format as fmt
from krproxy.trace import messages
from krproxy.trace.files import TraceFileError, load
from krproxy.trace.show import readable

from .test_trace_format import call, trace_bytes

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "traces" / "fake-lifecycle.krt"


def frame_offsets(data: bytes) -> list[int]:
    """The byte offset of each record's frame in a trace file."""
    header = fmt.decode_header(data)
    frames = fmt.iter_frames(data, header.size, skip_corrupt=True)
    return [item.offset for item in frames if isinstance(item, fmt.Frame | fmt.CorruptRecordError)]


def damaged(data: bytes, record: int) -> bytes:
    """*data* with one payload byte of record *record* (from 1) flipped: its CRC no longer matches."""
    out = bytearray(data)
    out[frame_offsets(data)[record - 1] + 8 + 5] ^= 0xFF
    return bytes(out)


class TestSkipCorrupt:
    def test_records_after_a_bad_crc_are_read(self) -> None:
        """With skip_corrupt, a record failing its CRC is named and left out; those after it are read."""
        result = fmt.read_records(damaged(trace_bytes(call(1), call(2), call(3)), 2), skip_corrupt=True)
        assert [1, 3] == [r.number for r in result.records]
        assert [(2, "CRC mismatch")] == [(e.number, e.reason) for e in result.corrupt]
        assert 0 == result.unread

    def test_a_bad_length_leaves_the_rest_unread(self) -> None:
        """A damaged length tells nowhere to go on: the records before it, and the rest counted unread."""
        good = trace_bytes(call(1))
        tail = b"\x00\x00\x00\x00\x12\x34\x56\x78" + fmt.encode_call(call(2))
        result = fmt.read_records(good + tail, skip_corrupt=True)
        assert [1] == [r.number for r in result.records]
        assert [2] == [e.number for e in result.corrupt]
        assert len(tail) == result.unread

    def test_a_record_with_bad_parts_is_left_out(self) -> None:
        """A record whose CRC matches but whose parts do not add up is left out, and reading goes on."""
        payload = fmt.encode_call(call(2))[8:] + b"extra"
        frame = len(payload).to_bytes(4, "big") + zlib.crc32(payload).to_bytes(4, "big") + payload
        result = fmt.read_records(trace_bytes(call(1)) + frame + fmt.encode_call(call(3)), skip_corrupt=True)
        assert [1, 3] == [r.number for r in result.records]
        assert ["part lengths do not add up to the record length"] == [e.reason for e in result.corrupt]

    def test_load_names_each_damaged_record(self, tmp_path: Path) -> None:
        """load(skip_corrupt=True) warns once per damaged record, naming file and record."""
        path = tmp_path / "t.krt"
        path.write_bytes(damaged(damaged(trace_bytes(*map(call, range(1, 6))), 2), 4))
        warnings: list[str] = []
        loaded = load([str(path)], warn=warnings.append, skip_corrupt=True)
        assert [1, 3, 5] == [r.number for r in loaded.records]
        assert loaded.damaged
        assert [2, 4] == [int(w.split("record ")[1].split()[0]) for w in warnings]
        assert all(w.startswith(f"{path}: record ") and w.endswith("(left out)") for w in warnings)
        with pytest.raises(TraceFileError, match="record 2"):
            load([str(path)])  # replay and serve still refuse the file


class TestShowCommand:
    def test_a_damaged_record_hides_no_good_one(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`trace show` on a trace with record 3 damaged prints every other record, names record 3 on
        stderr and exits 1 (before: an error, exit 2, and not even the records before it)."""
        data = GOLDEN.read_bytes()
        total = len(frame_offsets(data))
        path = tmp_path / "damaged.krt"
        path.write_bytes(damaged(data, 3))
        assert 1 == cli.main(["trace", "show", str(path)])
        out, err = capsys.readouterr()
        numbers = [int(line.split()[0]) for line in out.splitlines()[1:]]
        assert [n for n in range(1, total + 1) if n != 3] == numbers
        assert f"{path}: record 3 (byte offset {frame_offsets(data)[2]}) is corrupt: CRC mismatch" in err

    def test_an_intact_trace_exits_0(self, capsys: pytest.CaptureFixture[str]) -> None:
        """An intact trace is shown whole, exit 0, nothing on stderr."""
        assert 0 == cli.main(["trace", "show", str(GOLDEN)])
        out, err = capsys.readouterr()
        assert len(frame_offsets(GOLDEN.read_bytes())) == len(out.splitlines()) - 1
        assert "" == err

    def test_details_print_env_values_as_text(self, capsys: pytest.CaptureFixture[str]) -> None:
        """`--details` prints CRI's env values (bytes fields) as their text, where --json keeps base64."""
        assert 0 == cli.main(["trace", "show", str(GOLDEN), "--method", "CreateContainer", "-d"])
        details = capsys.readouterr().out
        assert '{"key": "MODE", "value": "trace"}' in details
        assert "dHJhY2U=" not in details
        assert 0 == cli.main(["trace", "show", str(GOLDEN), "--method", "CreateContainer", "--json"])
        [line] = capsys.readouterr().out.splitlines()
        assert [{"key": "MODE", "value": "dHJhY2U="}] == json.loads(line)["request"]["config"]["envs"]


class TestReadable:
    def test_bytes_that_are_not_utf8_are_escaped(self) -> None:
        """Bytes that are not UTF-8 print with \\xNN escapes, the UTF-8 around them as text."""
        config = cri.ContainerConfig(envs=[cri.KeyValue(key="K", value="é\xff".encode("latin-1"))])
        assert [{"key": "K", "value": "\\xe9\\xff"}] == readable(config)["envs"]
        config = cri.ContainerConfig(envs=[cri.KeyValue(key="K", value="é".encode() + b"\xff")])
        assert [{"key": "K", "value": "é\\xff"}] == readable(config)["envs"]

    def test_nested_messages_and_other_fields_are_kept(self) -> None:
        """Only bytes fields change: nested messages are walked, strings, ints and maps stay as to_plain
        gives them."""
        request = cri.CreateContainerRequest(
            pod_sandbox_id="p",
            config=cri.ContainerConfig(
                metadata=cri.ContainerMetadata(name="app", attempt=2),
                envs=[cri.KeyValue(key="A", value=b"1"), cri.KeyValue(key="B", value=b"")],
                labels={"x": "y"},
                linux=cri.LinuxContainerConfig(resources=cri.LinuxContainerResources(cpu_quota=5)),
            ),
        )
        plain = messages.to_plain(request)
        shown = readable(request)
        assert [{"key": "A", "value": "1"}, {"key": "B"}] == shown["config"]["envs"]  # "" is the default
        plain["config"].pop("envs")
        shown["config"].pop("envs")
        assert plain == shown
