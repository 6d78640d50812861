"""The fake plugin's gRPC server: unary calls over HTTP/2 on a unix socket, no gRPC library.

The benchmark's plugins answer in the measured path, so their own CPU counts in the proxy's
latency figures; a real plugin (koordlet, in Go) costs far less per call than a grpclib server
inside trio-asyncio did (about 0.8 ms). This server is built on the proxy's own HTTP/2 core
(:class:`krproxy.hooks.h2.H2Peer`): a request is parsed in ``data_received`` and, unless the
handler has to wait, answered there too, in one write.

Every call goes to a handler with an :class:`Exchange`, which answers, fails with a gRPC status,
drops the connection, or runs a coroutine for answers that need to wait. Paths the handler
does not know are its business too (the fake answers UNIMPLEMENTED). The server does not
enforce the caller's ``grpc-timeout``: a hanging fake hangs until the caller gives up.

Resource handling: :meth:`HookServer.close` stops listening, cancels running handler
coroutines, closes every connection and removes the socket file if it is still ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any

from grpclib.const import Status
from grpclib.metadata import encode_grpc_message

from krproxy._grpc import bind_unix_socket, unlink_if_ours
from krproxy.hooks import h2

LOGGER = logging.getLogger("fakes.plugin")

_RESPONSE_HEADERS = h2.header_block((b":status", b"200"), (b"content-type", b"application/grpc+proto"))
_OK_TRAILERS = h2.header_block((b"grpc-status", b"0"))


class _Request(h2.Stream):
    __slots__ = ("data", "path", "task")

    def __init__(self, stream_id: int, send_window: int, path: str) -> None:
        super().__init__(stream_id, send_window)
        self.path = path
        self.data = bytearray()
        self.task: asyncio.Task[None] | None = None


class Exchange:
    """One call: its method path and request message, and the ways to end it."""

    __slots__ = ("_connection", "_stream", "message", "path")

    def __init__(self, connection: _Connection, stream: _Request, message: bytes) -> None:
        self._connection = connection
        self._stream = stream
        self.path = stream.path
        self.message = message

    @property
    def open(self) -> bool:
        """Whether the call can still be answered (the caller neither reset it nor disconnected)."""
        return self._connection.streams.get(self._stream.id) is self._stream and not self._stream.local_closed

    def answer(self, message: bytes) -> None:
        """Answer ``message`` (serialized) with status OK."""
        if self.open:
            sid = self._stream.id
            head = h2.frame(h2.HEADERS, h2.END_HEADERS, sid, _RESPONSE_HEADERS)
            tail = h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, sid, _OK_TRAILERS)
            self._connection.send(self._stream, head, h2.grpc_message(message), tail)

    def fail(self, status: Status, message: str | None = None) -> None:
        """End the call with a gRPC error status (a trailers-only answer)."""
        if self.open:
            fields = [(b"grpc-status", str(status.value).encode())]
            if message:
                fields.append((b"grpc-message", encode_grpc_message(message).encode()))
            block = _RESPONSE_HEADERS + h2.header_block(*fields)
            connection = self._connection
            head = h2.header_frames(self._stream.id, block, True, connection.peer_max_frame)
            self._stream.local_closed = True
            connection.write(head)
            connection.on_sent(self._stream)

    def reset(self, code: int) -> None:
        """Reset the stream with an HTTP/2 error code (``h2.REFUSED_STREAM``: "not processed, send it again")."""
        if self.open:
            self._connection.reset(self._stream, code)

    def drop(self) -> None:
        """Abort the whole connection at once, as a crashing plugin's would end."""
        if self._connection.transport is not None:
            self._connection.transport.abort()

    def run(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Finish the call in ``coroutine`` (a task, cancelled if the caller resets or disconnects)."""
        task = self._connection.loop.create_task(coroutine)
        self._stream.task = task
        self._connection.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._connection.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            LOGGER.error("event=handler_failed path=%s", self.path, exc_info=task.exception())
            self.fail(Status.INTERNAL, "Internal Server Error")


Handler = Callable[[Exchange], None]


class _Connection(h2.H2Peer):
    """The server end of one connection."""

    client = False

    def __init__(self, handler: Handler, connections: set[_Connection]) -> None:
        super().__init__()
        # Taken here, in the accepting task: trio-asyncio's get_running_loop() fails in callbacks.
        self.loop = asyncio.get_running_loop()
        self._handler = handler
        self._connections = connections
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._connections.add(self)
        super().connection_made(transport)

    def on_headers(self, stream_id: int, headers: list[tuple[bytes, bytes]], end_stream: bool) -> None:
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers from the client: they must end its side
            if not end_stream:
                raise h2.H2Error(h2.PROTOCOL_ERROR, "trailers that do not end the stream")
            stream.remote_closed = True
            assert isinstance(stream, _Request)
            self._complete(stream)
            return
        if stream_id % 2 == 0 or stream_id <= self.last_stream:
            raise h2.H2Error(h2.PROTOCOL_ERROR, f"HEADERS opening stream {stream_id}")
        self.last_stream = stream_id
        path = next((value for name, value in headers if name == b":path"), b"")
        request = _Request(stream_id, self.peer_initial_window, path.decode("utf-8", "replace"))
        self.streams[stream_id] = request
        if end_stream:
            request.remote_closed = True
            self._complete(request)

    def on_data(self, stream: h2.Stream, data: bytes, end_stream: bool) -> None:
        assert isinstance(stream, _Request)
        stream.data += data
        if len(stream.data) > h2.MAX_MESSAGE + 5:
            Exchange(self, stream, b"").fail(Status.RESOURCE_EXHAUSTED, "request too large")
            self.reset(stream)
        elif end_stream:
            self._complete(stream)

    def _complete(self, stream: _Request) -> None:
        try:
            message = h2.unframe(stream.data, "request")
        except h2.PluginProtocolError as err:
            Exchange(self, stream, b"").fail(Status.INTERNAL, str(err))
            return
        stream.data = bytearray()
        exchange = Exchange(self, stream, message)
        try:
            self._handler(exchange)
        except Exception as err:
            LOGGER.exception("event=handler_failed path=%s", stream.path)
            exchange.fail(Status.INTERNAL, f"Internal Server Error: {type(err).__name__}")

    def on_sent(self, stream: h2.Stream) -> None:
        if stream.remote_closed:
            self.forget(stream)

    def on_forget(self, stream: h2.Stream) -> None:
        assert isinstance(stream, _Request)
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()

    def on_goaway(self, last_stream: int, code: int, debug: bytes) -> None:
        if not self.streams and self.transport is not None:
            self.transport.close()

    def on_closed(self, error: Exception) -> None:
        for stream in list(self.streams.values()):
            self.forget(stream)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._connections.discard(self)
        for task in list(self.tasks):
            task.cancel()


class HookServer:
    """A listening server; see :func:`start_server`."""

    def __init__(self, server: asyncio.AbstractServer, path: str, connections: set[_Connection]) -> None:
        self._server = server
        self._path = path
        self._inode = os.stat(path).st_ino
        self._connections = connections

    async def close(self) -> None:
        """Stop listening, end every connection and running call, remove the socket file."""
        self._server.close()
        for connection in list(self._connections):
            for task in list(connection.tasks):
                task.cancel()
            if connection.transport is not None:
                connection.transport.close()
        with contextlib.suppress(Exception):
            await self._server.wait_closed()
        unlink_if_ours(self._path, self._inode)


async def start_server(path: str, handler: Handler) -> HookServer:
    """Listen on the unix socket ``path`` (a stale socket file is replaced, a live one refused)
    and serve every call to ``handler``. Returns once connections are accepted."""
    sock = bind_unix_socket(path)
    connections: set[_Connection] = set()
    try:
        server = await asyncio.get_running_loop().create_unix_server(
            lambda: _Connection(handler, connections), sock=sock
        )
    except BaseException:
        sock.close()
        raise
    return HookServer(server, path, connections)
