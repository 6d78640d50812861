"""h2spec's http2 cases of RFC 7540/9113 sections 6 to 8 (h2_cases.py has them all)."""

from __future__ import annotations

from dataclasses import replace

from krproxy.h2 import frames as f
from tests.integration.h2_cases_http2 import HTTP2_STREAMS
from tests.integration.h2_play import (
    ALIVE,
    ANSWERED,
    CLOSED_STREAM,
    FLOW,
    FRAME_SIZE,
    GOAWAY_NOTE,
    MALFORMED_NOTE,
    MESSAGE,
    PATH,
    PING_NOT_ANSWERED,
    PROTOCOL,
    REQUEST,
    REQUEST_BLOCK,
    Case,
    Expect,
    acked,
    block,
    call,
    case,
    conn_error,
    continuation,
    data,
    got_data,
    headers,
    ping,
    priority,
    pseudo_first,
    request,
    stream_error,
    trailers,
    without,
)

HTTP2_FRAMES: dict[str, Case] = {
    "http2/6.1/1": case(
        "Sends a DATA frame with 0x0 stream identifier",
        data(0, b"test", end=True),
        expect=conn_error(PROTOCOL),
    ),
    "http2/6.1/2": case(
        'Sends a DATA frame on the stream that is not in "open" or "half-closed (local)" state',
        headers(1, end=True) + data(1, b"test", end=True),
        expect=stream_error(CLOSED_STREAM),
    ),
    "http2/6.1/3": case(
        "Sends a DATA frame with invalid pad length",
        headers(1, block(*REQUEST, ("content-length", "4")))
        + f.frame(f.DATA, f.PADDED | f.END_STREAM, 1, b"\x06Test"),
        expect=conn_error(PROTOCOL),
    ),
    # h2spec repeats these two of 4.3 under 6.2 (its note: "duplicated with 4.3").
    "http2/6.2/1": replace(
        HTTP2_STREAMS["http2/4.3/2"],
        title="Sends a HEADERS frame without the END_HEADERS flag, and a PRIORITY frame",
    ),
    "http2/6.2/2": replace(
        HTTP2_STREAMS["http2/4.3/3"],
        title="Sends a HEADERS frame to another stream while sending a HEADERS frame",
    ),
    "http2/6.2/3": case(
        "Sends a HEADERS frame with 0x0 stream identifier", headers(0, end=True), expect=conn_error(PROTOCOL)
    ),
    "http2/6.2/4": case(
        "Sends a HEADERS frame with invalid pad length",
        f.frame(
            f.HEADERS,
            f.END_STREAM | f.END_HEADERS | f.PADDED,
            1,
            bytes([len(REQUEST_BLOCK) + 2]) + REQUEST_BLOCK,
        ),
        expect=conn_error(PROTOCOL),
    ),
    "http2/6.3/1": case(
        "Sends a PRIORITY frame with 0x0 stream identifier", priority(0), expect=conn_error(PROTOCOL)
    ),
    "http2/6.3/2": case(
        "Sends a PRIORITY frame with a length other than 5 octets",
        headers(1, end=True) + f.frame(f.PRIORITY, 0, 1, b"\x80\x00\x00\x01"),
        expect=stream_error(FRAME_SIZE),
    ),
    "http2/6.4/1": case(
        "Sends a RST_STREAM frame with 0x0 stream identifier",
        f.rst_stream(0, f.CANCEL),
        expect=conn_error(PROTOCOL),
    ),
    "http2/6.4/2": case(
        "Sends a RST_STREAM frame on a idle stream", f.rst_stream(1, f.CANCEL), expect=conn_error(PROTOCOL)
    ),
    "http2/6.4/3": case(
        "Sends a RST_STREAM frame with a length other than 4 octets",
        headers(1, end=True) + f.frame(f.RST_STREAM, 0, 1, b"\x00\x00\x00"),
        expect=conn_error(FRAME_SIZE),
    ),
    "http2/6.5/1": case(
        "Sends a SETTINGS frame with ACK flag and payload",
        f.frame(f.SETTINGS, f.ACK, 0, b"\x00"),
        expect=conn_error(FRAME_SIZE),
    ),
    "http2/6.5/2": case(
        "Sends a SETTINGS frame with 0x1 stream identifier",
        f.frame(f.SETTINGS, 0, 1, b"\x00\x03\x00\x00\x00\x64"),
        expect=conn_error(PROTOCOL),
    ),
    "http2/6.5/3": case(
        "Sends a SETTINGS frame with a length other than a multiple of 6 octets",
        f.frame(f.SETTINGS, 0, 0, b"\x00\x03\x00\x00\x00\x64\x00\x02\x00"),
        expect=conn_error(FRAME_SIZE),
    ),
    "http2/6.5.2/1": case(
        "SETTINGS_ENABLE_PUSH (0x2): Sends the value other than 0 or 1",
        f.settings([(f.ENABLE_PUSH, 2)]),
        expect=conn_error(PROTOCOL),
    ),
    "http2/6.5.2/2": case(
        "SETTINGS_INITIAL_WINDOW_SIZE (0x4): Sends the value above the maximum flow control window size",
        f.settings([(f.INITIAL_WINDOW_SIZE, 2**31)]),
        expect=conn_error(FLOW),
    ),
    "http2/6.5.2/3": case(
        "SETTINGS_MAX_FRAME_SIZE (0x5): Sends the value below the initial value",
        f.settings([(f.MAX_FRAME_SIZE, 16_383)]),
        expect=conn_error(PROTOCOL),
    ),
    "http2/6.5.2/4": case(
        "SETTINGS_MAX_FRAME_SIZE (0x5): Sends the value above the maximum allowed frame size",
        f.settings([(f.MAX_FRAME_SIZE, 2**24)]),
        expect=conn_error(PROTOCOL),
    ),
    "http2/6.5.2/5": case(
        "Sends a SETTINGS frame with unknown identifier", f.settings([(0xFF, 1)]), acked(2), expect=ALIVE
    ),
    "http2/6.5.3/1": case(
        "Sends multiple values of SETTINGS_INITIAL_WINDOW_SIZE",
        f.settings([(f.INITIAL_WINDOW_SIZE, 100), (f.INITIAL_WINDOW_SIZE, 1)]),
        acked(2),
        call(1),
        expect=Expect(data_lengths=(1,)),
    ),
    "http2/6.5.3/2": case(
        "Sends a SETTINGS frame without ACK flag", f.settings([(f.ENABLE_PUSH, 0)]), acked(2), expect=ALIVE
    ),
    "http2/6.7/1": case(
        "Sends a PING frame", ping(b"h2spec\x00\x00"), expect=Expect(ping_acked=b"h2spec\x00\x00")
    ),
    "http2/6.7/2": case(
        "Sends a PING frame with ACK",
        ping(PING_NOT_ANSWERED, ack=True),
        ping(b"h2spec\x00\x00"),
        expect=Expect(ping_acked=b"h2spec\x00\x00"),
    ),
    "http2/6.7/3": case(
        "Sends a PING frame with a stream identifier field value other than 0x0",
        f.frame(f.PING, 0, 1, bytes(8)),
        expect=conn_error(PROTOCOL),
    ),
    "http2/6.7/4": case(
        "Sends a PING frame with a length field value other than 8",
        f.frame(f.PING, 0, 1, bytes(6)),
        expect=conn_error(PROTOCOL),
    ),
    "http2/6.8/1": case(
        "Sends a GOAWAY frame with a stream identifier other than 0x0",
        f.frame(f.GOAWAY, 0, 1, bytes(8)),
        expect=conn_error(PROTOCOL),
    ),
    "http2/6.9/1": case(
        "Sends a WINDOW_UPDATE frame with a flow control window increment of 0",
        f.window_update(0, 0),
        expect=conn_error(PROTOCOL),
    ),
    "http2/6.9/2": case(
        "Sends a WINDOW_UPDATE frame with a flow control window increment of 0 on a stream",
        headers(1) + f.window_update(1, 0),
        expect=stream_error(PROTOCOL),
    ),
    "http2/6.9/3": case(
        "Sends a WINDOW_UPDATE frame with a length other than 4 octets",
        f.frame(f.WINDOW_UPDATE, 0, 0, b"\x00\x00\x01"),
        expect=conn_error(FRAME_SIZE),
    ),
    "http2/6.9.1/1": case(
        "Sends SETTINGS frame to set the initial window size to 1 and sends HEADERS frame",
        f.settings([(f.INITIAL_WINDOW_SIZE, 1)]),
        acked(2),
        call(1),
        expect=Expect(data_lengths=(1,)),
    ),
    "http2/6.9.1/2": case(
        "Sends multiple WINDOW_UPDATE frames increasing the flow control window to above 2^31-1",
        f.window_update(0, f.MAX_WINDOW) + f.window_update(0, f.MAX_WINDOW),
        expect=conn_error(FLOW),
    ),
    "http2/6.9.1/3": case(
        "Sends multiple WINDOW_UPDATE frames increasing the flow control window to above 2^31-1 on a stream",
        headers(1) + f.window_update(1, f.MAX_WINDOW) + f.window_update(1, f.MAX_WINDOW),
        expect=stream_error(FLOW),
    ),
    "http2/6.9.2/1": case(
        "Changes SETTINGS_INITIAL_WINDOW_SIZE after sending HEADERS frame",
        f.settings([(f.INITIAL_WINDOW_SIZE, 0)]),
        acked(2),
        call(1),
        f.settings([(f.INITIAL_WINDOW_SIZE, 1)]),
        acked(3),
        expect=Expect(data_lengths=(1,)),
    ),
    # The window of 3 lets 3 octets of the answer out; 2 makes it -1, a WINDOW_UPDATE of 2 makes it 1:
    # the next DATA is 1 octet.
    "http2/6.9.2/2": case(
        "Sends a SETTINGS frame for window size to be negative",
        f.settings([(f.INITIAL_WINDOW_SIZE, 3)]),
        acked(2),
        call(1),
        got_data(1),
        f.settings([(f.INITIAL_WINDOW_SIZE, 2)]),
        acked(3),
        f.window_update(1, 2),
        got_data(1, 2),
        expect=Expect(data_lengths=(3, 1)),
    ),
    "http2/6.9.2/3": case(
        "Sends a SETTINGS_INITIAL_WINDOW_SIZE settings with an exceeded maximum window size value",
        f.frame(f.SETTINGS, 0, 0, b"\x00\x04\x80\x00\x00\x00"),
        expect=conn_error(FLOW),
    ),
    "http2/6.10/1": case(
        "Sends multiple CONTINUATION frames preceded by a HEADERS frame",
        headers(1, end_headers=False)
        + continuation(1, block(("x-dummy0", "x")), end_headers=False)
        + continuation(1, block(("x-dummy1", "x"))),
        data(1, MESSAGE, end=True),
        expect=ANSWERED,
    ),
    "http2/6.10/2": case(
        "Sends a CONTINUATION frame followed by any frame other than CONTINUATION",
        headers(1, end_headers=False)
        + continuation(1, block(("x-dummy0", "x")), end_headers=False)
        + data(1, b"test", end=True),
        expect=conn_error(PROTOCOL),
    ),
    "http2/6.10/3": case(
        "Sends a CONTINUATION frame with 0x0 stream identifier",
        headers(1, end=True, end_headers=False) + continuation(0, block(("x-dummy0", "x"))),
        expect=conn_error(PROTOCOL),
    ),
    "http2/6.10/4": case(
        "Sends a CONTINUATION frame preceded by a HEADERS frame with END_HEADERS flag",
        headers(1, end=True) + continuation(1, block(("x-dummy0", "x"))),
        expect=conn_error(PROTOCOL),
    ),
    "http2/6.10/5": case(
        "Sends a CONTINUATION frame preceded by a CONTINUATION frame with END_HEADERS flag",
        headers(1, end=True, end_headers=False)
        + continuation(1, block(("x-dummy0", "x")))
        + continuation(1, block(("x-dummy1", "x"))),
        expect=conn_error(PROTOCOL),
    ),
    "http2/6.10/6": case(
        "Sends a CONTINUATION frame preceded by a DATA frame",
        headers(1, end_headers=False)
        + data(1, b"test", end=True)
        + continuation(1, block(("x-dummy0", "x")), end_headers=False)
        + continuation(0, block(("x-dummy1", "x"))),
        expect=conn_error(PROTOCOL),
    ),
    "http2/7/1": case(
        "Sends a GOAWAY frame with unknown error code",
        f.goaway(0, 0xFF),
        expect=ALIVE,
        note=GOAWAY_NOTE,
    ),
    "http2/7/2": case(
        "Sends a RST_STREAM frame with unknown error code", headers(1), f.rst_stream(1, 0xFF), expect=ALIVE
    ),
    "http2/8.1/1": case(
        "Sends a second HEADERS frame without the END_STREAM flag",
        headers(1) + data(1, b"test") + trailers(("x-test", "ok")),
        expect=conn_error(PROTOCOL),
        note=MALFORMED_NOTE,
    ),
    "http2/8.1.2/1": case(
        "Sends a HEADERS frame that contains the header field name in uppercase letters",
        request(*REQUEST, ("X-TEST", "ok")),
        expect=stream_error(PROTOCOL),
    ),
    "http2/8.1.2.1/1": case(
        "Sends a HEADERS frame that contains a unknown pseudo-header field",
        request(*REQUEST, (":test", "ok")),
        expect=stream_error(PROTOCOL),
    ),
    "http2/8.1.2.1/2": case(
        "Sends a HEADERS frame that contains the pseudo-header field defined for response",
        request(*pseudo_first((":status", "200"))),
        expect=stream_error(PROTOCOL),
    ),
    "http2/8.1.2.1/3": case(
        "Sends a HEADERS frame that contains a pseudo-header field as trailers",
        headers(1) + data(1, b"test") + trailers((":method", "POST")),
        expect=conn_error(PROTOCOL),
        note=MALFORMED_NOTE,
    ),
    "http2/8.1.2.1/4": case(
        "Sends a HEADERS frame that contains a pseudo-header field that appears in a header block after a "
        "regular header field",
        request(("x-test", "ok"), *REQUEST),
        expect=stream_error(PROTOCOL),
    ),
    "http2/8.1.2.2/1": case(
        "Sends a HEADERS frame that contains the connection-specific header field",
        request(*REQUEST, ("connection", "keep-alive")),
        expect=stream_error(PROTOCOL),
    ),
    "http2/8.1.2.2/2": case(
        'Sends a HEADERS frame that contains the TE header field with any value other than "trailers"',
        request(*without("te"), ("trailers", "test"), ("te", "trailers, deflate")),
        expect=stream_error(PROTOCOL),
    ),
    "http2/8.1.2.3/1": case(
        'Sends a HEADERS frame with empty ":path" pseudo-header field',
        request(*((n, "" if n == ":path" else v) for n, v in REQUEST)),
        expect=stream_error(PROTOCOL),
    ),
    "http2/8.1.2.3/2": case(
        'Sends a HEADERS frame that omits ":method" pseudo-header field',
        request(*without(":method")),
        expect=stream_error(PROTOCOL),
    ),
    "http2/8.1.2.3/3": case(
        'Sends a HEADERS frame that omits ":scheme" pseudo-header field',
        request(*without(":scheme")),
        expect=stream_error(PROTOCOL),
    ),
    "http2/8.1.2.3/4": case(
        'Sends a HEADERS frame that omits ":path" pseudo-header field',
        request(*without(":path")),
        expect=stream_error(PROTOCOL),
    ),
    "http2/8.1.2.3/5": case(
        'Sends a HEADERS frame with duplicated ":method" pseudo-header field',
        request(*pseudo_first((":method", "POST"))),
        expect=stream_error(PROTOCOL),
    ),
    "http2/8.1.2.3/6": case(
        'Sends a HEADERS frame with duplicated ":scheme" pseudo-header field',
        request(*pseudo_first((":scheme", "http"))),
        expect=stream_error(PROTOCOL),
    ),
    "http2/8.1.2.3/7": case(
        'Sends a HEADERS frame with duplicated ":path" pseudo-header field',
        request(*pseudo_first((":path", PATH))),
        expect=stream_error(PROTOCOL),
    ),
    "http2/8.1.2.6/1": case(
        'Sends a HEADERS frame with the "content-length" header field which does not equal the DATA frame '
        "payload length",
        headers(1, block(*REQUEST, ("content-length", "1"))) + data(1, b"test", end=True),
        expect=stream_error(PROTOCOL),
    ),
    "http2/8.1.2.6/2": case(
        'Sends a HEADERS frame with the "content-length" header field which does not equal the sum of the '
        "multiple DATA frames payload length",
        headers(1, block(*REQUEST, ("content-length", "1"))) + data(1, b"test") + data(1, b"test", end=True),
        expect=stream_error(PROTOCOL),
    ),
    "http2/8.2/1": case(
        "Sends a PUSH_PROMISE frame",
        f.frame(f.PUSH_PROMISE, f.END_HEADERS, 1, (3).to_bytes(4, "big") + REQUEST_BLOCK),
        expect=conn_error(PROTOCOL),
    ),
}
