"""gRPC calls in the relay: relayed ones, ones the relay answers itself, ones it makes.

- :class:`Call` (:mod:`krproxy.relay._call`): a caller's stream paired with a stream to the
  runtime; frames are passed on, the status is read from the trailers for the call record.
- :class:`LocalCall` (:mod:`krproxy.relay._local`): a call with hook points; the relay collects
  the request and runs the interceptor, whose ``forward`` is a call of the relay's own.
- :class:`_Exchange` (:mod:`krproxy.relay._local`): the relay's side of a unary call it makes (to
  the runtime for an intercepted call, to a plugin, for store recovery), read back as an
  :class:`Answer`.
- :mod:`krproxy.relay._grpc`: gRPC without the streams (timeouts, status, framing, errors).

This module gathers their names for the rest of krproxy.
"""

from __future__ import annotations

from krproxy.relay._call import Call, Relay
from krproxy.relay._grpc import (
    _PLAIN_HEADERS,
    _RESET_STATUS,
    KEEP_ALL,
    KEEP_FIRST,
    KEEP_NONE,
    MAX_OWN_ANSWER,
    Answer,
    AnswerTooLarge,
    BadAnswer,
    CloseConnection,
    MessageTooLarge,
    StreamReset,
    UpstreamError,
    _forget_traceback,
    _read_status,
    _status_fields,
    _Tap,
    decompress_message,
    encode_grpc_timeout,
    grpc_message,
    grpc_timeout,
    request_headers,
)
from krproxy.relay._local import HandledCall, LocalCall, OwnStream, _Exchange

__all__ = [
    "KEEP_ALL",
    "KEEP_FIRST",
    "KEEP_NONE",
    "MAX_OWN_ANSWER",
    "_PLAIN_HEADERS",
    "_RESET_STATUS",
    "Answer",
    "AnswerTooLarge",
    "BadAnswer",
    "Call",
    "CloseConnection",
    "HandledCall",
    "LocalCall",
    "MessageTooLarge",
    "OwnStream",
    "Relay",
    "StreamReset",
    "UpstreamError",
    "_Exchange",
    "_Tap",
    "_forget_traceback",
    "_read_status",
    "_status_fields",
    "decompress_message",
    "encode_grpc_timeout",
    "grpc_message",
    "grpc_timeout",
    "request_headers",
]
