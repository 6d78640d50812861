"""The admin HTTP endpoint (``--metrics-address``) and the ``krproxy status`` client.

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
"""

from __future__ import annotations

import errno
import functools
import http
import http.client
import json
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn, Protocol

import attrs
import h11
import trio
from prometheus_client.exposition import choose_encoder

from krproxy import __version__, log
from krproxy.config import DEFAULT_METRICS_ADDRESS as DEFAULT_STATUS_ADDRESS
from krproxy.config import ProxyConfig, parse_address
from krproxy.forward import Backend
from krproxy.hooks.guard import Guard
from krproxy.hooks.points import HookPoint
from krproxy.hooks.registration import Registry
from krproxy.hooks.runtime import HookRuntime
from krproxy.metrics import Metrics
from krproxy.relay.relay import Relay

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


# --- what the endpoint reports ------------------------------------------------------------------


def _backend_state(reachable: bool | None) -> str:
    return {None: "unknown", True: "up", False: "down"}[reachable]


class View(Protocol):
    """What the endpoint reads: ``krproxy serve``'s :class:`AdminView`, or ``krproxy nri``'s view."""

    metrics: Metrics
    address: str

    def readiness(self) -> tuple[bool, list[str]]: ...

    def status(self) -> dict[str, Any]: ...


@attrs.define(eq=False)
class AdminView:
    """The daemon's parts the endpoint reports on, read live on each request.

    Attributes:
        backends: ``(role, backend)``; the runtime and, if it is another socket, the image service.
        listening: set by the daemon once the proxy socket accepts calls.
        address: ``HOST:PORT`` the endpoint listens on (the real port when 0 was asked for).
    """

    config: ProxyConfig
    relay: Relay
    hooks: HookRuntime
    metrics: Metrics
    backends: Sequence[tuple[str, Backend]]
    listening: bool = False
    address: str = ""
    started: float = attrs.field(factory=time.time)
    _clock_start: float = attrs.field(factory=time.monotonic)

    def readiness(self) -> tuple[bool, list[str]]:
        """Whether the proxy is ready for kubelet, and if not, why."""
        reasons: list[str] = []
        if self.relay.draining:
            reasons.append("shutting down")
        elif not self.listening:
            reasons.append("the proxy socket is not accepting calls yet")
        if not self.hooks.recovered:
            down = [b.path for _, b in self.backends if b.reachable is False]
            suffix = f" (runtime unreachable: {', '.join(down)})" if down else ""
            reasons.append("the store is not recovered from the runtime yet" + suffix)
        reasons += required_reasons(self.hooks.guard)
        return not reasons, reasons

    def status(self) -> dict[str, Any]:
        """The ``/status`` document (see docs/operations.md)."""
        ready, reasons = self.readiness()
        registry = self.hooks.dispatcher.registry
        stats = self.hooks.store.statistics()
        return {
            "version": __version__,
            "pid": os.getpid(),
            "ready": ready,
            "reasons": reasons,
            "listening": self.listening,
            "draining": self.relay.draining,
            "listen": self.config.listen,
            "admin_address": self.address,
            "started": self.started,
            "uptime_seconds": round(time.monotonic() - self._clock_start, 3),
            "in_flight": self.relay.in_flight,
            "recording": self.metrics.registry.get_sample_value("krproxy_recording") == 1.0,
            "backends": [
                {
                    "role": role,
                    "endpoint": backend.path,
                    "state": _backend_state(backend.reachable),
                    "last_error": backend.last_error if backend.reachable is False else "",
                }
                for role, backend in self.backends
            ],
            "store": {"recovered": self.hooks.recovered, "pods": stats.pods, "containers": stats.containers},
            "hook_dir": self.config.hook_dir,
            **registry_status(registry),
            "required_servers": required_status(self.hooks.guard),
        }


def required_reasons(guard: Guard | None) -> list[str]:
    """The /readyz reason naming the ``--required-hook-server`` servers that are not up, if any."""
    missing = guard.missing() if guard is not None else []
    if not missing:
        return []
    described = ", ".join(f"{name} {a.describe()}" for name, a in missing)
    return [f"required hook servers missing (calls at their hook points are refused): {described}"]


def required_status(guard: Guard | None) -> list[dict[str, Any]]:
    """The ``required_servers`` part of a ``/status`` document: the ``--required-hook-server`` servers,
    then names pods' annotations required (``declared`` false), each with its state as last probed."""
    if guard is None:
        return []
    points = {s.name: [p.value for p in HookPoint if p in s.points] for s in guard.requirements.servers}
    return [
        {
            "name": name,
            "declared": name in points,
            "hooks": points.get(
                name, [HookPoint.PRE_RUN_POD_SANDBOX.value, HookPoint.PRE_CREATE_CONTAINER.value]
            ),
            "state": availability.state.name.lower(),
            "detail": availability.detail,
        }
        for name, availability in sorted(guard.states().items(), key=lambda i: (i[0] not in points, i[0]))
    ]


def registry_status(registry: Registry) -> dict[str, Any]:
    """The ``plugins`` and ``registration_errors`` parts of a ``/status`` document."""
    return {
        "plugins": [
            {
                "name": p.name,
                "file": p.file,
                "endpoint": p.endpoint,
                "hooks": [h.value for h in p.hooks],
                "failure_policy": p.failure_policy.value,
                "timeout": p.timeout,
                "order": p.order,
                "warnings": list(p.warnings),
            }
            for p in registry.ordered()
        ],
        "registration_errors": dict(sorted(registry.errors.items())),
    }


def _up(backend: Backend) -> float:
    # NaN until the first call: neither up nor down, so an alert on == 0 stays quiet.
    return float("nan") if backend.reachable is None else float(backend.reachable)


def wire_metrics(view: AdminView) -> None:
    """Point the metrics that are read at scrape time (gauges) at the live daemon."""
    metrics = view.metrics
    metrics.in_flight.set_function(lambda: view.relay.in_flight)
    metrics.plugins.set_function(lambda: len(view.hooks.dispatcher.registry.plugins))
    metrics.ready.set_function(lambda: view.readiness()[0])
    for role, backend in view.backends:
        metrics.backend_up.labels(role, backend.path).set_function(functools.partial(_up, backend))


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


class Unreachable(Exception):
    """No daemon answered at the address, or its answer was not a status document."""


def fetch_status(address: str, timeout: float = 5.0) -> dict[str, Any]:
    """GET ``/status`` from a daemon's admin endpoint (blocking; for the CLI).

    Raises:
        Unreachable: connection failed or timed out, or the answer was not a JSON object.
    """
    try:
        host, port = parse_address(address)
    except ValueError as err:
        raise Unreachable(str(err)) from None
    host = {"": "127.0.0.1"}.get(host, host)
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", "/status")
        answer = connection.getresponse()
        body = answer.read()
        if answer.status != 200:
            raise Unreachable(f"{address}/status answered {answer.status} {answer.reason}")
        document = json.loads(body)
    except OSError as err:
        raise Unreachable(
            f"no krproxy status at {address}: {err}; is krproxy serve (or nri) running with "
            f"--metrics-address={address}? The status endpoint is off without that flag"
        ) from None
    except (http.client.HTTPException, ValueError) as err:
        raise Unreachable(f"no krproxy status at {address}: {err}") from None
    finally:
        connection.close()
    if not isinstance(document, dict):
        raise Unreachable(f"{address}/status did not answer a JSON object")
    return document


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{days}d"] if days else []
    if days or hours:
        parts.append(f"{hours}h")
    if days or hours or minutes:
        parts.append(f"{minutes}m")
    return "".join([*parts, f"{secs}s"])


def render_status(status: Mapping[str, Any]) -> str:
    """A readable report of a ``/status`` document (missing keys are shown as ``?``)."""

    def get(key: str, default: Any = "?") -> Any:
        return status.get(key, default)

    ready = get("ready", False)
    lines = [
        f"krproxy {get('version')} (pid {get('pid')}), up {_duration(float(get('uptime_seconds', 0)))}",
        "ready: yes" if ready else "ready: NO — " + "; ".join(get("reasons", []) or ["unknown"]),
    ]
    nri = get("nri", None)
    if isinstance(nri, Mapping):  # krproxy nri: no proxy socket, a plugin of the runtime's NRI
        registered = f"registered as {nri.get('plugin', '?')}" if nri.get("registered") else "not registered"
        protocol = ", ".join(
            part
            for part in (
                f"NRI {nri['nri_version']}" if nri.get("nri_version") else "",
                f"events via {nri['event_calls']}" if nri.get("event_calls") else "",
            )
            if part
        )
        lines.append(
            f"nri: {nri.get('socket', '?')} — {registered}, runtime {nri.get('runtime') or '?'}"
            + (f" ({protocol})" if protocol else "")
            + f", request timeout {nri.get('request_timeout', '?')}s, events {nri.get('events', '?')}"
        )
        if nri.get("runtime_validator"):
            lines.append(f"containerd's validator: krproxy nri is {nri['runtime_validator']}")
    else:
        lines.append(
            f"listen: {get('listen')} ({'accepting calls' if get('listening', False) else 'not accepting calls'}"
            + (", shutting down" if get("draining", False) else "")
            + f"), {get('in_flight', 0)} in flight"
        )
    for backend in get("backends", []):
        line = f"backend {backend.get('role', '?')}: {backend.get('endpoint', '?')} — {backend.get('state', '?')}"
        if backend.get("last_error"):
            line += f" ({backend['last_error']})"
        elif backend.get("state") == "unknown":
            line += " (no call forwarded yet)"
        lines.append(line)
    store = get("store", {})
    lines.append(
        f"store: {store.get('pods', '?')} pods, {store.get('containers', '?')} containers, "
        + ("recovered" if store.get("recovered") else "NOT recovered")
    )
    if get("recording", False):
        lines.append("recording: on")
    plugins = get("plugins", [])
    lines.append(f"plugins ({get('hook_dir')}): {len(plugins) or 'none'}")
    for p in plugins:
        hooks = ", ".join(p.get("hooks", [])) or "no hooks"
        lines.append(
            f"  {p.get('name')}: {p.get('endpoint')} policy={p.get('failure_policy')} "
            f"timeout={p.get('timeout')}s order={p.get('order')} hooks: {hooks}"
        )
        lines.extend(f"    warning: {w}" for w in p.get("warnings", []))
    for server in get("required_servers", []):
        state = server.get("state", "?")
        detail = f" ({server['detail']})" if server.get("detail") else ""
        origin = "" if server.get("declared", True) else ", from pod annotations"
        lines.append(
            f"required hook server {server.get('name')}: {state.replace('_', ' ')}{detail}{origin}; "
            f"hooks: {', '.join(server.get('hooks', [])) or '?'}"
        )
    errors = get("registration_errors", {})
    if errors:
        lines.append(f"registration errors: {len(errors)}")
        lines.extend(f"  {error}" for error in errors.values())
    return "\n".join(lines) + "\n"


def add_status_subcommand(subparsers: Any) -> None:
    """Add ``krproxy status`` to the CLI's subparsers."""
    import argparse

    p: argparse.ArgumentParser = subparsers.add_parser(
        "status",
        help="report a running daemon's readiness, backend and plugins",
        description="Ask a running `krproxy serve` or `krproxy nri` (started with --metrics-address) for /status and print it. "
        "Exit status: 0 ready, 1 running but not ready, 2 unreachable.",
    )
    p.add_argument(
        "--metrics-address",
        default=DEFAULT_STATUS_ADDRESS,
        metavar="HOST:PORT",
        help="the daemon's --metrics-address; default: %(default)s",
    )
    p.add_argument("--json", action="store_true", help="print the /status JSON document as it came")
    p.add_argument(
        "--timeout", type=float, default=5.0, metavar="SECONDS", help="give up after; default: %(default)s"
    )
    p.set_defaults(func=status_main)


def status_main(args: Any) -> int:
    """``krproxy status``: 0 ready, 1 not ready, 2 unreachable."""
    import sys

    try:
        status = fetch_status(args.metrics_address, args.timeout)
    except Unreachable as err:
        print(f"krproxy status: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        print(render_status(status), end="")
    return 0 if status.get("ready") is True else 1
