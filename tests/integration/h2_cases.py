"""The cases of the public HTTP/2 conformance suite (h2spec 2.x: generic, hpack, http2), as frames a
caller sends to a server and the verdict RFC 9113 / RFC 7541 ask of it.

Each case keeps h2spec's numbering (``http2/6.5.3/1``: package, section, number in the section)
and its description, and sends the frames h2spec's case sends, with a gRPC request where h2spec
sends its plain GET or POST (krproxy serves gRPC only). Where h2spec watches a response body
(flow control) the request carries a gRPC message, so that the runtime answers with one: those
cases, which h2spec skipped or failed against a gRPC server, are kept here with a body.

:func:`run` plays a case against a server's unix socket (the relay in memory, or ``krproxy
serve`` in front of a real containerd) and :func:`check` judges what came back. The tests are
``test_relay_conformance_suite.py`` (in front of a silent runtime or the fake containerd) and
``tests/e2e/test_relay_conformance_containerd.py`` (in front of real containerd's grpc-go, for the
cases whose verdict needs the runtime's answer).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from dataclasses import dataclass

import hpack

from krproxy.h2 import frames as f
from tests.unit.h2peer import split_frames

PATH = "/runtime.v1.RuntimeService/Version"
#: A gRPC request as kubelet sends it; h2spec's "common headers" are a GET of ``/``.
REQUEST = (
    (":method", "POST"),
    (":scheme", "http"),
    (":path", PATH),
    (":authority", "localhost"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
)
#: An empty VersionRequest: the runtime answers it with a message (a response body).
MESSAGE = b"\x00\x00\x00\x00\x00"
#: The probe PING sent after a case: its ACK shows the connection still serves.
PROBE = b"krprobe!"

Frame = tuple[int, int, int, bytes]  # type, flags, stream id, payload
Step = bytes | Callable[[list[Frame]], bool]  # bytes to send, or a wait until the frames read so far hold


def block(*fields: tuple[str, str]) -> bytes:
    """A header block of literal fields never indexed (each block stands alone: no dynamic table)."""
    return hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(n, v) for n, v in fields])


REQUEST_BLOCK = block(*REQUEST)


def headers(
    stream: int = 1,
    fragment: bytes = REQUEST_BLOCK,
    *,
    end: bool = False,
    end_headers: bool = True,
    priority: bytes = b"",
    pad: int | None = None,
) -> bytes:
    flags = (f.END_STREAM if end else 0) | (f.END_HEADERS if end_headers else 0)
    payload = priority + fragment
    if priority:
        flags |= f.PRIORITY_FLAG
    if pad is not None:
        flags |= f.PADDED
        payload = bytes([pad]) + payload + bytes(pad)
    return f.frame(f.HEADERS, flags, stream, payload)


def data(stream: int, payload: bytes, *, end: bool = False, pad: int | None = None) -> bytes:
    flags = f.END_STREAM if end else 0
    if pad is not None:
        flags |= f.PADDED
        payload = bytes([pad]) + payload + bytes(pad)
    return f.frame(f.DATA, flags, stream, payload)


def continuation(stream: int, fragment: bytes, *, end_headers: bool = True) -> bytes:
    return f.frame(f.CONTINUATION, f.END_HEADERS if end_headers else 0, stream, fragment)


def priority(stream: int, depends_on: int = 0, weight: int = 255, exclusive: bool = False) -> bytes:
    dependency = depends_on | (0x8000_0000 if exclusive else 0)
    return f.frame(f.PRIORITY, 0, stream, dependency.to_bytes(4, "big") + bytes([weight]))


def ping(payload: bytes = bytes(8), *, ack: bool = False) -> bytes:
    return f.frame(f.PING, f.ACK if ack else 0, 0, payload)


def call(stream: int = 1) -> bytes:
    """A whole gRPC call: HEADERS, then its message with END_STREAM."""
    return headers(stream) + data(stream, MESSAGE, end=True)


def acked(count: int) -> Callable[[list[Frame]], bool]:
    """Wait until the server has acknowledged ``count`` SETTINGS frames (the preface's is the first)."""
    return lambda seen: sum(1 for kind, flags, _, _ in seen if kind == f.SETTINGS and flags & f.ACK) >= count


def ended(stream: int) -> Callable[[list[Frame]], bool]:
    """Wait until the server has ended ``stream`` (a frame with END_STREAM, or RST_STREAM)."""

    def done(seen: list[Frame]) -> bool:
        return any(
            sid == stream and (kind == f.RST_STREAM or (kind in (f.HEADERS, f.DATA) and flags & f.END_STREAM))
            for kind, flags, sid, _ in seen
        )

    return done


def got_data(stream: int, count: int = 1) -> Callable[[list[Frame]], bool]:
    return lambda seen: sum(1 for kind, _, sid, _ in seen if kind == f.DATA and sid == stream) >= count


@dataclass(frozen=True)
class Expect:
    """What the server must answer. ``goaway``: a connection error with that code (GOAWAY, then
    the connection closes). ``reset``: RST_STREAM with that code on ``stream``, no GOAWAY.
    Otherwise no GOAWAY, and no RST_STREAM but NO_ERROR. ``answered``: a response (HEADERS) on
    ``stream``. ``data_lengths``: the first DATA frames on ``stream`` carry that many octets.
    ``closed``: the server closes the connection (a GOAWAY NO_ERROR allowed). ``settings_first``:
    the server's first frame is its SETTINGS. ``ping_acked``: a PING ACK with that payload came
    back, and none for a PING that was itself an ACK (``PING_NOT_ANSWERED``). Unless the
    connection must end, the probe PING sent after the case is answered."""

    goaway: int | None = None
    reset: int | None = None
    stream: int = 1
    answered: bool = False
    data_lengths: tuple[int, ...] = ()
    closed: bool = False
    settings_first: bool = False
    ping_acked: bytes | None = None
    #: ``stream`` is answered or refused: HEADERS, or RST_STREAM with any code.
    refused_or_answered: bool = False

    @property
    def needs_runtime(self) -> bool:
        """The verdict needs the runtime's answer (a response, a body, a stream it ended)."""
        return self.answered or self.refused_or_answered or bool(self.data_lengths)


@dataclass(frozen=True)
class Case:
    title: str
    steps: tuple[Step, ...]
    expect: Expect
    #: The case first needs the runtime to end a stream (steps wait for it).
    after_an_answer: bool = False
    #: The preface is in ``steps`` (the case sends its own, or none).
    own_preface: bool = False
    #: Where the verdict differs from h2spec's expectation, why (docs/testing.md shows it).
    note: str = ""

    @property
    def needs_runtime(self) -> bool:
        return self.expect.needs_runtime or self.after_an_answer


def _preface(*settings: tuple[int, int]) -> bytes:
    return f.PREFACE + f.settings(list(settings))


def _conn(code: int) -> Expect:
    return Expect(goaway=code)


def _stream(code: int, stream: int = 1) -> Expect:
    return Expect(reset=code, stream=stream)


ANSWERED = Expect(answered=True)
RESPONDED = Expect(refused_or_answered=True)
ALIVE = Expect()
PING_NOT_ANSWERED = b"invalid\x00"
#: A header block h2spec appends a representation to (RFC 7541 §6): the request, then ``rep``.
_WITH = REQUEST_BLOCK

PROTOCOL, FRAME_SIZE, FLOW, COMPRESSION, CLOSED_STREAM = (
    f.PROTOCOL_ERROR,
    f.FRAME_SIZE_ERROR,
    f.FLOW_CONTROL_ERROR,
    f.COMPRESSION_ERROR,
    f.STREAM_CLOSED,
)


def _c(title: str, *steps: Step, expect: Expect, note: str = "", **kw: bool) -> Case:
    return Case(title, steps, expect, note=note, **kw)


def _hpack(title: str, rep: bytes, *, before: bool = False, expect: Expect = ANSWERED) -> Case:
    fragment = rep + _WITH if before else _WITH + rep
    return _c(title, headers(1, fragment) + data(1, MESSAGE, end=True), expect=expect)


def _trailers(*fields: tuple[str, str], end: bool = False) -> bytes:
    return headers(1, block(*fields), end=end)


def _request(*fields: tuple[str, str], end: bool = True) -> bytes:
    return headers(1, block(*fields), end=end)


def _without(name: str) -> tuple[tuple[str, str], ...]:
    return tuple(field for field in REQUEST if field[0] != name)


def _pseudo_first(*extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    """The request with ``extra`` among its pseudo-header fields (after ``:authority``)."""
    return (*REQUEST[:4], *extra, *REQUEST[4:])


#: Why a verdict differs from h2spec's expectation.
GET_NOTE = (
    "h2spec expects a response; a gRPC runtime refuses a GET or HEAD (the fake in its 1.6 mode with RST_STREAM "
    "PROTOCOL_ERROR, containerd 1.7 and 2.1 with HTTP 405), and containerd 1.6 answers it not at all"
)
GOAWAY_NOTE = (
    "h2spec expects the close; the relay lets the calls in flight finish and keeps the connection until the "
    "caller closes it (RFC 9113 §6.8 asks no close of the receiver)"
)
REUSED_NOTE = (
    "RFC 9113 §5.1 asks a stream error STREAM_CLOSED; the relay takes the HEADERS as a new stream on a used id, "
    "a connection error PROTOCOL_ERROR (§5.1.1), which h2spec accepted (a closed connection)"
)
MALFORMED_NOTE = (
    "RFC 9113 §8.1.1 makes the request malformed, a stream error PROTOCOL_ERROR; the relay ends the connection "
    "(GOAWAY PROTOCOL_ERROR), which h2spec accepted: stricter than the RFC, and every call of that connection "
    "ends with it"
)

#: Every case of h2spec 2.x's default run (146; the two ``--strict`` cases are not in it).
CASES: dict[str, Case] = {
    # -- generic: the frames a server must accept ------------------------------------------------
    "generic/1/1": _c("Sends a client connection preface", expect=Expect(settings_first=True)),
    "generic/2/1": _c("Sends a PRIORITY frame on idle stream", priority(1), expect=ALIVE),
    "generic/2/2": _c(
        "Sends a WINDOW_UPDATE frame on half-closed (remote) stream",
        f.settings([(f.INITIAL_WINDOW_SIZE, 0)]),
        acked(2),
        call(1),
        f.window_update(1, 1),
        expect=Expect(data_lengths=(1,)),
    ),
    "generic/2/3": _c(
        "Sends a PRIORITY frame on half-closed (remote) stream",
        f.settings([(f.INITIAL_WINDOW_SIZE, 0)]),
        acked(2),
        call(1),
        priority(1),
        f.window_update(1, 1),
        expect=Expect(data_lengths=(1,)),
    ),
    "generic/2/4": _c(
        "Sends a RST_STREAM frame on half-closed (remote) stream",
        headers(1, end=True),
        f.rst_stream(1, f.CANCEL),
        expect=ALIVE,
    ),
    "generic/2/5": _c(
        "Sends a PRIORITY frame on closed stream",
        call(1),
        ended(1),
        priority(1),
        expect=ANSWERED,
        after_an_answer=True,
    ),
    "generic/3.1/1": _c("Sends a DATA frame", call(1), expect=ANSWERED),
    "generic/3.1/2": _c(
        "Sends multiple DATA frames",
        headers(1) + data(1, MESSAGE[:2]) + data(1, MESSAGE[2:], end=True),
        expect=ANSWERED,
    ),
    "generic/3.1/3": _c(
        "Sends a DATA frame with padding", headers(1) + data(1, MESSAGE, end=True, pad=6), expect=ANSWERED
    ),
    "generic/3.2/1": _c("Sends a HEADERS frame", call(1), expect=ANSWERED),
    "generic/3.2/2": _c(
        "Sends a HEADERS frame with padding", headers(1, pad=8) + data(1, MESSAGE, end=True), expect=ANSWERED
    ),
    "generic/3.2/3": _c(
        "Sends a HEADERS frame with priority",
        headers(1, priority=b"\x00\x00\x00\x00\xff") + data(1, MESSAGE, end=True),
        expect=ANSWERED,
    ),
    "generic/3.3/1": _c(
        "Sends a PRIORITY frame with priority 1", priority(1, weight=0), call(1), expect=ANSWERED
    ),
    "generic/3.3/2": _c("Sends a PRIORITY frame with priority 256", priority(1), call(1), expect=ANSWERED),
    "generic/3.3/3": _c(
        "Sends a PRIORITY frame with stream dependency",
        priority(3, depends_on=1, weight=0),
        call(1),
        expect=ANSWERED,
    ),
    "generic/3.3/4": _c(
        "Sends a PRIORITY frame with exclusive",
        priority(1, weight=0, exclusive=True),
        call(1),
        expect=ANSWERED,
    ),
    "generic/3.3/5": _c(
        "Sends a PRIORITY frame for an idle stream, then send a HEADER frame for a lower stream ID",
        priority(3),
        call(1),
        expect=ANSWERED,
    ),
    "generic/3.4/1": _c("Sends a RST_STREAM frame", headers(1), f.rst_stream(1, f.CANCEL), expect=ALIVE),
    "generic/3.5/1": _c(
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
    "generic/3.7/1": _c(
        "Sends a PING frame", ping(b"h2spec\x00\x00"), expect=Expect(ping_acked=b"h2spec\x00\x00")
    ),
    "generic/3.8/1": _c(
        "Sends a GOAWAY frame",
        f.goaway(0, f.NO_ERROR, b"h2spec"),
        expect=ALIVE,
        note=GOAWAY_NOTE,
    ),
    "generic/3.9/1": _c("Sends a WINDOW_UPDATE frame with stream ID 0", f.window_update(0, 1), expect=ALIVE),
    "generic/3.9/2": _c(
        "Sends a WINDOW_UPDATE frame with stream ID 1", call(1), f.window_update(1, 1), expect=ANSWERED
    ),
    "generic/3.10/1": _c(
        "Sends a CONTINUATION frame",
        headers(1, REQUEST_BLOCK[:5], end_headers=False) + continuation(1, REQUEST_BLOCK[5:]),
        data(1, MESSAGE, end=True),
        expect=ANSWERED,
    ),
    "generic/3.10/2": _c(
        "Sends multiple CONTINUATION frames",
        headers(1, REQUEST_BLOCK[:5], end_headers=False)
        + continuation(1, REQUEST_BLOCK[5:10], end_headers=False)
        + continuation(1, REQUEST_BLOCK[10:]),
        data(1, MESSAGE, end=True),
        expect=ANSWERED,
    ),
    "generic/4/1": _c(
        "Sends a GET request",
        _request((":method", "GET"), *REQUEST[1:]),
        expect=RESPONDED,
        note=GET_NOTE,
    ),
    "generic/4/2": _c(
        "Sends a HEAD request",
        _request((":method", "HEAD"), *REQUEST[1:]),
        expect=RESPONDED,
        note=GET_NOTE,
    ),
    "generic/4/3": _c("Sends a POST request", call(1), expect=ANSWERED),
    "generic/4/4": _c(
        "Sends a POST request with trailers",
        headers(1, block(*REQUEST, ("trailer", "x-test")))
        + data(1, MESSAGE)
        + _trailers(("x-test", "ok"), end=True),
        expect=ANSWERED,
    ),
    "generic/5/1": _hpack("Sends a indexed header field representation", b"\xba"),
    "generic/5/2": _hpack(
        "Sends a literal header field with incremental indexing - indexed name",
        b"\x40\x87\xb5\x05\xb1\x61\xcc\x5a\x93\x84\x9c\x48\xac\xa4",
    ),
    "generic/5/3": _hpack(
        "Sends a literal header field with incremental indexing - indexed name (with Huffman coding)",
        b"\x40\x0auser-agent\x06h2spec",
    ),
    "generic/5/4": _hpack(
        "Sends a literal header field with incremental indexing - new name", b"\x40\x06x-test\x06h2spec"
    ),
    "generic/5/5": _hpack(
        "Sends a literal header field with incremental indexing - new name (with Huffman coding)",
        b"\x40\x85\xf2\xb2\x4a\x84\xff\x84\x9c\x48\xac\xa4",
    ),
    "generic/5/6": _hpack(
        "Sends a literal header field without indexing - indexed name", b"\x00\x0auser-agent\x06h2spec"
    ),
    "generic/5/7": _hpack(
        "Sends a literal header field without indexing - indexed name (with Huffman coding)",
        b"\x00\x87\xb5\x05\xb1\x61\xcc\x5a\x93\x84\x9c\x48\xac\xa4",
    ),
    "generic/5/8": _hpack(
        "Sends a literal header field without indexing - new name", b"\x00\x06x-test\x06h2spec"
    ),
    "generic/5/9": _hpack(
        "Sends a literal header field without indexing - new name (huffman encoded)",
        b"\x00\x85\xf2\xb2\x4a\x84\xff\x84\x9c\x48\xac\xa4",
    ),
    "generic/5/10": _hpack(
        "Sends a literal header field never indexed - indexed name", b"\x10\x0auser-agent\x06h2spec"
    ),
    "generic/5/11": _hpack(
        "Sends a literal header field never indexed - indexed name (huffman encoded)",
        b"\x10\x87\xb5\x05\xb1\x61\xcc\x5a\x93\x84\x9c\x48\xac\xa4",
    ),
    "generic/5/12": _hpack(
        "Sends a literal header field never indexed - new name", b"\x10\x06x-test\x06h2spec"
    ),
    "generic/5/13": _hpack(
        "Sends a literal header field never indexed - new name (huffman encoded)",
        b"\x10\x85\xf2\xb2\x4a\x84\xff\x84\x9c\x48\xac\xa4",
    ),
    "generic/5/14": _hpack("Sends a dynamic table size update", b"\x20", before=True),
    "generic/5/15": _hpack("Sends multiple dynamic table size update", b"\x20\x3f\xe1\x1f", before=True),
    # -- hpack: decoding errors are connection errors COMPRESSION_ERROR (RFC 9113 §4.3) ----------
    "hpack/2.3.3/1": _hpack(
        "Sends a header field representation with invalid index", b"\xfe", expect=_conn(COMPRESSION)
    ),
    "hpack/4.2/1": _hpack(
        "Sends a dynamic table size update at the end of header block", b"\x21", expect=_conn(COMPRESSION)
    ),
    "hpack/5.2/1": _hpack(
        "Sends a Huffman-encoded string literal representation with padding longer than 7 bits",
        b"\x00\x85\xf2\xb2\x4a\x84\xff\x84\x49\x50\x9f\xff",
        expect=_conn(COMPRESSION),
    ),
    "hpack/5.2/2": _hpack(
        "Sends a Huffman-encoded string literal representation padded by zero",
        b"\x00\x85\xf2\xb2\x4a\x84\xff\x83\x49\x50\x90",
        expect=_conn(COMPRESSION),
    ),
    "hpack/5.2/3": _hpack(
        "Sends a Huffman-encoded string literal representation containing the EOS symbol",
        b"\x00\x85\xf2\xb2\x4a\x87\xff\xff\xff\xfd\x25\x42\x7f",
        expect=_conn(COMPRESSION),
    ),
    "hpack/6.1/1": _hpack(
        "Sends a indexed header field representation with index 0", b"\x80", expect=_conn(COMPRESSION)
    ),
    "hpack/6.3/1": _hpack(
        "Sends a dynamic table size update larger than the value of SETTINGS_HEADER_TABLE_SIZE",
        b"\x3f\xe2\x1f",  # 4097: krproxy advertises no SETTINGS_HEADER_TABLE_SIZE, so 4096 holds
        before=True,
        expect=_conn(COMPRESSION),
    ),
    # -- http2: RFC 7540 / 9113 section by section ------------------------------------------------
    "http2/3.5/1": _c("Sends client connection preface", expect=Expect(settings_first=True)),
    "http2/3.5/2": _c(
        "Sends invalid connection preface",
        b"INVALID CONNECTION PREFACE\r\n\r\n",
        expect=_conn(PROTOCOL),
        own_preface=True,
    ),
    "http2/4.1/1": _c(
        "Sends a frame with unknown type",
        f.frame(0x16, 0, 0, bytes(8)),
        ping(),
        expect=Expect(ping_acked=bytes(8)),
    ),
    "http2/4.1/2": _c(
        "Sends a frame with undefined flag",
        f.frame(f.PING, 0x16, 0, bytes(8)),
        expect=Expect(ping_acked=bytes(8)),
    ),
    "http2/4.1/3": _c(
        "Sends a frame with reserved field bit",
        f.HEAD.pack(8 >> 16, 8 & 0xFFFF, f.PING, 0x16, 0x8000_0000) + bytes(8),
        expect=Expect(ping_acked=bytes(8)),
    ),
    "http2/4.2/1": _c(
        "Sends a DATA frame with 2^14 octets in length",
        headers(1) + data(1, b"\x00" + (16_384 - 5).to_bytes(4, "big") + bytes(16_384 - 5), end=True),
        expect=ANSWERED,
    ),
    "http2/4.2/2": _c(
        "Sends a large size DATA frame that exceeds the SETTINGS_MAX_FRAME_SIZE",
        headers(1) + data(1, bytes(16_385), end=True),
        expect=_conn(FRAME_SIZE),
    ),
    "http2/4.2/3": _c(
        "Sends a large size HEADERS frame that exceeds the SETTINGS_MAX_FRAME_SIZE",
        headers(1, block(*REQUEST, *((f"x-dummy{i}", "x" * 4000) for i in range(5))), end=True),
        expect=_conn(FRAME_SIZE),
    ),
    "http2/4.3/1": _c(
        "Sends invalid header block fragment",
        f.frame(f.HEADERS, f.END_STREAM | f.END_HEADERS, 1, b"\x40"),
        expect=_conn(COMPRESSION),
    ),
    "http2/4.3/2": _c(
        "Sends a PRIORITY frame while sending the header blocks",
        headers(1, end_headers=False) + priority(1) + continuation(1, block(("x-dummy0", "x"))),
        expect=_conn(PROTOCOL),
    ),
    "http2/4.3/3": _c(
        "Sends a HEADERS frame to another stream while sending the header blocks",
        headers(1, end_headers=False) + headers(3, end=True) + continuation(1, block(("x-dummy0", "x"))),
        expect=_conn(PROTOCOL),
    ),
    "http2/5.1/1": _c("idle: Sends a DATA frame", data(1, b"test", end=True), expect=_conn(PROTOCOL)),
    "http2/5.1/2": _c("idle: Sends a RST_STREAM frame", f.rst_stream(1, f.CANCEL), expect=_conn(PROTOCOL)),
    "http2/5.1/3": _c("idle: Sends a WINDOW_UPDATE frame", f.window_update(1, 100), expect=_conn(PROTOCOL)),
    "http2/5.1/4": _c(
        "idle: Sends a CONTINUATION frame", continuation(1, REQUEST_BLOCK), expect=_conn(PROTOCOL)
    ),
    "http2/5.1/5": _c(
        "half closed (remote): Sends a DATA frame",
        headers(1, end=True) + data(1, b"test", end=True),
        expect=_stream(CLOSED_STREAM),
    ),
    "http2/5.1/6": _c(
        "half closed (remote): Sends a HEADERS frame",
        headers(1, end=True) + headers(1, end=True),
        expect=_stream(CLOSED_STREAM),
    ),
    "http2/5.1/7": _c(
        "half closed (remote): Sends a CONTINUATION frame",
        headers(1, end=True) + continuation(1, REQUEST_BLOCK),
        expect=_conn(PROTOCOL),
    ),
    "http2/5.1/8": _c(
        "closed: Sends a DATA frame after sending RST_STREAM frame",
        headers(1) + f.rst_stream(1, f.CANCEL) + data(1, b"test", end=True),
        expect=_stream(CLOSED_STREAM),
    ),
    "http2/5.1/9": _c(
        "closed: Sends a HEADERS frame after sending RST_STREAM frame",
        headers(1) + f.rst_stream(1, f.CANCEL) + headers(1, end=True),
        expect=_conn(PROTOCOL),
        note=REUSED_NOTE,
    ),
    "http2/5.1/10": _c(
        "closed: Sends a CONTINUATION frame after sending RST_STREAM frame",
        headers(1) + f.rst_stream(1, f.CANCEL) + continuation(1, block(("x-dummy0", "x"))),
        expect=_conn(PROTOCOL),
    ),
    "http2/5.1/11": _c(
        "closed: Sends a DATA frame",
        call(1),
        ended(1),
        data(1, b"test", end=True),
        expect=Expect(answered=True, reset=CLOSED_STREAM),
        after_an_answer=True,
    ),
    "http2/5.1/12": _c(
        "closed: Sends a HEADERS frame",
        call(1),
        ended(1),
        headers(1, end=True),
        expect=Expect(answered=True, goaway=PROTOCOL),
        after_an_answer=True,
        note=REUSED_NOTE,
    ),
    "http2/5.1/13": _c(
        "closed: Sends a CONTINUATION frame",
        call(1),
        ended(1),
        continuation(1, block(("x-dummy0", "x"))),
        expect=Expect(answered=True, goaway=PROTOCOL),
        after_an_answer=True,
    ),
    "http2/5.1.1/1": _c(
        "Sends even-numbered stream identifier", headers(2, end=True), expect=_conn(PROTOCOL)
    ),
    "http2/5.1.1/2": _c(
        "Sends stream identifier that is numerically smaller than previous",
        headers(5, end=True) + headers(3, end=True),
        expect=_conn(PROTOCOL),
    ),
    "http2/5.1.1/3": _c(
        "Sends HEADERS frame with the stream which is in half-closed (remote) state",
        headers(5, end=True) + headers(5, end=True),
        expect=_stream(CLOSED_STREAM, stream=5),
    ),
    # The relay advertises SETTINGS_MAX_CONCURRENT_STREAMS 1000 (CALLER_MAX_STREAMS): h2spec sends
    # that many HEADERS and one more, and the one beyond the limit is refused.
    "http2/5.1.2/1": _c(
        "Sends HEADERS frames that causes their advertised concurrent stream limit to be exceeded",
        f.settings([(f.INITIAL_WINDOW_SIZE, 0)]),
        b"".join(headers(s, end=True) for s in range(1, 2 * 1000 + 2, 2)),
        expect=_stream(f.REFUSED_STREAM, stream=2001),
    ),
    "http2/5.3.1/1": _c(
        "Sends HEADERS frame that depends on itself",
        headers(1, end=True, priority=b"\x00\x00\x00\x01\xff"),
        expect=_stream(PROTOCOL),
    ),
    "http2/5.3.1/2": _c(
        "Sends PRIORITY frame that depend on itself", priority(1, depends_on=1), expect=_stream(PROTOCOL)
    ),
    "http2/5.4.1/1": _c(
        "Sends an invalid PING frame for connection close",
        f.frame(f.PING, 0, 3, bytes(8)),
        expect=Expect(goaway=PROTOCOL),
    ),
    "http2/5.5/1": _c(
        "Sends an unknown extension frame",
        f.frame(0x16, 0, 0, bytes(8)),
        ping(),
        expect=Expect(ping_acked=bytes(8)),
    ),
    "http2/5.5/2": _c(
        "Sends an unknown extension frame in the middle of a header block",
        headers(1, end=True, end_headers=False) + f.frame(0x16, 0, 0, bytes(8)),
        expect=_conn(PROTOCOL),
    ),
    "http2/6.1/1": _c(
        "Sends a DATA frame with 0x0 stream identifier", data(0, b"test", end=True), expect=_conn(PROTOCOL)
    ),
    "http2/6.1/2": _c(
        'Sends a DATA frame on the stream that is not in "open" or "half-closed (local)" state',
        headers(1, end=True) + data(1, b"test", end=True),
        expect=_stream(CLOSED_STREAM),
    ),
    "http2/6.1/3": _c(
        "Sends a DATA frame with invalid pad length",
        headers(1, block(*REQUEST, ("content-length", "4")))
        + f.frame(f.DATA, f.PADDED | f.END_STREAM, 1, b"\x06Test"),
        expect=_conn(PROTOCOL),
    ),
    "http2/6.2/1": _c(
        "Sends a HEADERS frame without the END_HEADERS flag, and a PRIORITY frame",
        headers(1, end_headers=False) + priority(1) + continuation(1, block(("x-dummy0", "x"))),
        expect=_conn(PROTOCOL),
    ),
    "http2/6.2/2": _c(
        "Sends a HEADERS frame to another stream while sending a HEADERS frame",
        headers(1, end_headers=False) + headers(3, end=True) + continuation(1, block(("x-dummy0", "x"))),
        expect=_conn(PROTOCOL),
    ),
    "http2/6.2/3": _c(
        "Sends a HEADERS frame with 0x0 stream identifier", headers(0, end=True), expect=_conn(PROTOCOL)
    ),
    "http2/6.2/4": _c(
        "Sends a HEADERS frame with invalid pad length",
        f.frame(
            f.HEADERS,
            f.END_STREAM | f.END_HEADERS | f.PADDED,
            1,
            bytes([len(REQUEST_BLOCK) + 2]) + REQUEST_BLOCK,
        ),
        expect=_conn(PROTOCOL),
    ),
    "http2/6.3/1": _c(
        "Sends a PRIORITY frame with 0x0 stream identifier", priority(0), expect=_conn(PROTOCOL)
    ),
    "http2/6.3/2": _c(
        "Sends a PRIORITY frame with a length other than 5 octets",
        headers(1, end=True) + f.frame(f.PRIORITY, 0, 1, b"\x80\x00\x00\x01"),
        expect=_stream(FRAME_SIZE),
    ),
    "http2/6.4/1": _c(
        "Sends a RST_STREAM frame with 0x0 stream identifier",
        f.rst_stream(0, f.CANCEL),
        expect=_conn(PROTOCOL),
    ),
    "http2/6.4/2": _c(
        "Sends a RST_STREAM frame on a idle stream", f.rst_stream(1, f.CANCEL), expect=_conn(PROTOCOL)
    ),
    "http2/6.4/3": _c(
        "Sends a RST_STREAM frame with a length other than 4 octets",
        headers(1, end=True) + f.frame(f.RST_STREAM, 0, 1, b"\x00\x00\x00"),
        expect=_conn(FRAME_SIZE),
    ),
    "http2/6.5/1": _c(
        "Sends a SETTINGS frame with ACK flag and payload",
        f.frame(f.SETTINGS, f.ACK, 0, b"\x00"),
        expect=_conn(FRAME_SIZE),
    ),
    "http2/6.5/2": _c(
        "Sends a SETTINGS frame with 0x1 stream identifier",
        f.frame(f.SETTINGS, 0, 1, b"\x00\x03\x00\x00\x00\x64"),
        expect=_conn(PROTOCOL),
    ),
    "http2/6.5/3": _c(
        "Sends a SETTINGS frame with a length other than a multiple of 6 octets",
        f.frame(f.SETTINGS, 0, 0, b"\x00\x03\x00\x00\x00\x64\x00\x02\x00"),
        expect=_conn(FRAME_SIZE),
    ),
    "http2/6.5.2/1": _c(
        "SETTINGS_ENABLE_PUSH (0x2): Sends the value other than 0 or 1",
        f.settings([(f.ENABLE_PUSH, 2)]),
        expect=_conn(PROTOCOL),
    ),
    "http2/6.5.2/2": _c(
        "SETTINGS_INITIAL_WINDOW_SIZE (0x4): Sends the value above the maximum flow control window size",
        f.settings([(f.INITIAL_WINDOW_SIZE, 2**31)]),
        expect=_conn(FLOW),
    ),
    "http2/6.5.2/3": _c(
        "SETTINGS_MAX_FRAME_SIZE (0x5): Sends the value below the initial value",
        f.settings([(f.MAX_FRAME_SIZE, 16_383)]),
        expect=_conn(PROTOCOL),
    ),
    "http2/6.5.2/4": _c(
        "SETTINGS_MAX_FRAME_SIZE (0x5): Sends the value above the maximum allowed frame size",
        f.settings([(f.MAX_FRAME_SIZE, 2**24)]),
        expect=_conn(PROTOCOL),
    ),
    "http2/6.5.2/5": _c(
        "Sends a SETTINGS frame with unknown identifier", f.settings([(0xFF, 1)]), acked(2), expect=ALIVE
    ),
    "http2/6.5.3/1": _c(
        "Sends multiple values of SETTINGS_INITIAL_WINDOW_SIZE",
        f.settings([(f.INITIAL_WINDOW_SIZE, 100), (f.INITIAL_WINDOW_SIZE, 1)]),
        acked(2),
        call(1),
        expect=Expect(data_lengths=(1,)),
    ),
    "http2/6.5.3/2": _c(
        "Sends a SETTINGS frame without ACK flag", f.settings([(f.ENABLE_PUSH, 0)]), acked(2), expect=ALIVE
    ),
    "http2/6.7/1": _c(
        "Sends a PING frame", ping(b"h2spec\x00\x00"), expect=Expect(ping_acked=b"h2spec\x00\x00")
    ),
    "http2/6.7/2": _c(
        "Sends a PING frame with ACK",
        ping(PING_NOT_ANSWERED, ack=True),
        ping(b"h2spec\x00\x00"),
        expect=Expect(ping_acked=b"h2spec\x00\x00"),
    ),
    "http2/6.7/3": _c(
        "Sends a PING frame with a stream identifier field value other than 0x0",
        f.frame(f.PING, 0, 1, bytes(8)),
        expect=_conn(PROTOCOL),
    ),
    "http2/6.7/4": _c(
        "Sends a PING frame with a length field value other than 8",
        f.frame(f.PING, 0, 1, bytes(6)),
        expect=_conn(PROTOCOL),
    ),
    "http2/6.8/1": _c(
        "Sends a GOAWAY frame with a stream identifier other than 0x0",
        f.frame(f.GOAWAY, 0, 1, bytes(8)),
        expect=_conn(PROTOCOL),
    ),
    "http2/6.9/1": _c(
        "Sends a WINDOW_UPDATE frame with a flow control window increment of 0",
        f.window_update(0, 0),
        expect=_conn(PROTOCOL),
    ),
    "http2/6.9/2": _c(
        "Sends a WINDOW_UPDATE frame with a flow control window increment of 0 on a stream",
        headers(1) + f.window_update(1, 0),
        expect=_stream(PROTOCOL),
    ),
    "http2/6.9/3": _c(
        "Sends a WINDOW_UPDATE frame with a length other than 4 octets",
        f.frame(f.WINDOW_UPDATE, 0, 0, b"\x00\x00\x01"),
        expect=_conn(FRAME_SIZE),
    ),
    "http2/6.9.1/1": _c(
        "Sends SETTINGS frame to set the initial window size to 1 and sends HEADERS frame",
        f.settings([(f.INITIAL_WINDOW_SIZE, 1)]),
        acked(2),
        call(1),
        expect=Expect(data_lengths=(1,)),
    ),
    "http2/6.9.1/2": _c(
        "Sends multiple WINDOW_UPDATE frames increasing the flow control window to above 2^31-1",
        f.window_update(0, f.MAX_WINDOW) + f.window_update(0, f.MAX_WINDOW),
        expect=_conn(FLOW),
    ),
    "http2/6.9.1/3": _c(
        "Sends multiple WINDOW_UPDATE frames increasing the flow control window to above 2^31-1 on a stream",
        headers(1) + f.window_update(1, f.MAX_WINDOW) + f.window_update(1, f.MAX_WINDOW),
        expect=_stream(FLOW),
    ),
    "http2/6.9.2/1": _c(
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
    "http2/6.9.2/2": _c(
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
    "http2/6.9.2/3": _c(
        "Sends a SETTINGS_INITIAL_WINDOW_SIZE settings with an exceeded maximum window size value",
        f.frame(f.SETTINGS, 0, 0, b"\x00\x04\x80\x00\x00\x00"),
        expect=_conn(FLOW),
    ),
    "http2/6.10/1": _c(
        "Sends multiple CONTINUATION frames preceded by a HEADERS frame",
        headers(1, end_headers=False)
        + continuation(1, block(("x-dummy0", "x")), end_headers=False)
        + continuation(1, block(("x-dummy1", "x"))),
        data(1, MESSAGE, end=True),
        expect=ANSWERED,
    ),
    "http2/6.10/2": _c(
        "Sends a CONTINUATION frame followed by any frame other than CONTINUATION",
        headers(1, end_headers=False)
        + continuation(1, block(("x-dummy0", "x")), end_headers=False)
        + data(1, b"test", end=True),
        expect=_conn(PROTOCOL),
    ),
    "http2/6.10/3": _c(
        "Sends a CONTINUATION frame with 0x0 stream identifier",
        headers(1, end=True, end_headers=False) + continuation(0, block(("x-dummy0", "x"))),
        expect=_conn(PROTOCOL),
    ),
    "http2/6.10/4": _c(
        "Sends a CONTINUATION frame preceded by a HEADERS frame with END_HEADERS flag",
        headers(1, end=True) + continuation(1, block(("x-dummy0", "x"))),
        expect=_conn(PROTOCOL),
    ),
    "http2/6.10/5": _c(
        "Sends a CONTINUATION frame preceded by a CONTINUATION frame with END_HEADERS flag",
        headers(1, end=True, end_headers=False)
        + continuation(1, block(("x-dummy0", "x")))
        + continuation(1, block(("x-dummy1", "x"))),
        expect=_conn(PROTOCOL),
    ),
    "http2/6.10/6": _c(
        "Sends a CONTINUATION frame preceded by a DATA frame",
        headers(1, end_headers=False)
        + data(1, b"test", end=True)
        + continuation(1, block(("x-dummy0", "x")), end_headers=False)
        + continuation(0, block(("x-dummy1", "x"))),
        expect=_conn(PROTOCOL),
    ),
    "http2/7/1": _c(
        "Sends a GOAWAY frame with unknown error code",
        f.goaway(0, 0xFF),
        expect=ALIVE,
        note=GOAWAY_NOTE,
    ),
    "http2/7/2": _c(
        "Sends a RST_STREAM frame with unknown error code", headers(1), f.rst_stream(1, 0xFF), expect=ALIVE
    ),
    "http2/8.1/1": _c(
        "Sends a second HEADERS frame without the END_STREAM flag",
        headers(1) + data(1, b"test") + _trailers(("x-test", "ok")),
        expect=_conn(PROTOCOL),
        note=MALFORMED_NOTE,
    ),
    "http2/8.1.2/1": _c(
        "Sends a HEADERS frame that contains the header field name in uppercase letters",
        _request(*REQUEST, ("X-TEST", "ok")),
        expect=_stream(PROTOCOL),
    ),
    "http2/8.1.2.1/1": _c(
        "Sends a HEADERS frame that contains a unknown pseudo-header field",
        _request(*REQUEST, (":test", "ok")),
        expect=_stream(PROTOCOL),
    ),
    "http2/8.1.2.1/2": _c(
        "Sends a HEADERS frame that contains the pseudo-header field defined for response",
        _request(*_pseudo_first((":status", "200"))),
        expect=_stream(PROTOCOL),
    ),
    "http2/8.1.2.1/3": _c(
        "Sends a HEADERS frame that contains a pseudo-header field as trailers",
        headers(1) + data(1, b"test") + _trailers((":method", "POST")),
        expect=_conn(PROTOCOL),
        note=MALFORMED_NOTE,
    ),
    "http2/8.1.2.1/4": _c(
        "Sends a HEADERS frame that contains a pseudo-header field that appears in a header block after a "
        "regular header field",
        _request(("x-test", "ok"), *REQUEST),
        expect=_stream(PROTOCOL),
    ),
    "http2/8.1.2.2/1": _c(
        "Sends a HEADERS frame that contains the connection-specific header field",
        _request(*REQUEST, ("connection", "keep-alive")),
        expect=_stream(PROTOCOL),
    ),
    "http2/8.1.2.2/2": _c(
        'Sends a HEADERS frame that contains the TE header field with any value other than "trailers"',
        _request(*_without("te"), ("trailers", "test"), ("te", "trailers, deflate")),
        expect=_stream(PROTOCOL),
    ),
    "http2/8.1.2.3/1": _c(
        'Sends a HEADERS frame with empty ":path" pseudo-header field',
        _request(*((n, "" if n == ":path" else v) for n, v in REQUEST)),
        expect=_stream(PROTOCOL),
    ),
    "http2/8.1.2.3/2": _c(
        'Sends a HEADERS frame that omits ":method" pseudo-header field',
        _request(*_without(":method")),
        expect=_stream(PROTOCOL),
    ),
    "http2/8.1.2.3/3": _c(
        'Sends a HEADERS frame that omits ":scheme" pseudo-header field',
        _request(*_without(":scheme")),
        expect=_stream(PROTOCOL),
    ),
    "http2/8.1.2.3/4": _c(
        'Sends a HEADERS frame that omits ":path" pseudo-header field',
        _request(*_without(":path")),
        expect=_stream(PROTOCOL),
    ),
    "http2/8.1.2.3/5": _c(
        'Sends a HEADERS frame with duplicated ":method" pseudo-header field',
        _request(*_pseudo_first((":method", "POST"))),
        expect=_stream(PROTOCOL),
    ),
    "http2/8.1.2.3/6": _c(
        'Sends a HEADERS frame with duplicated ":scheme" pseudo-header field',
        _request(*_pseudo_first((":scheme", "http"))),
        expect=_stream(PROTOCOL),
    ),
    "http2/8.1.2.3/7": _c(
        'Sends a HEADERS frame with duplicated ":path" pseudo-header field',
        _request(*_pseudo_first((":path", PATH))),
        expect=_stream(PROTOCOL),
    ),
    "http2/8.1.2.6/1": _c(
        'Sends a HEADERS frame with the "content-length" header field which does not equal the DATA frame '
        "payload length",
        headers(1, block(*REQUEST, ("content-length", "1"))) + data(1, b"test", end=True),
        expect=_stream(PROTOCOL),
    ),
    "http2/8.1.2.6/2": _c(
        'Sends a HEADERS frame with the "content-length" header field which does not equal the sum of the '
        "multiple DATA frames payload length",
        headers(1, block(*REQUEST, ("content-length", "1"))) + data(1, b"test") + data(1, b"test", end=True),
        expect=_stream(PROTOCOL),
    ),
    "http2/8.2/1": _c(
        "Sends a PUSH_PROMISE frame",
        f.frame(f.PUSH_PROMISE, f.END_HEADERS, 1, (3).to_bytes(4, "big") + REQUEST_BLOCK),
        expect=_conn(PROTOCOL),
    ),
}

#: h2spec's section titles, for the docs' table.
SECTIONS = {
    "generic/1": "Starting HTTP/2",
    "generic/2": "Streams and Multiplexing",
    "generic/3.1": "DATA",
    "generic/3.2": "HEADERS",
    "generic/3.3": "PRIORITY",
    "generic/3.4": "RST_STREAM",
    "generic/3.5": "SETTINGS",
    "generic/3.7": "PING",
    "generic/3.8": "GOAWAY",
    "generic/3.9": "WINDOW_UPDATE",
    "generic/3.10": "CONTINUATION",
    "generic/4": "HTTP Message Exchanges",
    "generic/5": "HPACK",
    "hpack/2.3.3": "Index Address Space",
    "hpack/4.2": "Maximum Table Size",
    "hpack/5.2": "String Literal Representation",
    "hpack/6.1": "Indexed Header Field Representation",
    "hpack/6.3": "Dynamic Table Size Update",
    "http2/3.5": "HTTP/2 Connection Preface",
    "http2/4.1": "Frame Format",
    "http2/4.2": "Frame Size",
    "http2/4.3": "Header Compression and Decompression",
    "http2/5.1": "Stream States",
    "http2/5.1.1": "Stream Identifiers",
    "http2/5.1.2": "Stream Concurrency",
    "http2/5.3.1": "Stream Dependencies",
    "http2/5.4.1": "Connection Error Handling",
    "http2/5.5": "Extending HTTP/2",
    "http2/6.1": "DATA",
    "http2/6.2": "HEADERS",
    "http2/6.3": "PRIORITY",
    "http2/6.4": "RST_STREAM",
    "http2/6.5": "SETTINGS",
    "http2/6.5.2": "Defined SETTINGS Parameters",
    "http2/6.5.3": "Settings Synchronization",
    "http2/6.7": "PING",
    "http2/6.8": "GOAWAY",
    "http2/6.9": "WINDOW_UPDATE",
    "http2/6.9.1": "The Flow-Control Window",
    "http2/6.9.2": "Initial Flow-Control Window Size",
    "http2/6.10": "CONTINUATION",
    "http2/7": "Error Codes",
    "http2/8.1": "HTTP Request/Response Exchange",
    "http2/8.1.2": "HTTP Header Fields",
    "http2/8.1.2.1": "Pseudo-Header Fields",
    "http2/8.1.2.2": "Connection-Specific Header Fields",
    "http2/8.1.2.3": "Request Pseudo-Header Fields",
    "http2/8.1.2.6": "Malformed Requests and Responses",
    "http2/8.2": "Server Push",
}


_NAMES = {
    f.DATA: "DATA",
    f.HEADERS: "HEADERS",
    f.RST_STREAM: "RST_STREAM",
    f.SETTINGS: "SETTINGS",
    f.PING: "PING",
    f.GOAWAY: "GOAWAY",
    f.WINDOW_UPDATE: "WINDOW_UPDATE",
}


@dataclass
class Seen:
    frames: list[Frame]
    closed: bool  # the server closed (or reset) the connection
    timed_out: bool = False  # a read met the bound

    def __str__(self) -> str:
        kinds = [f"{_NAMES.get(k, k)}({s})" for k, _, s, _ in self.frames]
        return f"frames {' '.join(kinds)}; closed {self.closed}, timed out {self.timed_out}"


def _read(sock: socket.socket, seen: Seen, until: Callable[[list[Frame]], bool], buf: bytearray) -> None:
    while not seen.closed and not seen.timed_out and not until(seen.frames):
        try:
            chunk = sock.recv(65536)
        except TimeoutError:  # the bound met: what came is judged as it is
            seen.timed_out = True
            break
        except (ConnectionResetError, BrokenPipeError):
            chunk = b""
        if not chunk:
            seen.closed = True
            break
        frames, rest = split_frames(bytes(buf) + chunk)
        buf[:] = rest
        seen.frames += frames


def _probe_answered(frames: list[Frame]) -> bool:
    return any(kind == f.PING and flags & f.ACK and payload == PROBE for kind, flags, _, payload in frames)


def run(path: str, case: Case, timeout: float) -> Seen:
    """Play ``case`` against the server on the unix socket ``path``: its steps (bytes sent, waits
    for the server), then the probe PING; read until the probe's ACK or the connection closes.
    ``timeout`` bounds each read (a liveness bound: only a server that never answers meets it)."""
    seen = Seen([], False)
    buf = bytearray()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        if not case.own_preface:
            sock.sendall(_preface())
        # A write the server refused (it closed) ends the sending; what it wrote before is still read.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for step in case.steps:
                if isinstance(step, bytes):
                    sock.sendall(step)
                else:
                    _read(sock, seen, step, buf)
            if not seen.closed:
                sock.sendall(ping(PROBE))
        _read(sock, seen, _done(case.expect), buf)
    return seen


def _done(expect: Expect) -> Callable[[list[Frame]], bool]:
    """When the last read may stop: at the close for a connection that must end, else once the
    probe and what the case waits for (the response, its DATA frames) are in."""
    if expect.goaway is not None or expect.closed:
        return lambda seen: False

    def done(seen: list[Frame]) -> bool:
        stream = [(kind, payload) for kind, _, sid, payload in seen if sid == expect.stream]
        return (
            _probe_answered(seen)
            and (not expect.answered or any(kind == f.HEADERS for kind, _ in stream))
            and (
                not expect.refused_or_answered or any(kind in (f.HEADERS, f.RST_STREAM) for kind, _ in stream)
            )
            and sum(1 for kind, _ in stream if kind == f.DATA) >= len(expect.data_lengths)
        )

    return done


def check(case: Case, seen: Seen) -> None:
    """Assert that ``seen`` is what ``case.expect`` asks (see :class:`Expect`); a failure says what came."""
    try:
        _check(case, seen)
    except AssertionError as failure:
        raise AssertionError(f"{failure}; {seen}") from None


def _check(case: Case, seen: Seen) -> None:
    expect, frames = case.expect, seen.frames
    goaways = [f.parse_goaway(p)[1] for kind, _, _, p in frames if kind == f.GOAWAY]
    resets = [(sid, f.parse_u32(p)) for kind, _, sid, p in frames if kind == f.RST_STREAM]
    if expect.goaway is not None:
        assert goaways[:1] == [expect.goaway], f"GOAWAY codes {goaways}, resets {resets}"
        assert seen.closed, "the connection stayed open after the GOAWAY"
    elif expect.closed:
        assert seen.closed and set(goaways) <= {f.NO_ERROR}, f"GOAWAY codes {goaways}, closed {seen.closed}"
    else:
        assert ([], False) == (goaways, seen.closed), f"GOAWAY codes {goaways}, closed {seen.closed}"
        assert _probe_answered(frames), "the probe PING was not answered"
    if expect.reset is not None:
        assert (expect.stream, expect.reset) in resets, f"resets {resets}"
    elif not expect.refused_or_answered:
        assert [] == [r for r in resets if r[1] != f.NO_ERROR], f"resets {resets}"
    if expect.refused_or_answered:
        assert any(k in (f.HEADERS, f.RST_STREAM) and sid == expect.stream for k, _, sid, _ in frames), (
            "no answer"
        )
    if expect.answered:
        assert any(kind == f.HEADERS and sid == expect.stream for kind, _, sid, _ in frames), "no response"
    if expect.data_lengths:
        sizes = [len(p) for kind, _, sid, p in frames if kind == f.DATA and sid == expect.stream]
        assert list(expect.data_lengths) == sizes[: len(expect.data_lengths)], (
            f"DATA frames of {sizes} octets"
        )
    if expect.settings_first:
        assert frames and frames[0][:2] == (f.SETTINGS, 0), f"first frames {frames[:2]}"
    if expect.ping_acked is not None:
        assert any(k == f.PING and fl & f.ACK and p == expect.ping_acked for k, fl, _, p in frames)
        assert not any(k == f.PING and p == PING_NOT_ANSWERED for k, _, _, p in frames), (
            "a PING ACK was answered"
        )
