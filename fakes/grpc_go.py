"""grpc-go's strictness (:mod:`krproxy.fakes.strict`) for a :class:`krproxy.rpc.Server`.

The gRPC fakes (the fake containerd, the fake plugin) are served by krproxy's own gRPC server,
which judges request headers by RFC 9113 and serves what it lets through. grpc-go judges them
its own way (:func:`krproxy.fakes.strict.check_request`); :func:`header_check` is the server's
``check_headers`` that applies those rules instead, answers a refused request as the chosen
grpc-go version does, and tells the fake about every request it accepted or refused.

:func:`metadata_items` gives a request's metadata as the tests read it (``-bin`` values decoded),
:func:`encode_metadata` the other way round.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Callable, Iterable

from krproxy import rpc
from krproxy.fakes.strict import GrpcGo, Headers, Rejection, check_request
from krproxy.forward import Headers as Fields

LOGGER = logging.getLogger("krproxy.fakes.grpc_go")

#: The HTTP/2 error code (RFC 9113 §7) of grpc-go's resets.
PROTOCOL_ERROR = 0x1

#: One metadata entry as the tests read and write it: text, or bytes for a ``-bin`` key.
Metadata = tuple[tuple[str, str | bytes], ...]

HeaderCheck = Callable[[rpc.Stream], bool]


def _ignore_accepted(headers: Headers) -> None:
    pass


def _ignore_rejected(headers: Headers, rejection: Rejection) -> None:
    pass


def header_check(
    grpc_go: GrpcGo = GrpcGo.V1_6,
    *,
    accepted: Callable[[Headers], None] = _ignore_accepted,
    rejected: Callable[[Headers, Rejection], None] = _ignore_rejected,
) -> HeaderCheck:
    """A ``check_headers`` for :class:`krproxy.rpc.Server` that refuses what grpc-go refuses.

    Each request's header block (pseudo-headers included, each octet one character, as grpc-go
    reads octets above 0x7f) is judged by :func:`krproxy.fakes.strict.check_request`. ``accepted`` is
    told every block let through, ``rejected`` every refused one with why. A refused request is
    answered as ``grpc_go`` does: RST_STREAM PROTOCOL_ERROR (1.6, and every version for what its
    framer refuses), or grpc-go 2's early abort: a trailers-only answer with the HTTP status,
    INTERNAL and the reason, then RST_STREAM NO_ERROR if the request was not over.

    A plain function: the server runs it as the HEADERS frame arrives, before any DATA.
    """

    def check(stream: rpc.Stream) -> bool:
        headers = tuple((name.decode("latin-1"), value.decode("latin-1")) for name, value in stream.headers)
        rejection = check_request(headers)
        if rejection is None:
            accepted(headers)
            return True
        LOGGER.info("event=request_refused reason=%r", rejection.message)
        rejected(headers, rejection)
        if rejection.resets(grpc_go):
            stream.reset(PROTOCOL_ERROR)
            return False
        stream.refuse([(name.encode(), value.encode()) for name, value in rejection.early_abort_headers()])
        return False

    return check


#: Header fields of a request that are gRPC's own, not the caller's metadata (besides ``grpc-*``).
_NOT_METADATA = frozenset(("te", "content-type", "user-agent"))


def metadata_items(headers: Iterable[tuple[bytes, bytes]]) -> Metadata:
    """The caller's metadata in a request's header fields, as gRPC libraries hand it to
    applications: without pseudo-headers, ``grpc-*``, ``te``, ``content-type`` and ``user-agent``;
    text values as text, a ``-bin`` value base64-decoded to bytes (one that is not base64 stays
    as received, as text)."""
    items: list[tuple[str, str | bytes]] = []
    for name, value in headers:
        key = name.decode("latin-1")
        if key.startswith((":", "grpc-")) or key in _NOT_METADATA:
            continue
        if key.endswith("-bin"):
            try:
                items.append((key, base64.b64decode(value + b"=" * (-len(value) % 4), validate=True)))
                continue
            except binascii.Error:
                pass
        items.append((key, value.decode("latin-1")))
    return tuple(items)


def encode_metadata(metadata: Iterable[tuple[str, str | bytes]]) -> Fields:
    """``metadata`` as header fields: a ``-bin`` value base64-encoded (unpadded, as grpc-go sends)."""
    fields: Fields = []
    for key, value in metadata:
        if isinstance(value, bytes):
            fields.append((key.encode(), base64.b64encode(value).rstrip(b"=")))
        else:
            fields.append((key.encode(), value.encode()))
    return fields


__all__ = ["Metadata", "encode_metadata", "header_check", "metadata_items"]
