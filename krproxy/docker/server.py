"""``krproxy serve --backend-runtime-mode=Docker``: an HTTP/1.1 reverse proxy in front of dockerd.

::

    trio.run
    └── root nursery
        ├── relay (not serving)            the dispatcher's connections to the plugins
        ├── hook directory watcher         registration files -> Dispatcher registry
        ├── store recovery                 /info, /containers/json?all=1, inspect; retried
        ├── connection handlers            one task per client connection (h11 on trio streams)
        │   └── accept loop                trio.serve_listeners on the proxy socket
        └── signal watcher                 SIGTERM/SIGINT -> graceful drain

Per client connection, requests are read one after another (keep-alive). Each request gets its
own connection to dockerd's socket. Intercepted requests (:mod:`krproxy.docker.routes`) are
read whole and run through :class:`~krproxy.docker.hooks.DockerHooks`; every other request is
relayed as it streams — request body, then response head and body, so ``logs -f``, ``events``
and ``stats`` flow as dockerd writes them. Connections dockerd hijacks (``101 Switching
Protocols`` after ``Upgrade: tcp``, or ``200`` with a ``vnd.docker.raw-stream`` /
``multiplexed-stream`` content type and no body framing) become a byte relay both ways
(:func:`krproxy.docker._http.splice`) until dockerd's side ends.

Plugins are called as in CRI mode, through a :class:`krproxy.relay.Relay` that serves no
socket of its own.

Error handling: a request that is not HTTP/1.1 gets 400 (431 for oversized heads) and the
connection is closed; a body that cannot be a create/update request gets 400; dockerd
unreachable gets 502; a ``Fail`` plugin failing a pre hook gets 500 with the error text. None
of these disturbs other connections.

Shutdown: on SIGTERM or SIGINT the proxy stops accepting, answers 503 to new requests on open
connections, gives requests in progress (streams and hijacked sessions included)
``grace_period`` seconds, then cancels what is left and removes its socket file.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import urllib.parse
from typing import Any

import attrs
import h11
import trio

from krproxy import _supervise, log, unixsock
from krproxy.config import ProxyConfig
from krproxy.docker import _http, client, recovery
from krproxy.docker._http import Peer, Reply, error_reply, header
from krproxy.docker.hooks import DockerHooks, Request
from krproxy.docker.routes import route
from krproxy.hooks.dispatch import Dispatcher
from krproxy.hooks.store import HookStore
from krproxy.hooks.watcher import watch_hook_dir
from krproxy.metrics import Metrics
from krproxy.relay import Relay

__all__ = ["DockerDaemon", "DockerProxy", "serve"]

LOGGER = logging.getLogger("krproxy.docker")

#: Largest body of an intercepted request (create/update JSON is a few KiB); larger gets 413.
MAX_HOOKED_BODY = 8 << 20
#: Largest reply to an intercepted request the proxy buffers (create answers ``{"Id":...}``).
MAX_HOOKED_REPLY = 8 << 20
#: h11 buffers what a client sends while its response streams; past this the proxy stops reading.
MAX_PIPELINED = 1 << 20
#: Content types with which dockerd hijacks a connection without ``101`` (clients without ``Upgrade``).
RAW_STREAM_TYPES = (b"application/vnd.docker.raw-stream", b"application/vnd.docker.multiplexed-stream")
#: ProxyConfig settings that only CRI mode honours (the admin endpoint is warned about by krproxy.daemon).
_CRI_ONLY = ("record", "oci_hook_dirs")


class _Upstream(Exception):
    """dockerd could not be reached, or broke HTTP before its response head."""


def _hijacks(event: h11.Response | h11.InformationalResponse) -> bool:
    if event.status_code == 101:
        return True
    headers = event.headers
    content_type = (header(headers, b"content-type") or b"").split(b";")[0].strip().lower()
    framed = (
        header(headers, b"content-length") is not None or header(headers, b"transfer-encoding") is not None
    )
    return content_type in RAW_STREAM_TYPES and not framed


@attrs.define(eq=False)
class DockerProxy:
    """Serves client connections: relays them to dockerd at ``backend``, with hooks on the way."""

    backend: str
    hooks: DockerHooks
    draining: bool = False
    in_flight: int = attrs.field(default=0, init=False)
    _idle: trio.Event = attrs.field(factory=trio.Event, init=False)

    async def wait_idle(self) -> None:
        """Return once no request is in progress."""
        while self.in_flight:
            self._idle = trio.Event()
            await self._idle.wait()
        await trio.lowlevel.checkpoint()

    async def serve_connection(self, stream: trio.SocketStream) -> None:
        """Serve one client connection until it closes (the stream is closed on return).

        Resource handling: the client stream and every dockerd connection opened for it are closed
        whatever happens; a broken client connection ends only this task.
        """
        async with stream:
            down = Peer.server(stream)
            try:
                while await self._exchange(down):
                    down.conn.start_next_cycle()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client went away
            except Exception as err:  # one connection's bug must not take the daemon down
                LOGGER.exception("connection_failed")  # with the traceback: this is a bug of ours
                with contextlib.suppress(Exception):
                    await self._send_reply(
                        down, error_reply(500, f"krproxy: {type(err).__name__}: {err}", close=True)
                    )

    async def _exchange(self, down: Peer) -> bool:
        """Serve one request; whether the connection may carry another."""
        try:
            event = await down.next_event()
        except h11.RemoteProtocolError as err:
            await self._send_reply(
                down, error_reply(err.error_status_hint, f"bad request: {err}", close=True)
            )
            return False
        if not isinstance(event, h11.Request):
            return False  # the client closed between requests
        if len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers) > _http.MAX_HEADER_BYTES:
            # h11 bounds only a head that arrives in pieces; one that arrives whole is bounded here.
            await self._send_reply(down, error_reply(431, "request head too large", close=True))
            return False
        if self.draining:
            await self._send_reply(down, error_reply(503, "krproxy is shutting down", close=True))
            return False
        if down.conn.client_is_waiting_for_100_continue:
            await down.send(h11.InformationalResponse(status_code=100, headers=[]))
        self.in_flight += 1
        try:
            hooked = route(event.method, event.target)
            if hooked is None:
                return await self._passthrough(down, event)
            body = await down.read_body(MAX_HOOKED_BODY)
            if body is None:
                await self._send_reply(down, error_reply(413, "request body too large", close=True))
                return False
            reply = await self.hooks.handle(
                hooked,
                Request(
                    event.method,
                    event.target,
                    body,
                    chunked=header(event.headers, b"transfer-encoding") is not None,
                ),
                functools.partial(self._forward_whole, event, body),
            )
            await self._send_reply(down, reply)
        except h11.RemoteProtocolError as err:
            await self._send_reply(
                down, error_reply(err.error_status_hint, f"bad request: {err}", close=True)
            )
            return False
        except _Upstream as err:
            await self._send_reply(down, error_reply(502, str(err), close=True))
            return False
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()
        return down.conn.our_state is h11.DONE and down.conn.their_state is h11.DONE

    async def _send_reply(self, down: Peer, reply: Reply) -> None:
        if down.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return  # a response is already on its way: nothing sensible can be added
        try:
            await down.send(
                h11.Response(status_code=reply.status, headers=reply.headers, reason=reply.reason)
            )
            if reply.body:
                await down.send(h11.Data(data=reply.body))
            await down.send(h11.EndOfMessage())
        except h11.LocalProtocolError as err:  # e.g. a body for a HEAD request: drop the connection
            log.warning(LOGGER, "reply_not_sendable", error=str(err))
            down.conn.send_failed()

    async def _connect(self) -> Peer:
        try:
            return Peer.client(await trio.open_unix_socket(self.backend))
        except OSError as err:
            raise _Upstream(f"cannot reach dockerd at {self.backend}: {err.strerror or err}") from None

    @staticmethod
    def _upstream_request(
        request: h11.Request, headers: list[tuple[bytes, bytes]] | None = None
    ) -> h11.Request:
        sent = list(request.headers.raw_items()) if headers is None else headers
        if header(sent, b"host") is None:  # HTTP/1.0 clients may omit it; HTTP/1.1 requires it
            sent.insert(0, (b"Host", b"docker"))
        return h11.Request(method=request.method, target=request.target, headers=sent)

    async def _head(self, up: Peer) -> h11.Response | h11.InformationalResponse:
        """dockerd's response head (1xx other than 101 skipped)."""
        try:
            while True:
                event = await up.next_event()
                if isinstance(event, h11.InformationalResponse) and event.status_code != 101:
                    continue
                if isinstance(event, (h11.Response, h11.InformationalResponse)):
                    return event
                raise _Upstream("dockerd closed the connection without answering")
        except (h11.RemoteProtocolError, trio.BrokenResourceError) as err:
            raise _Upstream(f"bad answer from dockerd: {err}") from None

    async def _forward_whole(self, request: h11.Request, original: bytes, body: bytes | None) -> Reply:
        """Forward an intercepted request (with *body* if not None) and read dockerd's whole reply."""
        up = await self._connect()
        async with up.stream:
            headers = None if body is None else _http.with_body_length(request.headers.raw_items(), len(body))
            try:
                await up.send(self._upstream_request(request, headers))
                payload = original if body is None else body
                if payload:
                    await up.send(h11.Data(data=payload))
                await up.send(h11.EndOfMessage())
            except (trio.BrokenResourceError, h11.LocalProtocolError) as err:
                raise _Upstream(f"cannot send to dockerd: {err}") from None
            head = await self._head(up)
            if isinstance(head, h11.InformationalResponse) or _hijacks(head):
                raise _Upstream(f"dockerd hijacked {request.method.decode()} {request.target.decode()}")
            try:
                content = await up.read_body(MAX_HOOKED_REPLY, "reply body")
            except (h11.RemoteProtocolError, trio.BrokenResourceError) as err:
                raise _Upstream(f"bad answer from dockerd: {err}") from None
            if content is None:
                raise _Upstream("dockerd's reply is too large")
            return Reply(head.status_code, list(head.headers.raw_items()), content, head.reason)

    @staticmethod
    async def _send_up(up: Peer, event: h11.Event) -> None:
        try:
            await up.send(event)
        except (trio.BrokenResourceError, h11.LocalProtocolError) as err:
            raise _Upstream(f"cannot send to dockerd: {err}") from None

    async def _passthrough(self, down: Peer, request: h11.Request) -> bool:
        """Relay a request and its response as they stream; whether the connection may go on."""
        up = await self._connect()
        async with up.stream:
            await self._send_up(up, self._upstream_request(request))
            while True:
                event = await down.next_event()
                if isinstance(event, h11.Data):
                    await self._send_up(up, h11.Data(data=event.data))
                elif isinstance(event, h11.EndOfMessage):
                    await self._send_up(up, h11.EndOfMessage())
                    break
                else:
                    raise h11.RemoteProtocolError(f"unexpected {type(event).__name__} in request body")
            hijack: h11.Response | h11.InformationalResponse | None = None
            with trio.CancelScope() as client_gone:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._watch_client, down, client_gone)
                    hijack = await self._relay_response(down, up)
                    nursery.cancel_scope.cancel()
            if client_gone.cancelled_caught:
                return False
            if hijack is not None:
                await down.stream.send_all(_http.raw_head(hijack) + up.conn.trailing_data[0])
                pending, client_done = down.conn.trailing_data
                if pending:
                    await up.stream.send_all(pending)
                await _http.splice(down.stream, up.stream, client_done=client_done)
                return False
        return down.conn.our_state is h11.DONE and down.conn.their_state is h11.DONE

    @staticmethod
    async def _watch_client(down: Peer, client_gone: trio.CancelScope) -> None:
        """While a response streams, notice the client leaving (it ends the exchange, as in Go's
        net/http). What the client sends meanwhile stays in h11's buffer for later."""
        try:
            while len(down.conn.trailing_data[0]) < MAX_PIPELINED:
                if not await down.feed():
                    break
            else:
                await trio.sleep_forever()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        client_gone.cancel()

    async def _relay_response(self, down: Peer, up: Peer) -> h11.Response | h11.InformationalResponse | None:
        """Relay dockerd's response to the client; the head instead if dockerd hijacks the connection."""
        try:
            head = await self._head(up)
        except _Upstream as err:
            await self._send_reply(down, error_reply(502, str(err), close=True))
            return None
        if _hijacks(head):
            return head
        await down.send(
            h11.Response(status_code=head.status_code, headers=head.headers.raw_items(), reason=head.reason)
        )
        try:
            while True:
                event = await up.next_event()
                if isinstance(event, h11.Data):
                    await down.send(h11.Data(data=event.data))
                elif isinstance(event, h11.EndOfMessage):
                    await down.send(h11.EndOfMessage())
                    return None
                else:
                    break
        except (h11.RemoteProtocolError, trio.BrokenResourceError) as err:
            log.warning(LOGGER, "upstream_broke_mid_response", error=str(err))
        down.conn.send_failed()  # the client sees the connection close before the body's end
        return None


@attrs.define(eq=False)
class DockerDaemon:
    """A running Docker-mode proxy, as handed to whoever started it (tests)."""

    config: ProxyConfig
    proxy: DockerProxy
    hooks: DockerHooks
    dispatcher: Dispatcher
    metrics: Metrics
    _shutdown: trio.Event = attrs.field(factory=trio.Event, init=False)

    def request_shutdown(self) -> None:
        """Start a graceful shutdown, as SIGTERM does."""
        self._shutdown.set()


async def _container_id(backend: str, reference: str) -> str:
    """The id of the container dockerd finds for *reference* (inspect), or ``""``."""
    try:
        document = await client.get_json(
            backend, f"/containers/{urllib.parse.quote(reference, safe='')}/json"
        )
    except (OSError, h11.ProtocolError, client.DockerError):
        return ""
    ident = document.get("Id") if isinstance(document, dict) else None
    return ident if isinstance(ident, str) else ""


async def _recover_store(config: ProxyConfig, hooks: DockerHooks, metrics: Metrics) -> None:
    recovered = await _supervise.retry(
        functools.partial(recovery.recover, config.runtime_endpoint),
        retry_on=(OSError, h11.ProtocolError, client.DockerError),
        runtime=config.runtime_endpoint,
    )
    hooks.cgroup_driver = recovered.cgroup_driver
    _supervise.store_recovered(
        hooks, recovered, metrics, LOGGER, cgroup_driver=recovered.cgroup_driver, vanished=recovered.vanished
    )


async def serve(
    config: ProxyConfig,
    *,
    handle_signals: bool = True,
    sock: socket.socket | None = None,
    inherited: bool = False,
    task_status: trio.TaskStatus[DockerDaemon] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the Docker-mode proxy until a shutdown is requested.

    ``sock`` is the listening socket if the caller bound it already; ``inherited``: it is
    systemd's (socket activation), and its file is left in place at the end. Reports the
    :class:`DockerDaemon` through ``task_status`` once the socket accepts connections.
    """
    if sock is None:
        sock = unixsock.bind_unix_socket(config.listen, mode=config.socket_mode, gid=config.socket_group)
    ignored = [name for name in _CRI_ONLY if getattr(config, name, None)]
    if ignored:
        log.warning(LOGGER, "cri_only_settings_ignored", settings=",".join(ignored))
    # At the end the socket file is removed only if it is still ours: a successor may have
    # replaced it while we were draining.
    inode = 0 if inherited else os.stat(config.listen).st_ino
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    metrics = Metrics()
    relay = Relay()  # not serving: only the dispatcher's calls to the plugins
    dispatcher = Dispatcher(relay, observe=metrics.observe_hook)
    hooks = DockerHooks(
        HookStore(),
        dispatcher.run,
        config.skip_label,
        lookup=functools.partial(_container_id, config.runtime_endpoint),
    )
    metrics.track_store(lambda: hooks.store)
    proxy = DockerProxy(config.runtime_endpoint, hooks)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(relay.run)
            await nursery.start(watch_hook_dir, config, dispatcher.publish, metrics.registration_error)
            nursery.start_soon(_recover_store, config, hooks, metrics)
            async with trio.open_nursery() as handlers:
                accepting = trio.CancelScope()

                async def accept(task_status: trio.TaskStatus[Any]) -> None:
                    with accepting:
                        await trio.serve_listeners(
                            proxy.serve_connection,
                            [listener],
                            handler_nursery=handlers,
                            task_status=task_status,
                        )

                await handlers.start(accept)
                daemon = DockerDaemon(config, proxy, hooks, dispatcher, metrics)
                if handle_signals:
                    await nursery.start(_supervise.watch_signals, daemon.request_shutdown)
                _supervise.log_ready(LOGGER, config, len(dispatcher.registry.plugins), mode="Docker")
                task_status.started(daemon)
                await daemon._shutdown.wait()
                accepting.cancel()
                # New connections are refused at once instead of waiting unserved in the backlog.
                await listener.aclose()
                proxy.draining = True
                log.event(LOGGER, "draining", in_flight=proxy.in_flight, grace_period=config.grace_period)
                with trio.move_on_after(config.grace_period) as grace:
                    await proxy.wait_idle()
                if grace.cancelled_caught:
                    log.warning(LOGGER, "grace_period_over", cancelled=proxy.in_flight)
                handlers.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
    finally:
        dispatcher.close()
        sock.close()
        if not inherited:
            unixsock.unlink_if_ours(config.listen, inode)
    log.event(LOGGER, "stopped", listen=config.listen)
