"""h2spec's generic and hpack cases (h2_cases.py has them all, with their sections)."""

from __future__ import annotations

from krproxy.h2 import frames as f
from tests.integration.h2_play import (
    ALIVE,
    ANSWERED,
    COMPRESSION,
    GET_NOTE,
    GOAWAY_NOTE,
    MESSAGE,
    REQUEST,
    REQUEST_BLOCK,
    RESPONDED,
    Case,
    Expect,
    acked,
    block,
    call,
    case,
    conn_error,
    continuation,
    data,
    ended,
    headers,
    hpack_case,
    ping,
    priority,
    request,
    trailers,
)

GENERIC: dict[str, Case] = {
    # -- generic: the frames a server must accept ------------------------------------------------
    "generic/1/1": case("Sends a client connection preface", expect=Expect(settings_first=True)),
    "generic/2/1": case("Sends a PRIORITY frame on idle stream", priority(1), expect=ALIVE),
    "generic/2/2": case(
        "Sends a WINDOW_UPDATE frame on half-closed (remote) stream",
        f.settings([(f.INITIAL_WINDOW_SIZE, 0)]),
        acked(2),
        call(1),
        f.window_update(1, 1),
        expect=Expect(data_lengths=(1,)),
    ),
    "generic/2/3": case(
        "Sends a PRIORITY frame on half-closed (remote) stream",
        f.settings([(f.INITIAL_WINDOW_SIZE, 0)]),
        acked(2),
        call(1),
        priority(1),
        f.window_update(1, 1),
        expect=Expect(data_lengths=(1,)),
    ),
    "generic/2/4": case(
        "Sends a RST_STREAM frame on half-closed (remote) stream",
        headers(1, end=True),
        f.rst_stream(1, f.CANCEL),
        expect=ALIVE,
    ),
    "generic/2/5": case(
        "Sends a PRIORITY frame on closed stream",
        call(1),
        ended(1),
        priority(1),
        expect=ANSWERED,
        after_an_answer=True,
    ),
    "generic/3.1/1": case("Sends a DATA frame", call(1), expect=ANSWERED),
    "generic/3.1/2": case(
        "Sends multiple DATA frames",
        headers(1) + data(1, MESSAGE[:2]) + data(1, MESSAGE[2:], end=True),
        expect=ANSWERED,
    ),
    "generic/3.1/3": case(
        "Sends a DATA frame with padding", headers(1) + data(1, MESSAGE, end=True, pad=6), expect=ANSWERED
    ),
    "generic/3.2/1": case("Sends a HEADERS frame", call(1), expect=ANSWERED),
    "generic/3.2/2": case(
        "Sends a HEADERS frame with padding", headers(1, pad=8) + data(1, MESSAGE, end=True), expect=ANSWERED
    ),
    "generic/3.2/3": case(
        "Sends a HEADERS frame with priority",
        headers(1, priority=b"\x00\x00\x00\x00\xff") + data(1, MESSAGE, end=True),
        expect=ANSWERED,
    ),
    "generic/3.3/1": case(
        "Sends a PRIORITY frame with priority 1", priority(1, weight=0), call(1), expect=ANSWERED
    ),
    "generic/3.3/2": case("Sends a PRIORITY frame with priority 256", priority(1), call(1), expect=ANSWERED),
    "generic/3.3/3": case(
        "Sends a PRIORITY frame with stream dependency",
        priority(3, depends_on=1, weight=0),
        call(1),
        expect=ANSWERED,
    ),
    "generic/3.3/4": case(
        "Sends a PRIORITY frame with exclusive",
        priority(1, weight=0, exclusive=True),
        call(1),
        expect=ANSWERED,
    ),
    "generic/3.3/5": case(
        "Sends a PRIORITY frame for an idle stream, then send a HEADER frame for a lower stream ID",
        priority(3),
        call(1),
        expect=ANSWERED,
    ),
    "generic/3.4/1": case("Sends a RST_STREAM frame", headers(1), f.rst_stream(1, f.CANCEL), expect=ALIVE),
    "generic/3.5/1": case(
        "Sends a SETTINGS frame",
        f.settings(
            [
                (f.HEADER_TABLE_SIZE, 4096),
                (f.ENABLE_PUSH, 1),
                (f.MAX_CONCURRENT_STREAMS, 100),
                (f.INITIAL_WINDOW_SIZE, 65535),
                (f.MAX_FRAME_SIZE, 16384),
                (f.MAX_HEADER_LIST_SIZE, 100),
            ]
        ),
        acked(2),
        expect=ALIVE,
    ),
    "generic/3.7/1": case(
        "Sends a PING frame", ping(b"h2spec\x00\x00"), expect=Expect(ping_acked=b"h2spec\x00\x00")
    ),
    "generic/3.8/1": case(
        "Sends a GOAWAY frame",
        f.goaway(0, f.NO_ERROR, b"h2spec"),
        expect=ALIVE,
        note=GOAWAY_NOTE,
    ),
    "generic/3.9/1": case(
        "Sends a WINDOW_UPDATE frame with stream ID 0", f.window_update(0, 1), expect=ALIVE
    ),
    "generic/3.9/2": case(
        "Sends a WINDOW_UPDATE frame with stream ID 1", call(1), f.window_update(1, 1), expect=ANSWERED
    ),
    "generic/3.10/1": case(
        "Sends a CONTINUATION frame",
        headers(1, REQUEST_BLOCK[:5], end_headers=False) + continuation(1, REQUEST_BLOCK[5:]),
        data(1, MESSAGE, end=True),
        expect=ANSWERED,
    ),
    "generic/3.10/2": case(
        "Sends multiple CONTINUATION frames",
        headers(1, REQUEST_BLOCK[:5], end_headers=False)
        + continuation(1, REQUEST_BLOCK[5:10], end_headers=False)
        + continuation(1, REQUEST_BLOCK[10:]),
        data(1, MESSAGE, end=True),
        expect=ANSWERED,
    ),
    "generic/4/1": case(
        "Sends a GET request",
        request((":method", "GET"), *REQUEST[1:]),
        expect=RESPONDED,
        note=GET_NOTE,
    ),
    "generic/4/2": case(
        "Sends a HEAD request",
        request((":method", "HEAD"), *REQUEST[1:]),
        expect=RESPONDED,
        note=GET_NOTE,
    ),
    "generic/4/3": case("Sends a POST request", call(1), expect=ANSWERED),
    "generic/4/4": case(
        "Sends a POST request with trailers",
        headers(1, block(*REQUEST, ("trailer", "x-test")))
        + data(1, MESSAGE)
        + trailers(("x-test", "ok"), end=True),
        expect=ANSWERED,
    ),
    "generic/5/1": hpack_case("Sends a indexed header field representation", b"\xba"),
    "generic/5/2": hpack_case(
        "Sends a literal header field with incremental indexing - indexed name",
        b"\x40\x87\xb5\x05\xb1\x61\xcc\x5a\x93\x84\x9c\x48\xac\xa4",
    ),
    "generic/5/3": hpack_case(
        "Sends a literal header field with incremental indexing - indexed name (with Huffman coding)",
        b"\x40\x0auser-agent\x06h2spec",
    ),
    "generic/5/4": hpack_case(
        "Sends a literal header field with incremental indexing - new name", b"\x40\x06x-test\x06h2spec"
    ),
    "generic/5/5": hpack_case(
        "Sends a literal header field with incremental indexing - new name (with Huffman coding)",
        b"\x40\x85\xf2\xb2\x4a\x84\xff\x84\x9c\x48\xac\xa4",
    ),
    "generic/5/6": hpack_case(
        "Sends a literal header field without indexing - indexed name", b"\x00\x0auser-agent\x06h2spec"
    ),
    "generic/5/7": hpack_case(
        "Sends a literal header field without indexing - indexed name (with Huffman coding)",
        b"\x00\x87\xb5\x05\xb1\x61\xcc\x5a\x93\x84\x9c\x48\xac\xa4",
    ),
    "generic/5/8": hpack_case(
        "Sends a literal header field without indexing - new name", b"\x00\x06x-test\x06h2spec"
    ),
    "generic/5/9": hpack_case(
        "Sends a literal header field without indexing - new name (huffman encoded)",
        b"\x00\x85\xf2\xb2\x4a\x84\xff\x84\x9c\x48\xac\xa4",
    ),
    "generic/5/10": hpack_case(
        "Sends a literal header field never indexed - indexed name", b"\x10\x0auser-agent\x06h2spec"
    ),
    "generic/5/11": hpack_case(
        "Sends a literal header field never indexed - indexed name (huffman encoded)",
        b"\x10\x87\xb5\x05\xb1\x61\xcc\x5a\x93\x84\x9c\x48\xac\xa4",
    ),
    "generic/5/12": hpack_case(
        "Sends a literal header field never indexed - new name", b"\x10\x06x-test\x06h2spec"
    ),
    "generic/5/13": hpack_case(
        "Sends a literal header field never indexed - new name (huffman encoded)",
        b"\x10\x85\xf2\xb2\x4a\x84\xff\x84\x9c\x48\xac\xa4",
    ),
    "generic/5/14": hpack_case("Sends a dynamic table size update", b"\x20", before=True),
    "generic/5/15": hpack_case("Sends multiple dynamic table size update", b"\x20\x3f\xe1\x1f", before=True),
    # -- hpack: decoding errors are connection errors COMPRESSION_ERROR (RFC 9113 §4.3) ----------
    "hpack/2.3.3/1": hpack_case(
        "Sends a header field representation with invalid index", b"\xfe", expect=conn_error(COMPRESSION)
    ),
    "hpack/4.2/1": hpack_case(
        "Sends a dynamic table size update at the end of header block",
        b"\x21",
        expect=conn_error(COMPRESSION),
    ),
    "hpack/5.2/1": hpack_case(
        "Sends a Huffman-encoded string literal representation with padding longer than 7 bits",
        b"\x00\x85\xf2\xb2\x4a\x84\xff\x84\x49\x50\x9f\xff",
        expect=conn_error(COMPRESSION),
    ),
    "hpack/5.2/2": hpack_case(
        "Sends a Huffman-encoded string literal representation padded by zero",
        b"\x00\x85\xf2\xb2\x4a\x84\xff\x83\x49\x50\x90",
        expect=conn_error(COMPRESSION),
    ),
    "hpack/5.2/3": hpack_case(
        "Sends a Huffman-encoded string literal representation containing the EOS symbol",
        b"\x00\x85\xf2\xb2\x4a\x87\xff\xff\xff\xfd\x25\x42\x7f",
        expect=conn_error(COMPRESSION),
    ),
    "hpack/6.1/1": hpack_case(
        "Sends a indexed header field representation with index 0", b"\x80", expect=conn_error(COMPRESSION)
    ),
    "hpack/6.3/1": hpack_case(
        "Sends a dynamic table size update larger than the value of SETTINGS_HEADER_TABLE_SIZE",
        b"\x3f\xe2\x1f",  # 4097: krproxy advertises no SETTINGS_HEADER_TABLE_SIZE, so 4096 holds
        before=True,
        expect=conn_error(COMPRESSION),
    ),
}
