"""krproxy's gRPC server and client on trio, built on the relay's HTTP/2 machinery.

:mod:`krproxy.rpc.server` serves handlers by method path (unary, server streaming, or any
cardinality through :class:`Stream`; unary without a task of its own, :class:`UnaryJob`; from
``_stream``; ``_call`` is the server side of one call); :mod:`krproxy.rpc.client` calls a unix
socket (:class:`Channel`: unary and server-streaming calls). Both carry message bytes: codecs are
the caller's business. The connections, streams, windows and GOAWAY are :mod:`krproxy.relay`'s.
"""

from krproxy.rpc.client import Channel as Channel
from krproxy.rpc.server import Handler as Handler
from krproxy.rpc.server import Server as Server
from krproxy.rpc.server import Stream as Stream
from krproxy.rpc.server import UnaryJob as UnaryJob
from krproxy.rpc.server import unary as unary
from krproxy.rpc.server import unary_stream as unary_stream

__all__ = ["Channel", "Handler", "Server", "Stream", "UnaryJob", "unary", "unary_stream"]
