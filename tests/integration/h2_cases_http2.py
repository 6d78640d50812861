"""h2spec's http2 cases of RFC 7540/9113 sections 3 to 5 (h2_cases.py has them all)."""

from __future__ import annotations

from krproxy.h2 import frames as f
from tests.integration.h2_play import (
    ANSWERED,
    CLOSED_STREAM,
    COMPRESSION,
    FRAME_SIZE,
    PROTOCOL,
    REQUEST,
    REQUEST_BLOCK,
    REUSED_NOTE,
    Case,
    Expect,
    block,
    call,
    case,
    conn_error,
    continuation,
    data,
    ended,
    headers,
    ping,
    priority,
    stream_error,
)

HTTP2_STREAMS: dict[str, Case] = {
    # -- http2: RFC 7540 / 9113 section by section ------------------------------------------------
    "http2/3.5/1": case("Sends client connection preface", expect=Expect(settings_first=True)),
    "http2/3.5/2": case(
        "Sends invalid connection preface",
        b"INVALID CONNECTION PREFACE\r\n\r\n",
        expect=conn_error(PROTOCOL),
        own_preface=True,
    ),
    "http2/4.1/1": case(
        "Sends a frame with unknown type",
        f.frame(0x16, 0, 0, bytes(8)),
        ping(),
        expect=Expect(ping_acked=bytes(8)),
    ),
    "http2/4.1/2": case(
        "Sends a frame with undefined flag",
        f.frame(f.PING, 0x16, 0, bytes(8)),
        expect=Expect(ping_acked=bytes(8)),
    ),
    "http2/4.1/3": case(
        "Sends a frame with reserved field bit",
        f.HEAD.pack(8 >> 16, 8 & 0xFFFF, f.PING, 0x16, 0x8000_0000) + bytes(8),
        expect=Expect(ping_acked=bytes(8)),
    ),
    "http2/4.2/1": case(
        "Sends a DATA frame with 2^14 octets in length",
        headers(1) + data(1, b"\x00" + (16_384 - 5).to_bytes(4, "big") + bytes(16_384 - 5), end=True),
        expect=ANSWERED,
    ),
    "http2/4.2/2": case(
        "Sends a large size DATA frame that exceeds the SETTINGS_MAX_FRAME_SIZE",
        headers(1) + data(1, bytes(16_385), end=True),
        expect=conn_error(FRAME_SIZE),
    ),
    "http2/4.2/3": case(
        "Sends a large size HEADERS frame that exceeds the SETTINGS_MAX_FRAME_SIZE",
        headers(1, block(*REQUEST, *((f"x-dummy{i}", "x" * 4000) for i in range(5))), end=True),
        expect=conn_error(FRAME_SIZE),
    ),
    "http2/4.3/1": case(
        "Sends invalid header block fragment",
        f.frame(f.HEADERS, f.END_STREAM | f.END_HEADERS, 1, b"\x40"),
        expect=conn_error(COMPRESSION),
    ),
    "http2/4.3/2": case(
        "Sends a PRIORITY frame while sending the header blocks",
        headers(1, end_headers=False) + priority(1) + continuation(1, block(("x-dummy0", "x"))),
        expect=conn_error(PROTOCOL),
    ),
    "http2/4.3/3": case(
        "Sends a HEADERS frame to another stream while sending the header blocks",
        headers(1, end_headers=False) + headers(3, end=True) + continuation(1, block(("x-dummy0", "x"))),
        expect=conn_error(PROTOCOL),
    ),
    "http2/5.1/1": case("idle: Sends a DATA frame", data(1, b"test", end=True), expect=conn_error(PROTOCOL)),
    "http2/5.1/2": case(
        "idle: Sends a RST_STREAM frame", f.rst_stream(1, f.CANCEL), expect=conn_error(PROTOCOL)
    ),
    "http2/5.1/3": case(
        "idle: Sends a WINDOW_UPDATE frame", f.window_update(1, 100), expect=conn_error(PROTOCOL)
    ),
    "http2/5.1/4": case(
        "idle: Sends a CONTINUATION frame", continuation(1, REQUEST_BLOCK), expect=conn_error(PROTOCOL)
    ),
    "http2/5.1/5": case(
        "half closed (remote): Sends a DATA frame",
        headers(1, end=True) + data(1, b"test", end=True),
        expect=stream_error(CLOSED_STREAM),
    ),
    "http2/5.1/6": case(
        "half closed (remote): Sends a HEADERS frame",
        headers(1, end=True) + headers(1, end=True),
        expect=stream_error(CLOSED_STREAM),
    ),
    "http2/5.1/7": case(
        "half closed (remote): Sends a CONTINUATION frame",
        headers(1, end=True) + continuation(1, REQUEST_BLOCK),
        expect=conn_error(PROTOCOL),
    ),
    "http2/5.1/8": case(
        "closed: Sends a DATA frame after sending RST_STREAM frame",
        headers(1) + f.rst_stream(1, f.CANCEL) + data(1, b"test", end=True),
        expect=stream_error(CLOSED_STREAM),
    ),
    "http2/5.1/9": case(
        "closed: Sends a HEADERS frame after sending RST_STREAM frame",
        headers(1) + f.rst_stream(1, f.CANCEL) + headers(1, end=True),
        expect=conn_error(PROTOCOL),
        note=REUSED_NOTE,
    ),
    "http2/5.1/10": case(
        "closed: Sends a CONTINUATION frame after sending RST_STREAM frame",
        headers(1) + f.rst_stream(1, f.CANCEL) + continuation(1, block(("x-dummy0", "x"))),
        expect=conn_error(PROTOCOL),
    ),
    "http2/5.1/11": case(
        "closed: Sends a DATA frame",
        call(1),
        ended(1),
        data(1, b"test", end=True),
        expect=Expect(answered=True, reset=CLOSED_STREAM),
        after_an_answer=True,
    ),
    "http2/5.1/12": case(
        "closed: Sends a HEADERS frame",
        call(1),
        ended(1),
        headers(1, end=True),
        expect=Expect(answered=True, goaway=PROTOCOL),
        after_an_answer=True,
        note=REUSED_NOTE,
    ),
    "http2/5.1/13": case(
        "closed: Sends a CONTINUATION frame",
        call(1),
        ended(1),
        continuation(1, block(("x-dummy0", "x"))),
        expect=Expect(answered=True, goaway=PROTOCOL),
        after_an_answer=True,
    ),
    "http2/5.1.1/1": case(
        "Sends even-numbered stream identifier", headers(2, end=True), expect=conn_error(PROTOCOL)
    ),
    "http2/5.1.1/2": case(
        "Sends stream identifier that is numerically smaller than previous",
        headers(5, end=True) + headers(3, end=True),
        expect=conn_error(PROTOCOL),
    ),
    "http2/5.1.1/3": case(
        "Sends HEADERS frame with the stream which is in half-closed (remote) state",
        headers(5, end=True) + headers(5, end=True),
        expect=stream_error(CLOSED_STREAM, stream=5),
    ),
    # The relay advertises SETTINGS_MAX_CONCURRENT_STREAMS 1000 (CALLER_MAX_STREAMS): h2spec sends
    # that many HEADERS and one more, and the one beyond the limit is refused.
    "http2/5.1.2/1": case(
        "Sends HEADERS frames that causes their advertised concurrent stream limit to be exceeded",
        f.settings([(f.INITIAL_WINDOW_SIZE, 0)]),
        b"".join(headers(s, end=True) for s in range(1, 2 * 1000 + 2, 2)),
        expect=stream_error(f.REFUSED_STREAM, stream=2001),
    ),
    "http2/5.3.1/1": case(
        "Sends HEADERS frame that depends on itself",
        headers(1, end=True, priority=b"\x00\x00\x00\x01\xff"),
        expect=stream_error(PROTOCOL),
    ),
    "http2/5.3.1/2": case(
        "Sends PRIORITY frame that depend on itself", priority(1, depends_on=1), expect=stream_error(PROTOCOL)
    ),
    "http2/5.4.1/1": case(
        "Sends an invalid PING frame for connection close",
        f.frame(f.PING, 0, 3, bytes(8)),
        expect=Expect(goaway=PROTOCOL),
    ),
    "http2/5.5/1": case(
        "Sends an unknown extension frame",
        f.frame(0x16, 0, 0, bytes(8)),
        ping(),
        expect=Expect(ping_acked=bytes(8)),
    ),
    "http2/5.5/2": case(
        "Sends an unknown extension frame in the middle of a header block",
        headers(1, end=True, end_headers=False) + f.frame(0x16, 0, 0, bytes(8)),
        expect=conn_error(PROTOCOL),
    ),
}
