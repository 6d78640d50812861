"""gRPC calls in the relay: relayed ones, ones the relay answers itself, ones it makes.

- :class:`Call` (:mod:`krproxy.relay._call`): a caller's stream paired with a stream to the
  runtime; frames are passed on, the status is read from the trailers for the call record.
- :class:`LocalCall` (:mod:`krproxy.relay._local`): a call with hook points; the relay collects
  the request and runs the interceptor, whose ``forward`` is a call of the relay's own.
- :class:`_Exchange` (:mod:`krproxy.relay._exchange`): the relay's side of a unary call it makes (to
  the runtime for an intercepted call, to a plugin, for store recovery), read back as an
  :class:`Answer`.
- :mod:`krproxy.relay.grpc`: gRPC without the streams (timeouts, status, framing, errors).

This module gathers the names used outside the relay.
"""

from __future__ import annotations

from krproxy.relay._call import Call, Relay
from krproxy.relay._local import LocalCall
from krproxy.relay.grpc import (
    KEEP_ALL,
    KEEP_FIRST,
    KEEP_NONE,
    AnswerTooLarge,
    CloseConnection,
    MessageTooLarge,
    Tap,
    UpstreamError,
    encode_grpc_timeout,
    grpc_message,
    grpc_timeout,
    request_headers,
)

__all__ = [
    "KEEP_ALL",
    "KEEP_FIRST",
    "KEEP_NONE",
    "AnswerTooLarge",
    "Call",
    "CloseConnection",
    "LocalCall",
    "MessageTooLarge",
    "Relay",
    "Tap",
    "UpstreamError",
    "encode_grpc_timeout",
    "grpc_message",
    "grpc_timeout",
    "request_headers",
]
