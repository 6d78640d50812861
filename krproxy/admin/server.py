"""The admin HTTP endpoint (``--metrics-address``): HTTP/1 with h11, and the trio server.

Endpoints, all ``GET`` (or ``HEAD``):

=============  ==========================================================================
``/metrics``   Prometheus text (OpenMetrics when the scraper asks for it)
``/healthz``   200 while the process runs its event loop
``/readyz``    200 once the proxy socket accepts calls and the store is recovered from the
               runtime; 503 with the reasons otherwise (also while shutting down)
``/status``    JSON: version, sockets, backend state, plugins, store, in-flight calls, uptime
=============  ==========================================================================

The server is a trio task in the daemon's root nursery (no thread, unlike prometheus-client's
``start_http_server``). HTTP/1 is h11's (sans-I/O, as in Docker mode): one request per
connection, answered with ``Connection: close``, which is all a scraper, a probe or ``curl``
needs. Bodies are never read.

Resource handling: each connection gets :data:`REQUEST_TIMEOUT` seconds for everything; at most
:data:`MAX_CONNECTIONS` are served at once, and more are closed unanswered.

Error handling: nothing a client sends or does can raise out of a connection's task; a
malformed request gets a 4xx answer, a broken connection is dropped, and an unexpected error
is logged and answered 500.

Security: no authentication and no TLS. The endpoint reveals plugin names and sockets, pod
and container counts and the runtime's state, so it listens on loopback unless
``--metrics-allow-remote`` says otherwise (see docs/security.md).

What the endpoint reports is :mod:`krproxy.admin.status`'s; ``krproxy status`` is
:mod:`krproxy.admin.client`.
"""

from __future__ import annotations

import errno
import http
import json
import logging
import socket
from typing import Any, NoReturn

import attrs
import h11
import trio
from prometheus_client.exposition import choose_encoder

from krproxy import log
from krproxy.admin.status import View
from krproxy.config import parse_address

LOGGER = logging.getLogger("krproxy.admin")

#: Largest request head (request line + headers) accepted; a scraper's is a few hundred bytes.
MAX_HEAD = 8192
#: Seconds a connection may take from accept to the last byte of the answer; stops slow clients
#: from holding connections open.
REQUEST_TIMEOUT = 10.0
#: Connections served at once; a scraper and a probe or two are the normal load.
MAX_CONNECTIONS = 32
#: Backlog of the listening socket.
BACKLOG = 64

# --- HTTP, sans I/O (h11) -----------------------------------------------------------------------


class BadRequest(Exception):
    """The client sent something that is not an acceptable HTTP/1.x request head."""

    def __init__(self, status: http.HTTPStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status


@attrs.frozen
class Request:
    """A parsed request head.

    Attributes:
        method: e.g. ``GET``.
        target: the request target as sent, query included.
        version: ``HTTP/1.0`` or ``HTTP/1.1``.
        headers: ``(lower-case name, value)`` pairs in order.
    """

    method: str
    target: str
    version: str = "HTTP/1.1"
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def path(self) -> str:
        return self.target.partition("?")[0]

    def header(self, name: str) -> str | None:
        """The first value of header *name* (case-insensitive), or None."""
        name = name.lower()
        return next((value for key, value in self.headers if key == name), None)


@attrs.define(eq=False)
class Connection:
    """The server side of one admin connection: h11's state machine, plus the two limits h11 does
    not keep itself (a complete head may still be over :data:`MAX_HEAD`; HTTP/2.0 is not 1.x)."""

    machine: h11.Connection = attrs.field(
        factory=lambda: h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    )
    received: int = 0


def connection() -> Connection:
    """A fresh server connection (see :class:`Connection`)."""
    return Connection()


def receive(conn: Connection, data: bytes) -> Request | None:
    """Feed *data* to *conn*; the request once its head is complete, else None (more is needed).

    Whatever follows the head is never read: one request per connection.

    Raises:
        BadRequest: refused with the status to answer: what h11 says (400 for a malformed head
            or a missing Host, 431 for an incomplete head over :data:`MAX_HEAD` bytes), 431 for
            a complete one over it, 505 for a version other than HTTP/1.0 and 1.1, 400 for a
            target that is not a path.
    """
    conn.received += len(data)
    conn.machine.receive_data(data)
    try:
        event = conn.machine.next_event()
    except h11.RemoteProtocolError as err:
        raise BadRequest(http.HTTPStatus(err.error_status_hint), str(err)) from None
    if not isinstance(event, h11.Request):
        return None  # NEED_DATA (or the client closed: nothing to answer)
    if conn.received - len(conn.machine.trailing_data[0]) > MAX_HEAD:
        raise BadRequest(
            http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"request head over {MAX_HEAD} bytes"
        )
    if event.http_version not in (b"1.0", b"1.1"):
        raise BadRequest(http.HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, "only HTTP/1.0 and HTTP/1.1")
    if not event.target.startswith(b"/"):
        raise BadRequest(http.HTTPStatus.BAD_REQUEST, "the request target must be a path (origin-form)")
    return Request(
        event.method.decode("ascii"),
        event.target.decode("ascii"),
        f"HTTP/{event.http_version.decode('ascii')}",
        tuple((name.decode("ascii"), value.decode("latin-1")) for name, value in event.headers),
    )


def parse_head(data: bytes) -> Request | None:
    """:func:`receive` on a fresh connection: the request at the start of *data*, or None."""
    return receive(connection(), data)


@attrs.frozen
class Response:
    """An answer to send: status, body, content type and extra headers."""

    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()

    def send(self, conn: Connection, *, head_only: bool = False) -> bytes:
        """The bytes of this response on *conn*; ``head_only`` (for HEAD) omits the body but keeps
        its length. Every answer closes the connection."""
        headers = [
            ("Content-Type", self.content_type),
            ("Content-Length", str(len(self.body))),
            ("Connection", "close"),
            ("Cache-Control", "no-store"),
            *self.headers,
        ]
        reason = http.HTTPStatus(self.status).phrase.encode()
        data = conn.machine.send(h11.Response(status_code=self.status, headers=headers, reason=reason)) or b""
        if self.body and not head_only:
            data += conn.machine.send(h11.Data(data=self.body)) or b""
        return data + (conn.machine.send(h11.EndOfMessage()) or b"")


def _text(status: int, text: str, **kwargs: Any) -> Response:
    return Response(status, text.encode() + b"\n", **kwargs)


def respond(request: Request, view: View) -> Response:
    """The answer to one request (pure but for reading the live :class:`View`)."""
    if request.method not in ("GET", "HEAD"):
        return _text(405, "only GET and HEAD", headers=(("Allow", "GET, HEAD"),))
    path = request.path
    if path == "/metrics":
        encoder, content_type = choose_encoder(request.header("accept") or "")
        return Response(200, encoder(view.metrics.registry), content_type)
    if path == "/healthz":
        return _text(200, "ok")
    if path == "/readyz":
        ready, reasons = view.readiness()
        return _text(200, "ready") if ready else _text(503, "not ready: " + "; ".join(reasons))
    if path == "/status":
        body = json.dumps(view.status(), indent=2, sort_keys=True).encode() + b"\n"
        return Response(200, body, "application/json")
    return _text(404, "not found; try /metrics, /healthz, /readyz or /status")


# --- the server (I/O) ---------------------------------------------------------------------------


def bind(address: str) -> socket.socket:
    """A listening TCP socket on ``HOST:PORT`` (``localhost`` means 127.0.0.1, empty: 0.0.0.0).

    Bound outside trio, like the proxy socket, so that "address in use" is a plain error.

    Raises:
        AddressUnavailable: the address cannot be listened on (in use, not this machine's...).
    Policy (loopback only unless allowed) is :class:`~krproxy.config.ProxyConfig`'s to enforce.
    """
    host, port = parse_address(address)
    host = {"localhost": "127.0.0.1", "": "0.0.0.0"}.get(host, host)
    family, kind, proto, _, sockaddr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(sockaddr)
        sock.listen(BACKLOG)
    except OSError as err:
        sock.close()
        raise AddressUnavailable(err.errno, err.strerror, address) from None
    except BaseException:
        sock.close()
        raise
    return sock


class AddressUnavailable(OSError):
    """The admin endpoint could not listen on its address (``filename``)."""

    def hint(self) -> str:
        """What to do about it, for the start-up error."""
        if self.errno == errno.EADDRINUSE:
            return "another process listens there: stop it, or choose another --metrics-address"
        return "choose another --metrics-address"


def bound_address(sock: socket.socket) -> str:
    """``HOST:PORT`` a bound socket listens on (IPv6 in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _read_request(conn: Connection, stream: trio.abc.ReceiveStream) -> Request | None:
    while True:
        chunk = await stream.receive_some(4096)
        if not chunk:
            return None  # the client went away before finishing its request
        request = receive(conn, bytes(chunk))
        if request is not None:
            return request


async def _handle(view: View, limiter: trio.CapacityLimiter, stream: trio.SocketStream) -> None:
    try:
        limiter.acquire_nowait()
    except trio.WouldBlock:
        return  # over capacity: closed unanswered (by serve_listeners)
    conn = connection()
    try:
        with trio.move_on_after(REQUEST_TIMEOUT):
            try:
                request = await _read_request(conn, stream)
            except BadRequest as err:
                await stream.send_all(_text(err.status, str(err)).send(conn))
                return
            if request is None:
                return
            try:
                response = respond(request, view)
            except Exception:
                LOGGER.exception("admin endpoint failed answering %s", request.target)
                response = _text(500, "internal error; see the daemon's log")
            await stream.send_all(response.send(conn, head_only=request.method == "HEAD"))
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass  # the client hung up: nothing to answer
    finally:
        limiter.release()


async def serve(
    view: View, sock: socket.socket, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> NoReturn:
    """Serve the endpoint on the listening socket *sock* until cancelled; reports ``HOST:PORT``."""
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    view.address = bound_address(sock)
    limiter = trio.CapacityLimiter(MAX_CONNECTIONS)

    async def handler(stream: trio.SocketStream) -> None:
        await _handle(view, limiter, stream)

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handler, [listener])
        log.event(LOGGER, "admin_listening", address=view.address)
        task_status.started(view.address)
        await trio.sleep_forever()
    raise AssertionError("unreachable")  # pragma: no cover


# --- `krproxy status` ---------------------------------------------------------------------------
