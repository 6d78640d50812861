"""The relay's HTTP/2 pieces that need no socket: frames, header blocks, gRPC message counting."""

from __future__ import annotations

import sys
import urllib.parse

import hpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from krproxy.h2 import frames as f
from krproxy.h2.connection import Connection, Role
from krproxy.relay._input import _Aside, _decode_aside
from krproxy.relay.grpc import MAX_STATUS_MESSAGE, MessageTooLarge, read_status, status_message
from krproxy.relay.rpc import KEEP_ALL, KEEP_FIRST, KEEP_NONE, Tap, encode_grpc_timeout, grpc_timeout
from tests.unit.h2peer import parse

header_fields = st.lists(
    st.tuples(st.binary(min_size=1, max_size=300), st.binary(max_size=3000)),
    max_size=20,
)


class TestHeaderBlocks:
    @given(header_fields)
    def test_any_fields_decode_back_leaving_the_table_empty(self, fields: list[tuple[bytes, bytes]]) -> None:
        """Any fields decode back and leave the dynamic table empty."""
        decoder = hpack.Decoder()
        decoder.max_header_list_size = 1 << 20
        assert fields == [tuple(h) for h in decoder.decode(f.encode_headers(fields), raw=True)]
        assert 0 == len(decoder.header_table.dynamic_entries)

    def test_static_table_fields_are_one_byte(self) -> None:
        assert b"\x83\x86\x88" == f.encode_headers(
            [(b":method", b"POST"), (b":scheme", b"http"), (b":status", b"200")]
        )

    @pytest.mark.parametrize("value", [0, 126, 127, 128, 255, 16383, 16384, 1 << 20])
    def test_length_prefixes_at_the_boundaries(self, value: int) -> None:
        text = b"x" * value
        assert [(b"k", text)] == [
            tuple(h) for h in _decoder().decode(f.encode_headers([(b"k", text)]), raw=True)
        ]

    def test_a_block_larger_than_a_frame_continues(self) -> None:
        block = bytes(range(256)) * 100  # 25,600 bytes
        frames_ = parse(f.header_frames(5, block, True, 10_000))
        assert [(f.HEADERS, f.END_STREAM), (f.CONTINUATION, 0), (f.CONTINUATION, f.END_HEADERS)] == [
            (kind, flags) for kind, flags, _, _ in frames_
        ]
        assert {5} == {stream_id for _, _, stream_id, _ in frames_}
        assert block == b"".join(payload for *_, payload in frames_)

    def test_a_small_block_is_one_frame(self) -> None:
        assert [(f.HEADERS, f.END_HEADERS, 3, b"abc")] == parse(f.header_frames(3, b"abc", False, 16_384))


def _decoder() -> hpack.Decoder:
    decoder = hpack.Decoder()
    decoder.max_header_list_size = 1 << 22
    return decoder


class TestFramePayloads:
    def test_padding_removed(self) -> None:
        assert b"data" == f.unpad(f.PADDED, b"\x03data\x00\x00\x00")
        assert b"data" == f.unpad(0, b"data")
        assert b"" == f.unpad(f.PADDED, b"\x04data")  # all padding: legal

    @pytest.mark.parametrize("payload", [b"", b"\x05data", b"\xffdata"])
    def test_padding_longer_than_the_frame_is_a_protocol_error(self, payload: bytes) -> None:
        with pytest.raises(f.ProtocolError):
            f.unpad(f.PADDED, payload)

    def test_priority_fields_skipped_in_headers(self) -> None:
        assert (b"block", 1) == f.header_fragment(f.PRIORITY_FLAG, b"\x00\x00\x00\x01\x10block")
        assert (b"block", 1) == f.header_fragment(
            f.PRIORITY_FLAG | f.PADDED, b"\x01\x00\x00\x00\x01\x10block\x00"
        )

    def test_settings_round_trip_and_bad_length(self) -> None:
        frame = f.settings([(f.INITIAL_WINDOW_SIZE, 1 << 22), (f.ENABLE_PUSH, 0)])
        ((kind, flags, stream_id, payload),) = parse(frame)
        assert (f.SETTINGS, 0, 0) == (kind, flags, stream_id)
        assert [(f.INITIAL_WINDOW_SIZE, 1 << 22), (f.ENABLE_PUSH, 0)] == f.parse_settings(payload)
        with pytest.raises(f.ProtocolError) as err:
            f.parse_settings(b"\x00\x04\x00")
        assert f.FRAME_SIZE_ERROR == err.value.code

    def test_window_update_and_goaway(self) -> None:
        ((_, _, stream_id, payload),) = parse(f.window_update(7, 1000))
        assert (7, 1000) == (stream_id, f.parse_u32(payload))
        ((_, _, _, payload),) = parse(f.goaway(9, f.PROTOCOL_ERROR, b"why"))
        assert (9, f.PROTOCOL_ERROR) == f.parse_goaway(payload)
        with pytest.raises(f.ProtocolError):
            f.parse_u32(b"\x00\x00\x01")


class TestGrpcTimeout:
    @pytest.mark.parametrize(
        ("value", "seconds"),
        [
            (b"1H", 3600.0),
            (b"2M", 120.0),
            (b"3S", 3.0),
            (b"250m", 0.25),
            (b"1999873u", 1.999873),
            (b"5n", 5e-9),
        ],
    )
    def test_units(self, value: bytes, seconds: float) -> None:
        assert seconds == pytest.approx(grpc_timeout(value))

    @pytest.mark.parametrize("value", [b"", b"S", b"10", b"10x", b"-1S", b"123456789S", b"1.5S"])
    def test_malformed_is_none(self, value: bytes) -> None:
        assert grpc_timeout(value) is None

    @pytest.mark.parametrize(
        ("seconds", "value"),
        [
            (0.001, b"1000000n"),
            (0.1, b"100000u"),  # 10^8 ns would be 9 digits
            (2.0, b"2000000u"),
            (99.999999, b"99999999u"),
            (100.0, b"100000m"),
            (120.0, b"120000m"),  # kubelet's default runtime-request-timeout
            (240.0, b"240000m"),  # kubelet's RunPodSandbox
            (36000.0, b"36000000m"),  # 10 h
            (10**6, b"1000000S"),
            (0.0, b"0n"),
            (-3.0, b"0n"),
            (10**20, b"99999999H"),
        ],
    )
    def test_encoded_like_grpc_go(self, seconds: float, value: bytes) -> None:
        """The finest unit whose count has at most 8 digits, as grpc-go's encodeTimeout."""
        assert value == encode_grpc_timeout(seconds)

    @given(st.floats(min_value=1e-9, max_value=3.5e11, allow_nan=False))  # 99999999 H is the cap
    def test_encoded_fits_and_never_shortens(self, seconds: float) -> None:
        """Every encoding parses back (at most 8 digits) to no less than the deadline, and not much more."""
        value = encode_grpc_timeout(seconds)
        decoded = grpc_timeout(value)
        assert decoded is not None, value
        assert decoded >= seconds * (1 - 1e-12)
        assert decoded <= seconds * (1 + 1e-5) + 1e-9  # rounded up in a unit at most 1000x coarser


def _framed(*messages: bytes) -> bytes:
    return b"".join(b"\x00" + len(m).to_bytes(4, "big") + m for m in messages)


class TestStatusMessage:
    """``grpc-message`` values krproxy writes fit the header block every gRPC client accepts."""

    @pytest.mark.parametrize("message", ["", "boom", "x" * MAX_STATUS_MESSAGE, "% é 中 \n" * 10])
    def test_a_short_message_is_percent_encoded_whole(self, message: str) -> None:
        assert urllib.parse.quote(message, safe=" ").encode() == status_message(message)

    @pytest.mark.parametrize("unit", ["x", "é", "中", "%", "😀", "a\n"])
    def test_a_long_message_keeps_its_start_says_how_much_was_cut(self, unit: str) -> None:
        """A long message keeps its start and says how much was cut."""
        message = "plugin p failed: " + unit * 20_000
        value = status_message(message)
        # as much of the start as fits: short of the limit by less than one character (12 bytes encoded)
        assert MAX_STATUS_MESSAGE - 16 <= len(value) <= MAX_STATUS_MESSAGE
        _, text, _ = read_status([(b"grpc-status", b"2"), (b"grpc-message", value)])
        assert text is not None
        kept, _, note = text.partition(" ... (")
        assert message.startswith(kept)
        assert f"{len(message) - len(kept)} more characters cut by krproxy)" == note

    @given(st.text(max_size=9000))
    def test_any_message_fits_and_decodes_to_a_start_of_it(self, message: str) -> None:
        value = status_message(message)
        assert len(value) <= MAX_STATUS_MESSAGE
        text = urllib.parse.unquote(value.decode())
        assert text == message or message.startswith(text.partition(" ... (")[0])


class TestTap:
    @given(st.lists(st.binary(max_size=40), min_size=1, max_size=5), st.data())
    def test_counts_messages_however_the_bytes_are_cut(
        self, messages: list[bytes], data: st.DataObject
    ) -> None:
        stream = _framed(*messages)
        cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
        first, every, count = Tap(KEEP_FIRST), Tap(KEEP_ALL), Tap(KEEP_NONE)
        for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
            for tap in (first, every, count):
                tap.feed(stream[start:end])
        assert (len(messages), messages[0]) == (first.messages, bytes(first.first or b""))
        assert (len(messages), b"".join(messages)) == (every.messages, bytes(every.first or b""))
        assert (len(messages), None) == (count.messages, count.first)

    def test_incomplete_message_is_not_counted(self) -> None:
        tap = Tap(KEEP_FIRST)
        tap.feed(_framed(b"abcdef")[:-2])
        assert 0 == tap.messages

    @given(st.lists(st.tuples(st.binary(max_size=40), st.booleans()), min_size=1, max_size=4))
    def test_whole_messages_read_as_byte_by_byte(self, messages: list[tuple[bytes, bool]]) -> None:
        """A chunk that is one whole message (read at once) counts and keeps what its bytes fed one
        at a time do, the compressed flag of the first included."""
        chunks = [bytes([flag]) + len(m).to_bytes(4, "big") + m for m, flag in messages]
        for keep in (KEEP_NONE, KEEP_FIRST, KEEP_ALL):
            whole, single = Tap(keep), Tap(keep)
            for chunk in chunks:
                whole.feed(chunk)
                for i in range(len(chunk)):
                    single.feed(chunk[i : i + 1])
            read = [(t.messages, t.first, t.compressed) for t in (whole, single)]
            assert read[1] == read[0]

    @pytest.mark.parametrize("flag", [0, 1, 2, 3, 0x80, 0xFF])
    def test_keeps_the_first_flag_byte_whole(self, flag: int) -> None:
        """The first message's flag byte as it came, whole or cut (grpc-go refuses any but 0 and 1;
        its low bit alone is the compressed flag), a later message's not."""
        chunk = bytes([flag]) + (3).to_bytes(4, "big") + b"abc"
        whole, single = Tap(KEEP_FIRST), Tap(KEEP_FIRST)
        whole.feed(chunk)  # one whole message: read at once
        for i in range(len(chunk)):
            single.feed(chunk[i : i + 1])
        for tap in (whole, single):
            tap.feed(b"\x02" + (0).to_bytes(4, "big"))
        assert (flag, bool(flag & 1)) == (whole.flag, whole.compressed) == (single.flag, single.compressed)

    def test_a_whole_message_over_the_limit(self) -> None:
        """Refused before any of it is kept, as when its prefix comes alone."""
        tap = Tap(KEEP_FIRST, limit=3)
        tap.feed(_framed(b"abc"))
        with pytest.raises(MessageTooLarge, match="4 bytes is larger than the limit of 3"):
            tap.feed(_framed(b"abcd"))
        assert (1, b"abc") == (tap.messages, bytes(tap.first or b""))


GOOD = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/a.B/C"), (b"te", b"trailers")]


class TestRequestHeaderRules:
    """RFC 9113 §8.2 / §8.3.1 on a decoded request header list, without sockets."""

    def test_a_grpc_request_is_well_formed(self) -> None:
        assert f.request_header_problem(GOOD) is None
        assert f.request_header_problem([(b"grpc-status", b"0")], trailers=True) is None

    @pytest.mark.parametrize(
        ("headers", "problem"),
        [
            ([*GOOD, (b"X-Up", b"1")], "not lowercase"),
            ([*GOOD, (b"keep-alive", b"1")], "connection-specific"),
            ([*GOOD[:3], (b"te", b"gzip")], "only 'trailers'"),
            ([(b"te", b"trailers"), *GOOD[:3]], "after a regular"),
            ([(b":protocol", b"x"), *GOOD], "not a request pseudo-header"),
            ([(b":path", b"/x"), *GOOD], "twice"),
            (GOOD[1:], "no :method"),
            ([*GOOD, (b"x-id", b"a\x00b")], "control character (0x00)"),
            ([*GOOD, (b"x-id", b"a\nb")], "control character (0x0a)"),
            ([*GOOD, (b"x-id", b"a\rb")], "control character (0x0d)"),
            ([*GOOD, (b"x-id", b"a\x01")], "control character (0x01)"),  # grpc-go's rule
            ([*GOOD, (b"x-id", b"a\x7f")], "control character (0x7f)"),  # grpc-go's rule
            ([(b":path", b"/a.B/C\r\n"), *GOOD[:2], GOOD[3]], "control character (0x0d)"),
            ([*GOOD, (b"x-id", b" a")], "starting or ending with whitespace"),
            ([*GOOD, (b"x-id", b"a\t")], "starting or ending with whitespace"),
            ([*GOOD, (b"x\x00id", b"1")], "not lowercase token"),
            ([*GOOD, (b"x\nid", b"1")], "not lowercase token"),
            ([*GOOD, (b"x id", b"1")], "not lowercase token"),
            ([*GOOD, (b"x:id", b"1")], "not lowercase token"),
            ([*GOOD, (b"x\xe9", b"1")], "not lowercase token"),
            ([*GOOD, (b"x(id)", b"1")], "not lowercase token"),  # grpc-go's rule: token characters
            ([*GOOD, (b"", b"1")], "not lowercase token"),
        ],
    )
    def test_malformed_requests(self, headers: list[tuple[bytes, bytes]], problem: str) -> None:
        found = f.request_header_problem(headers)
        assert found is not None and problem in found

    def test_values_may_hold_inner_whitespace_and_octets_above_ascii(self) -> None:
        """RFC 9113 §8.2.1 and grpc-go both accept these (and an empty value)."""
        assert f.request_header_problem([*GOOD, (b"x-id", b"a b\tc\x80\xff"), (b"x-e", b"")]) is None
        assert f.request_header_problem([*GOOD, (b"x-!#$%&'*+-.^_`|~09az", b"1")]) is None

    def test_fields_found_good_are_not_checked_again(self, monkeypatch: pytest.MonkeyPatch) -> None:
        f._GOOD_FIELDS.clear()
        call = [*GOOD, (b"grpc-timeout", b"5S")]
        assert f.request_header_problem(call) is None
        checked: list[bytes] = []
        real = f.field_problem
        monkeypatch.setattr(f, "field_problem", lambda n, v: checked.append(n) or real(n, v))
        assert f.request_header_problem([*GOOD, (b"grpc-timeout", b"4S")]) is None
        assert checked == [b"grpc-timeout"]  # the one field whose value changes call by call
        # The list's own rules still apply to remembered fields.
        assert "after a regular" in str(f.request_header_problem([GOOD[3], *GOOD[:3]]))
        assert "twice" in str(f.request_header_problem([*GOOD[:3], GOOD[2], GOOD[3]]))
        assert "control character" in str(f.request_header_problem([*GOOD, (b"x-id", b"a\x00")]))

    def test_trailers_are_judged_by_the_same_field_rules(self) -> None:
        assert "control character" in str(f.request_header_problem([(b"x-id", b"\x00")], trailers=True))

    def test_pseudo_headers_in_trailers(self) -> None:
        assert "in trailers" in str(f.request_header_problem([(b":path", b"/x")], trailers=True))

    def test_table_size_update(self) -> None:
        assert b"\x20" == f.table_size_update(0)
        assert b"\x3f\xe1\x1f" == f.table_size_update(4096)


class TestDecodingAside:
    def test_the_switch_interval_is_lowered_while_decoding_aside(self) -> None:
        """Two worker threads may decode at once: the interval comes back only when both are done."""
        before = sys.getswitchinterval()
        _Aside.enter()
        _Aside.enter()
        assert sys.getswitchinterval() < before
        _Aside.leave()
        assert sys.getswitchinterval() < before
        _Aside.leave()
        assert before == sys.getswitchinterval()

    def test_a_block_decoded_aside_is_the_block_decoded(self) -> None:
        block = hpack.Encoder().encode([(b":path", b"/a.B/C"), (b"x-id", b"1")])
        decode = Connection(Role.SERVER).decode_block
        assert [(b":path", b"/a.B/C"), (b"x-id", b"1")] == _decode_aside(decode, block)

    def test_an_undecodable_block_is_a_compression_error(self) -> None:
        error = _decode_aside(Connection(Role.SERVER).decode_block, b"\xff\xff\xff\xff")
        assert isinstance(error, f.ProtocolError)
        assert f.COMPRESSION_ERROR == error.code
