"""The fake dockerd's HTTP side: the Docker Engine API subset the proxy and its tests need, on trio + h11.

Endpoints (each also under a ``/vX.Y`` prefix):

===========================================  =============================================================
``GET /_ping``, ``/version``, ``/info``      health, version, ``CgroupDriver``
``POST /containers/create?name=``            201 ``{"Id"}``; 409 on a taken name; 400 on a bad body
``GET /containers/json[?all=1]``             running (or all) containers
``GET /containers/{id}/json``                inspect: ``Name``, ``Config`` (Labels, Env), ``HostConfig``
``POST /containers/{id}/start|stop``         204, or 304 when already in that state
``POST /containers/{id}/restart``            204: stopped (if running) and started again
``POST /containers/{id}/update``             200; resource keys of the body replace the HostConfig's
``DELETE /containers/{id}``                  204; 409 while running
``GET /containers/{id}/logs[?follow=1]``     streaming: chunked multiplexed frames of the container's log;
                                             with ``follow`` new lines as :meth:`FakeDockerd.append_log`
                                             adds them, until the container stops
``GET /events``                              streaming: chunked JSON lines, one per state change, until the
                                             client leaves
``POST /containers/{id}/exec``               201 ``{"Id"}``
``POST /exec/{id}/start``                    hijack: ``101 UPGRADED`` when asked ``Upgrade: tcp``, else
                                             ``200`` raw-stream; then echoes every byte back until the
                                             client half-closes, then closes
===========================================  =============================================================

Every request is logged (:attr:`FakeDockerd.requests`) before it is handled; :meth:`FakeDockerd.inject`
makes the next matching request fail with a chosen status.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import urllib.parse
from collections.abc import Callable
from typing import Any

import attrs
import h11
import trio

from krproxy.fakes.dockerd.state import DockerState, Failure, RequestRecord, multiplex

__all__ = ["FakeDockerd", "run_fake_dockerd"]

LOGGER = logging.getLogger("krproxy.fakes.dockerd")

_RECEIVE = 64 * 1024
_VERSION = re.compile(r"^/v\d+\.\d+(?=/)")
_JSON = (b"Content-Type", b"application/json")
_RAW_STREAM = b"application/vnd.docker.raw-stream"


@attrs.define
class _Fault:
    method: str
    pattern: re.Pattern[str]
    failure: Failure
    times: int


@attrs.define(eq=False)
class FakeDockerd:
    """A scriptable Docker Engine API with a request log.

    Attributes:
        state: containers and execs (:class:`krproxy.fakes.dockerd.state.DockerState`).
        requests: every request received, in arrival order.
        hijacked: bytes the exec sessions received from clients, in order.
    """

    state: DockerState = attrs.field(factory=DockerState)
    requests: list[RequestRecord] = attrs.field(factory=list, init=False)
    hijacked: list[bytes] = attrs.field(factory=list, init=False)
    _faults: list[_Fault] = attrs.field(factory=list, init=False)
    _changed: trio.Event = attrs.field(factory=trio.Event, init=False)

    # -- test-facing API ----------------------------------------------------------------------

    def inject(
        self, method: str, path_pattern: str, status: int, message: str = "injected", times: int = 1
    ) -> None:
        """Make the next *times* requests whose (unversioned) path matches *path_pattern* fail."""
        self._faults.append(_Fault(method, re.compile(path_pattern), Failure(status, message), times))

    def append_log(self, ident: str, data: bytes) -> None:
        """Add a stdout line to a container's log (followers get it at once)."""
        self.state.find(ident).logs.append(data)
        self._notify()

    def requests_to(self, method: str, path_pattern: str) -> list[RequestRecord]:
        """Logged requests whose method and unversioned path match."""
        pattern = re.compile(path_pattern)
        return [r for r in self.requests if r.method == method and pattern.search(_VERSION.sub("", r.path))]

    # -- machinery ----------------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def serve_connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            conn = h11.Connection(h11.SERVER)
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
                while True:
                    request, body = await _read_request(stream, conn)
                    if request is None:
                        return
                    keep = await self._handle(stream, conn, request, body)
                    if not keep or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                        return
                    conn.start_next_cycle()

    async def _handle(
        self, stream: trio.SocketStream, conn: h11.Connection, request: h11.Request, body: bytes
    ) -> bool:
        target = request.target.decode("latin-1")
        record = RequestRecord(
            request.method.decode(),
            target,
            tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw_items()),
            body,
        )
        self.requests.append(record)
        parsed = urllib.parse.urlsplit(target)
        path = _VERSION.sub("", parsed.path)
        query = {k: v[0] for k, v in urllib.parse.parse_qs(parsed.query).items()}
        try:
            self._take_fault(record.method, path)
            return await self._dispatch(stream, conn, request, record.method, path, query, body)
        except Failure as failure:
            await _reply(stream, conn, failure.status, {"message": failure.message})
            return True

    def _take_fault(self, method: str, path: str) -> None:
        for fault in self._faults:
            if fault.method == method and fault.pattern.search(path):
                fault.times -= 1
                if fault.times <= 0:
                    self._faults.remove(fault)
                raise fault.failure

    async def _dispatch(
        self,
        stream: trio.SocketStream,
        conn: h11.Connection,
        request: h11.Request,
        method: str,
        path: str,
        query: dict[str, str],
        body: bytes,
    ) -> bool:
        state = self.state
        parts = path.strip("/").split("/")
        if method == "GET" and path == "/_ping":
            await _reply(stream, conn, 200, b"OK")
        elif method == "GET" and path == "/version":
            await _reply(
                stream, conn, 200, {"Version": "20.10.24-fake", "ApiVersion": "1.41", "MinAPIVersion": "1.12"}
            )
        elif method == "GET" and path == "/info":
            await _reply(
                stream, conn, 200, {"CgroupDriver": state.cgroup_driver, "Containers": len(state.containers)}
            )
        elif method == "POST" and path == "/containers/create":
            container = state.create(query.get("name", ""), _decode(body))
            self._notify()
            await _reply(stream, conn, 201, {"Id": container.id, "Warnings": []})
        elif method == "GET" and path == "/containers/json":
            everything = query.get("all") in ("1", "true", "True")
            listed = [c.summary() for c in state.containers.values() if everything or c.running]
            await _reply(stream, conn, 200, listed)
        elif method == "GET" and parts[0] == "containers" and len(parts) == 3 and parts[2] == "json":
            await _reply(stream, conn, 200, state.find(parts[1]).inspect())
        elif (
            method == "POST"
            and parts[0] == "containers"
            and len(parts) == 3
            and parts[2] in ("start", "stop", "restart")
        ):
            if parts[2] == "restart":  # dockerd: stopped if running, started again; 204
                state.stop(parts[1])
                changed = state.start(parts[1])
            else:
                changed = state.start(parts[1]) if parts[2] == "start" else state.stop(parts[1])
            self._notify()
            await _reply(stream, conn, 204 if changed else 304, None)
        elif method == "POST" and parts[0] == "containers" and len(parts) == 3 and parts[2] == "update":
            state.update(parts[1], _decode(body))
            await _reply(stream, conn, 200, {"Warnings": []})
        elif method == "DELETE" and parts[0] == "containers" and len(parts) == 2:
            state.remove(parts[1])
            await _reply(stream, conn, 204, None)
        elif method == "GET" and parts[0] == "containers" and len(parts) == 3 and parts[2] == "logs":
            await self._logs(stream, conn, parts[1], follow=query.get("follow") in ("1", "true"))
        elif method == "GET" and path == "/events":
            await self._events(stream, conn)
        elif method == "POST" and parts[0] == "containers" and len(parts) == 3 and parts[2] == "exec":
            await _reply(stream, conn, 201, {"Id": state.exec_create(parts[1])})
        elif method == "POST" and parts[0] == "exec" and len(parts) == 3 and parts[2] == "start":
            if parts[1] not in state.execs:
                raise Failure(404, f"No such exec instance: {parts[1]}")
            await self._exec_session(stream, conn, request)
            return False
        else:
            raise Failure(404, f"page not found: {method} {path}")
        return True

    async def _logs(
        self, stream: trio.SocketStream, conn: h11.Connection, ident: str, *, follow: bool
    ) -> None:
        container = self.state.find(ident)
        headers = [
            (b"Content-Type", b"application/vnd.docker.multiplexed-stream"),
            (b"Transfer-Encoding", b"chunked"),
        ]
        await _send(stream, conn, h11.Response(status_code=200, headers=headers))
        sent = 0
        while True:
            changed = self._changed  # taken before sending: a change meanwhile sets this one
            pending = container.logs[sent:]
            sent += len(pending)
            for line in pending:
                await _send(stream, conn, h11.Data(data=multiplex(1, line)))
            if not follow or not container.running or container.id not in self.state.containers:
                break
            await changed.wait()
        await _send(stream, conn, h11.EndOfMessage())

    async def _events(self, stream: trio.SocketStream, conn: h11.Connection) -> None:
        send, receive = trio.open_memory_channel[dict[str, Any]](math.inf)
        listener: Callable[[dict[str, Any]], None] = send.send_nowait
        self.state.listeners.append(listener)
        try:
            headers = [_JSON, (b"Transfer-Encoding", b"chunked")]
            await _send(stream, conn, h11.Response(status_code=200, headers=headers))
            async with trio.open_nursery() as nursery:

                async def client_leaves() -> None:
                    while await stream.receive_some(_RECEIVE):
                        pass
                    nursery.cancel_scope.cancel()

                nursery.start_soon(client_leaves)
                async for event in receive:
                    await _send(stream, conn, h11.Data(data=json.dumps(event).encode() + b"\n"))
        finally:
            self.state.listeners.remove(listener)

    async def _exec_session(
        self, stream: trio.SocketStream, conn: h11.Connection, request: h11.Request
    ) -> None:
        upgrade = (_header(request, b"upgrade") or b"").lower() == b"tcp"
        if upgrade:
            head = (
                b"HTTP/1.1 101 UPGRADED\r\nContent-Type: application/vnd.docker.raw-stream\r\n"
                b"Connection: Upgrade\r\nUpgrade: tcp\r\n\r\n"
            )
        else:
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/vnd.docker.raw-stream\r\n\r\n"
        await stream.send_all(head)
        pending, closed = conn.trailing_data
        if pending:
            self.hijacked.append(pending)
            await stream.send_all(pending)
        if not closed:
            while data := await stream.receive_some(_RECEIVE):
                self.hijacked.append(data)
                await stream.send_all(data)


def _header(request: h11.Request, name: bytes) -> bytes | None:
    for key, value in request.headers:
        if key == name:
            return value
    return None


def _decode(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError as err:
        raise Failure(400, f"invalid JSON: {err}") from None


async def _send(stream: trio.SocketStream, conn: h11.Connection, event: h11.Event) -> None:
    data = conn.send(event)
    if data:
        await stream.send_all(data)


async def _reply(stream: trio.SocketStream, conn: h11.Connection, status: int, body: Any) -> None:
    if body is None:
        payload, headers = b"", []
    elif isinstance(body, bytes):
        payload, headers = body, [(b"Content-Type", b"text/plain; charset=utf-8")]
    else:
        payload, headers = json.dumps(body).encode() + b"\n", [_JSON]
    if status not in (204, 304):
        headers.append((b"Content-Length", str(len(payload)).encode()))
    await _send(stream, conn, h11.Response(status_code=status, headers=[*headers, (b"Api-Version", b"1.41")]))
    if payload and status not in (204, 304):
        await _send(stream, conn, h11.Data(data=payload))
    await _send(stream, conn, h11.EndOfMessage())


async def _read_request(stream: trio.SocketStream, conn: h11.Connection) -> tuple[h11.Request | None, bytes]:
    request: h11.Request | None = None
    chunks: list[bytes] = []
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(_RECEIVE))
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            chunks.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage) or event is h11.PAUSED:
            return request, b"".join(chunks)
        else:  # ConnectionClosed
            return None, b""


async def run_fake_dockerd(
    path: str,
    fake: FakeDockerd | None = None,
    *,
    task_status: trio.TaskStatus[FakeDockerd] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a fake dockerd on the unix socket *path* until cancelled (the socket file is removed then).

    Reports the :class:`FakeDockerd` through ``task_status`` once the socket accepts connections.
    Plain trio: no asyncio loop needed.
    """
    fake = FakeDockerd() if fake is None else fake
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    try:
        await sock.bind(path)
        sock.listen(128)
        listener = trio.SocketListener(sock)
        LOGGER.info("event=listening path=%s", path)
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, fake.serve_connection, [listener])
            task_status.started(fake)
    finally:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
