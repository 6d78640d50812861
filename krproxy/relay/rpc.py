"""gRPC calls in the transport, the names used outside it gathered.

- :class:`Call` (:mod:`krproxy.relay.call`): a caller's stream paired with a stream to the
  runtime; frames are passed on, the status is read from the trailers for the call record.
- :class:`LocalCall` (:mod:`krproxy.relay.intercepted`): a call with hook points; the relay collects
  the request and runs the interceptor, whose ``forward`` is a call of the transport's own.
- :class:`~krproxy.relay.served.Served`: a call a handler of :class:`krproxy.rpc.Server` answers.
- :class:`~krproxy.relay.state.CallState`: what each of those three holds, the halves, status and
  end of a caller's call.
- :mod:`krproxy.relay.exchange`: streams the transport opens itself, a unary call
  (``Exchange``, read back as an :class:`Answer`) or a server stream (``Reading``).
- :mod:`krproxy.relay.grpc`: gRPC without the streams (timeouts, status, framing, errors).

"""

from __future__ import annotations

from krproxy.relay.call import Call
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
from krproxy.relay.intercepted import LocalCall

__all__ = [
    "KEEP_ALL",
    "KEEP_FIRST",
    "KEEP_NONE",
    "AnswerTooLarge",
    "Call",
    "CloseConnection",
    "LocalCall",
    "MessageTooLarge",
    "Tap",
    "UpstreamError",
    "encode_grpc_timeout",
    "grpc_message",
    "grpc_timeout",
    "request_headers",
]
