"""grpc-go's strictness (:mod:`fakes.strict`) for the fake containerd's grpclib server.

grpclib takes it through its own extension points: the connection's
:class:`~grpclib.protocol.AbstractHandler`, which gets each new stream with its headers before
grpclib reads them, and the h2 settings the connection starts with.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable
from typing import Any, cast

import grpclib.protocol
import grpclib.server
import h2.connection
from h2.errors import ErrorCodes
from h2.settings import SettingCodes

from fakes.strict import GrpcGo, Headers, Rejection, check_request
from krproxy import _grpc  # noqa: F401 - the adapter, imported wherever grpclib is (it sets grpclib up)

LOGGER = logging.getLogger("fakes.containerd")


class _StrictHandler(grpclib.protocol.AbstractHandler):
    """grpclib's per-connection handler, with grpc-go's header checks in front.

    grpclib calls :meth:`accept` with every new stream and its header block before it looks at
    them; a request grpc-go refuses never reaches grpclib (which would otherwise accept a long
    ``grpc-timeout`` or stay silent without ``:method``).
    """

    def __init__(
        self,
        inner: grpclib.protocol.AbstractHandler,
        grpc_go: GrpcGo,
        accepted: Callable[[Headers], None],
        rejected: Callable[[Headers, Rejection], None],
        deadlines: bool,
    ) -> None:
        self._inner = inner
        self._grpc_go = grpc_go
        self._deadlines = deadlines
        self._accepted = accepted
        self._rejected = rejected
        self._aborts: set[asyncio.Task[None]] = set()

    def accept(
        self,
        stream: grpclib.protocol.Stream,
        headers: list[tuple[str, str]],
        release_stream: Callable[[], None],
    ) -> None:
        rejection = check_request(headers)
        if rejection is None:
            self._accepted(headers)
            if not self._deadlines:  # checked and logged, not enforced: grpclib never sees it
                headers = [field for field in headers if field[0] != "grpc-timeout"]
            self._inner.accept(stream, headers, release_stream)
            return
        self._rejected(headers, rejection)
        if rejection.resets(self._grpc_go):
            # Closed already when the caller's RST_STREAM came in the same read as its HEADERS
            # (h2 handles both before grpclib hands the stream here): nothing left to reset.
            if stream.closable:
                stream.reset_nowait(ErrorCodes.PROTOCOL_ERROR)
            release_stream()
            return
        task = asyncio.get_event_loop().create_task(self._abort_early(stream, rejection, release_stream))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    @staticmethod
    async def _abort_early(
        stream: grpclib.protocol.Stream, rejection: Rejection, release_stream: Callable[[], None]
    ) -> None:
        """grpc-go's ``earlyAbortStream``: a trailers-only answer, then a reset if the request goes on."""
        try:
            await stream.send_headers(rejection.early_abort_headers(), end_stream=True)
            if stream.closable:
                stream.reset_nowait(ErrorCodes.NO_ERROR)
        except Exception:  # the connection went away meanwhile: nothing left to answer
            LOGGER.debug("early abort not sent", exc_info=True)
        finally:
            release_stream()

    def cancel(self, stream: grpclib.protocol.Stream) -> None:
        self._inner.cancel(stream)

    def close(self) -> None:
        for task in self._aborts:
            task.cancel()
        self._inner.close()


class _StrictProtocol(grpclib.protocol.H2Protocol):
    """grpclib's connection, opened with the settings a grpc-go server sends.

    h2 starts every connection advertising ``SETTINGS_MAX_CONCURRENT_STREAMS`` = 100; grpc-go
    (containerd) advertises none unless configured to. grpclib builds the h2 connection and sends
    its preface within ``connection_made``, with no say over the settings, so this one does the
    same steps (grpclib's public ``Connection`` and ``EventsProcessor``) with the settings first
    set as wanted. Flow-control windows stay grpclib's (its ``Configuration``).
    """

    def __init__(
        self,
        handler: grpclib.protocol.AbstractHandler,
        config: Any,
        h2_config: Any,
        max_concurrent_streams: int | None,
    ) -> None:
        super().__init__(handler, config, h2_config)
        self._max_concurrent_streams = max_concurrent_streams

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        h2_conn = h2.connection.H2Connection(config=self.h2_config)
        settings = h2_conn.local_settings
        if self._max_concurrent_streams is None:
            del settings[SettingCodes.MAX_CONCURRENT_STREAMS]
        else:
            settings.max_concurrent_streams = self._max_concurrent_streams
            settings.acknowledge()  # the value the preface announces, not a change to it
        window = self.config.http2_stream_window_size
        if window != settings.initial_window_size:
            settings.initial_window_size = window
            settings.acknowledge()
        h2_conn.initiate_connection()
        extra = self.config.http2_connection_window_size - h2_conn.inbound_flow_control_window
        if extra > 0:
            h2_conn.increment_flow_control_window(extra)
        self.connection = grpclib.protocol.Connection(
            h2_conn, cast(asyncio.Transport, transport), config=self.config
        )
        self.connection.flush()
        self.connection.initialize()
        self.processor = grpclib.protocol.EventsProcessor(self.handler, self.connection)


def serve_strictly(
    server: grpclib.server.Server,
    grpc_go: GrpcGo = GrpcGo.V1_6,
    *,
    max_concurrent_streams: int | None = None,
    deadlines: bool = True,
    accepted: Callable[[Headers], None] = lambda headers: None,
    rejected: Callable[[Headers, Rejection], None] = lambda headers, rejection: None,
) -> None:
    """Make ``server`` (not started yet) refuse what grpc-go refuses, and advertise what it does.

    ``accepted`` is told the header block of every request let through, ``rejected`` every
    refused one with why. ``max_concurrent_streams``: the SETTINGS_MAX_CONCURRENT_STREAMS to
    advertise (None: none, as containerd). ``deadlines``: False to check ``grpc-timeout`` but not
    enforce it (grpclib enforces it in real time, by ``time.monotonic``, which a test's stopped
    trio clock cannot stop).
    """
    make_protocol = server._protocol_factory

    def factory() -> grpclib.protocol.H2Protocol:
        plain = make_protocol()  # grpclib's own, with its handler registered on the server
        handler = _StrictHandler(plain.handler, grpc_go, accepted, rejected, deadlines)
        # grpclib has h2 read header fields as ASCII, and the connection died on an octet above
        # 0x7f in a value, which grpc-go takes (obs-text); as latin-1 each octet is one character.
        h2_config = copy.copy(plain.h2_config)
        h2_config.header_encoding = "latin-1"
        return _StrictProtocol(handler, plain.config, h2_config, max_concurrent_streams)

    server._protocol_factory = factory  # type: ignore[method-assign]


__all__ = ["serve_strictly"]
