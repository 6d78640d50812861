"""gRPC status codes, the error that carries one, and method cardinalities.

Everything of krproxy that speaks gRPC — the relay, the plugin SDK's server (:mod:`krproxy.rpc`),
``trace serve|replay``, the fakes — reads and answers statuses with these. They live here, in a
module that imports nothing but the standard library, so that the pure core (the trace format,
call records) can hold them too.

The numbers are gRPC's (``doc/statuscodes.md`` in grpc/grpc); the names are those of grpcio's
``StatusCode`` and grpclib's ``Status``, so a value converts either way by number (``Status(n)``).
"""

from __future__ import annotations

import enum

__all__ = ["Cardinality", "GRPCError", "Status"]


@enum.unique
class Status(enum.IntEnum):
    """A gRPC status code: what ``grpc-status`` carries in a response's trailers."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class GRPCError(Exception):
    """A call ended with an error ``status`` (never OK), a ``message`` and rich ``details``.

    Raised by the relay's own calls for the status a peer answered, and by interceptors to
    refuse a call: the relay answers the caller with these three fields.
    """

    def __init__(self, status: Status, message: str | None = None, details: bytes | None = None) -> None:
        super().__init__(status, message, details)
        self.status = status
        self.message = message
        self.details = details


@enum.unique
class Cardinality(enum.Enum):
    """How many messages each side of a method sends: one (UNARY) or a stream."""

    UNARY_UNARY = (False, False)
    UNARY_STREAM = (False, True)
    STREAM_UNARY = (True, False)
    STREAM_STREAM = (True, True)

    @property
    def client_streaming(self) -> bool:
        return self.value[0]

    @property
    def server_streaming(self) -> bool:
        return self.value[1]


#: Go's short escapes (``strconv.Quote``), for :func:`go_quote`.
_GO_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\a": "\\a",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\v": "\\v",
}


def go_quote(text: str | bytes) -> str:
    """*text* quoted as Go's ``strconv.Quote`` (``%q``) writes it: double quotes; backslash
    escapes for ``"``, ``\\``, the C escapes and other control characters; a byte that is not
    UTF-8 as ``\\xNN``; printable characters as they are."""
    raw = text if isinstance(text, bytes) else text.encode("utf-8", "surrogateescape")
    out = ['"']
    decoded = raw.decode("utf-8", "surrogateescape")
    for char in decoded:
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8
            out.append(f"\\x{code - 0xDC00:02x}")
        elif char in _GO_ESCAPES:
            out.append(_GO_ESCAPES[char])
        elif char == " " or (char.isprintable() and code != 0x7F):
            out.append(char)
        elif code < 0x80:
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)
