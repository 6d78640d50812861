"""What grpc-go servers (containerd, koordlet) refuse, refused by the fakes too.

The fakes are built on a lenient stack: krproxy's own gRPC server (:mod:`krproxy.rpc`) judges
request headers by RFC 9113, not as grpc-go does, and the stacks the fakes ran on before were more
lenient still (grpclib accepted a ``grpc-timeout`` of any length and never answered a request
without ``:method``; h2 advertised ``SETTINGS_MAX_CONCURRENT_STREAMS`` = 100). A proxy tested only
against such fakes can send what a real runtime resets (issue 15: krproxy's 9-digit
``grpc-timeout`` passed every test and failed every pod against containerd). This module holds
the rules, once, for the fakes that speak gRPC:

- :func:`check_request` judges a request's header block as grpc-go does: first as its HTTP/2
  framer (``golang.org/x/net/http2``'s ``readMetaFrame``: no control character but HTAB in a
  value, regular names of lowercase token characters, pseudo-headers first, known and once), then
  as its ``operateHeaders`` (``:method`` must be POST; ``grpc-timeout`` at most 8 digits and a
  unit, as its ``decodeTimeout`` demands), and says how the peer answers (:class:`Rejection`), in
  the manner of the grpc-go version chosen (:class:`GrpcGo`).
- :data:`MAX_MESSAGE` and :func:`too_large` are containerd's message limit and grpc-go's answer
  (with RESOURCE_EXHAUSTED).

The fakes apply them through their server's header check (:func:`krproxy.fakes.grpc_go.header_check`,
for :class:`krproxy.rpc.Server`), with the stream limit and message sizes set on the server
(:mod:`krproxy.fakes.containerd.server`, :mod:`krproxy.fakes.plugin.server`). This module imports no server.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

import attrs

#: containerd's limit on one gRPC message, received or sent (``defaults.DefaultMaxRecvMsgSize`` and
#: ``DefaultMaxSendMsgSize``, 16 MiB; grpc-go's own default for receiving is 4 MiB).
MAX_MESSAGE = 16 << 20
#: grpc-go's default limit on a received message (``defaultServerMaxReceiveMessageSize``, 4 MiB),
#: which a hook server such as koordlet keeps: the fake plugin's limit.
MAX_PLUGIN_REQUEST = 4 << 20

#: grpc-timeout units grpc-go's ``decodeTimeout`` accepts.
_TIMEOUT_UNITS = frozenset("HMSmun")
#: gRPC's status INTERNAL, which grpc-go's early abort carries.
_INTERNAL = 13
#: What grpc-go's framer lets a regular field name hold (``validWireHeaderFieldName``: token
#: characters, ``httpguts.IsTokenRune``, and no uppercase letter).
_NAME_CHARACTERS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz")
#: Pseudo-headers grpc-go's framer knows (``checkPseudos``); the first four make a request.
_REQUEST_PSEUDO = frozenset((":method", ":path", ":scheme", ":authority"))


class GrpcGo(enum.Enum):
    """Which grpc-go answers a request its transport refuses (the header checks of :func:`check_request`).

    - ``V1_6``: containerd 1.6's grpc-go resets the stream (RST_STREAM PROTOCOL_ERROR). Verified
      against containerd 1.6.20 for a 9-digit ``grpc-timeout`` (docs/testing.md).
    - ``V2``: the grpc-go of containerd 2.x (and 1.7) aborts the stream early: a trailers-only
      answer with HTTP status 400 (405 for a method other than POST), ``grpc-status`` INTERNAL and
      a message, then RST_STREAM NO_ERROR if the request was not over. containerd 2.1.9 answers a
      9-digit ``grpc-timeout`` with INTERNAL "malformed grpc-timeout: transport: timeout string is
      too long".
    """

    V1_6 = "1.6"
    V2 = "2"


@attrs.frozen
class Rejection:
    """How a grpc-go server refuses a request: what :data:`GrpcGo.V1_6` and :data:`GrpcGo.V2` send.

    ``http_status`` is None for a request its HTTP/2 framer refuses (a stream error, before
    ``operateHeaders`` sees it): RST_STREAM PROTOCOL_ERROR from every version."""

    http_status: int | None  # V2's early abort; None: the framer's reset
    message: str  # V2's grpc-message (INTERNAL); also the fakes' log line

    def describe(self) -> str:
        return self.message

    def resets(self, grpc_go: GrpcGo) -> bool:
        """Whether ``grpc_go`` answers with RST_STREAM PROTOCOL_ERROR alone; else with
        :meth:`early_abort_headers` (then RST_STREAM NO_ERROR if the request was not over)."""
        return self.http_status is None or grpc_go is GrpcGo.V1_6

    def early_abort_headers(self) -> list[tuple[str, str]]:
        """grpc-go's ``earlyAbortStream`` answer: a trailers-only header block with the HTTP
        status, ``grpc-status`` INTERNAL and the message."""
        if self.http_status is None:
            raise ValueError("a request refused by grpc-go's framer is reset, not answered")
        return [
            (":status", str(self.http_status)),
            ("content-type", "application/grpc"),
            ("grpc-status", str(_INTERNAL)),
            ("grpc-message", grpc_message(self.message)),
        ]


def grpc_message(text: str) -> str:
    """*text* as grpc-go writes a ``grpc-message`` (its ``encodeGrpcMessage``): every UTF-8 byte
    outside printable ASCII, and ``%``, percent-encoded."""
    return "".join(
        chr(byte) if 0x20 <= byte <= 0x7E and byte != 0x25 else f"%{byte:02X}"
        for byte in text.encode("utf-8", "surrogateescape")
    )


def timeout_error(value: str) -> str | None:
    """grpc-go's ``decodeTimeout`` error for a ``grpc-timeout`` value, None if it is valid.

    At least one digit and at most 8 (the gRPC spec: ``1*8DIGIT``), then one of H M S m u n.
    """
    if len(value) < 2:
        return f'transport: timeout string is too short: "{value}"'
    if len(value) > 9:
        return f'transport: timeout string is too long: "{value}"'
    if value[-1] not in _TIMEOUT_UNITS:
        return f'transport: timeout unit is not recognized: "{value}"'
    digits = value[:-1]
    if not (digits.isascii() and digits.isdigit()):
        return f'strconv.ParseUint: parsing "{digits}": invalid syntax'
    return None


def framer_error(headers: Iterable[tuple[str, str]]) -> str | None:
    """The error grpc-go's HTTP/2 framer (``readMetaFrame``, ``checkPseudos``) finds in a decoded
    header block, in its words, or None. RFC 9113 §8.2.1 forbids NUL, CR and LF in a value;
    grpc-go refuses every control character but HTAB (``httpguts.ValidHeaderFieldValue``), and
    lets a value start or end with whitespace (which the RFC and krproxy's relay refuse)."""
    regular = False
    pseudo: list[str] = []
    for name, value in headers:
        if any((ord(c) < 0x20 and c != "\t") or c == "\x7f" for c in value):
            return f"invalid header field value for {name!r}"
        if name.startswith(":"):
            if regular:
                return "pseudo header field after regular"
            pseudo.append(name)
        else:
            regular = True
            if not name or not _NAME_CHARACTERS.issuperset(name):
                return f"invalid header field name {name!r}"
    for i, name in enumerate(pseudo):
        if name not in _REQUEST_PSEUDO and name != ":status":
            return f"invalid pseudo-header {name!r}"
        if name in pseudo[:i]:
            return f"duplicate pseudo-header {name!r}"
    if ":status" in pseudo and not _REQUEST_PSEUDO.isdisjoint(pseudo):
        return "mix of request and response pseudo headers"
    return None


def check_request(headers: Iterable[tuple[str, str]]) -> Rejection | None:
    """None if grpc-go would accept this request header block, else how it refuses it.

    Checked in grpc-go's order: the framer's rules (:func:`framer_error`) first, then
    ``grpc-timeout``, then ``:method``. A request without ``:method`` (or with another method
    than POST) is malformed HTTP/2 (RFC 9113 §8.3.1).
    """
    headers = list(headers)
    error = framer_error(headers)
    if error is not None:
        return Rejection(None, error)
    method = None
    for name, value in headers:
        if name == "grpc-timeout":
            error = timeout_error(value)
            if error is not None:
                return Rejection(400, f"malformed grpc-timeout: {error}")
        elif name == ":method":
            method = value
    if method != "POST":
        shown = method or ""
        return Rejection(405, f'Received a HEADERS frame with :method "{shown}" which should be POST')
    return None


def too_large(size: int, *, sending: bool) -> str:
    """grpc-go's message for a message over :data:`MAX_MESSAGE`, sent with RESOURCE_EXHAUSTED."""
    verb = "trying to send message" if sending else "received message"
    return f"grpc: {verb} larger than max ({size} vs. {MAX_MESSAGE})"


Headers = Sequence[tuple[str, str]]


__all__ = [
    "MAX_MESSAGE",
    "MAX_PLUGIN_REQUEST",
    "GrpcGo",
    "Headers",
    "Rejection",
    "check_request",
    "framer_error",
    "timeout_error",
    "too_large",
]
