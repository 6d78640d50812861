"""The machinery of h2spec's cases as frames of our own (h2_cases.py has the cases): the frames a
caller sends, what a case expects (:class:`Expect`), :func:`run` to play a case against a server's
unix socket and :func:`check` to judge what came back.
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


def conn_error(code: int) -> Expect:
    return Expect(goaway=code)


def stream_error(code: int, stream: int = 1) -> Expect:
    return Expect(reset=code, stream=stream)


ANSWERED = Expect(answered=True)
RESPONDED = Expect(refused_or_answered=True)
ALIVE = Expect()
PING_NOT_ANSWERED = b"invalid\x00"
#: A header block h2spec appends a representation to (RFC 7541 §6): the request, then ``rep``.
WITH = REQUEST_BLOCK

PROTOCOL, FRAME_SIZE, FLOW, COMPRESSION, CLOSED_STREAM = (
    f.PROTOCOL_ERROR,
    f.FRAME_SIZE_ERROR,
    f.FLOW_CONTROL_ERROR,
    f.COMPRESSION_ERROR,
    f.STREAM_CLOSED,
)


def case(title: str, *steps: Step, expect: Expect, note: str = "", **kw: bool) -> Case:
    return Case(title, steps, expect, note=note, **kw)


def hpack_case(title: str, rep: bytes, *, before: bool = False, expect: Expect = ANSWERED) -> Case:
    fragment = rep + WITH if before else WITH + rep
    return case(title, headers(1, fragment) + data(1, MESSAGE, end=True), expect=expect)


def trailers(*fields: tuple[str, str], end: bool = False) -> bytes:
    return headers(1, block(*fields), end=end)


def request(*fields: tuple[str, str], end: bool = True) -> bytes:
    return headers(1, block(*fields), end=end)


def without(name: str) -> tuple[tuple[str, str], ...]:
    return tuple(field for field in REQUEST if field[0] != name)


def pseudo_first(*extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
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
