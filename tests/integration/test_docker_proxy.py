"""Docker mode as a plain reverse proxy: passthrough, streaming, hijacked sessions, bad input.

Raw unix-socket clients talk to the proxy (Docker mode) in front of the fake dockerd, so that what
crosses the proxy can be compared byte for byte.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket

import pytest
import trio

from krproxy.docker.client import request
from krproxy.fakes.dockerd import multiplex
from krproxy.unixsock import bind_unix_socket
from tests.integration.support import wait_until
from tests.integration.test_docker_support import (
    CONTAINER_NAME,
    DockerNode,
    make_node,
    open_raw,
    read_response,
    receive_until,
)


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str) -> DockerNode:
    node = await make_node(nursery, sockdir)
    await node.start_proxy()
    node.fake.requests.clear()  # recovery's
    return node


async def running_container(node: DockerNode) -> str:
    ident = await node.create("plain", {"Image": "busybox"})
    await node.call("POST", f"/containers/{ident}/start")
    return ident


class TestPassthrough:
    async def test_unintercepted_request_is_relayed(self, node: DockerNode) -> None:
        """A request without hooks reaches dockerd with its method, target, headers and body, and the
        answer comes back unchanged."""
        reply = await node.call("GET", "/v1.41/version?x=1")
        assert 200 == reply.status
        assert "20.10.24-fake" == json.loads(reply.body)["Version"]
        [seen] = node.fake.requests_to("GET", "/version$")
        assert "/v1.41/version?x=1" == seen.target
        assert ("Host", "docker") in seen.headers
        assert b"1.41" == dict((k.lower(), v) for k, v in reply.headers)[b"api-version"]

    async def test_keep_alive_serves_several_requests(self, node: DockerNode) -> None:
        """Requests on one client connection are answered in turn."""
        stream = await open_raw(node.proxy_socket)
        async with stream:
            await stream.send_all(
                b"GET /_ping HTTP/1.1\r\nHost: docker\r\n\r\nGET /info HTTP/1.1\r\nHost: docker\r\n\r\n"
            )
            data = await receive_until(
                stream, lambda d: d.count(b"HTTP/1.1 200") == 2 and b"CgroupDriver" in d
            )
        assert 2 == data.count(b"HTTP/1.1 200")
        assert 2 == len(node.fake.requests)

    async def test_streamed_logs_pass_byte_for_byte(self, node: DockerNode) -> None:
        """``logs?follow=1`` streams: lines appended while the client reads arrive as dockerd sent them."""
        ident = await running_container(node)
        lines = [b"first line\n", os.urandom(3000), b"third\n"]
        node.fake.append_log(ident, lines[0])
        stream = await open_raw(node.proxy_socket)
        async with stream:
            await stream.send_all(
                f"GET /v1.41/containers/{ident}/logs?follow=1&stdout=1 HTTP/1.1\r\nHost: docker\r\n\r\n".encode()
            )
            expected = b"".join(multiplex(1, line) for line in lines)

            def feed(received: bytes) -> None:
                if received == multiplex(1, lines[0]):  # the stream is live: feed it more
                    node.fake.append_log(ident, lines[1])
                    node.fake.append_log(ident, lines[2])
                if received == expected:
                    node.fake.state.stop(ident)
                    node.fake._notify()

            head, received = await read_response(stream, feed)
        assert 200 == head.status_code
        assert expected == received

    async def test_events_stream_until_the_client_leaves(self, node: DockerNode) -> None:
        """``/events`` relays events as they happen; when the client leaves, the proxy closes its dockerd
        connection too."""
        stream = await open_raw(node.proxy_socket)
        async with stream:
            await stream.send_all(b"GET /v1.41/events HTTP/1.1\r\nHost: docker\r\n\r\n")
            await wait_until(lambda: len(node.fake.state.listeners) == 1)
            await node.create("watched", {"Image": "busybox"})
            data = await receive_until(stream, lambda d: b'"Action": "create"' in d)
        assert b'"Action": "create"' in data
        await wait_until(lambda: not node.fake.state.listeners)

    async def test_dockerd_down_answers_502(self, nursery: trio.Nursery, sockdir: str) -> None:
        """With nothing listening on dockerd's socket, requests get 502 and the proxy keeps serving."""
        node = await make_node(nursery, sockdir, dockerd=False)
        await node.start_proxy(wait_recovered=False)
        reply = await node.call("GET", "/_ping")
        assert 502 == reply.status
        assert "cannot reach dockerd" in json.loads(reply.body)["message"]
        await node.start_dockerd()
        assert 200 == (await node.call("GET", "/_ping")).status

    async def test_a_grpc_socket_in_place_of_dockerd_is_named(
        self, nursery: trio.Nursery, sockdir: str
    ) -> None:
        """Docker mode pointed at a gRPC runtime (containerd's CRI socket, the endpoint's default):
        the 502 says so and how to fix it. It said only ``bad answer from dockerd: illegal request
        line``. The stand-in answers as grpc-go does: its SETTINGS frame first, then it hangs up."""
        node = await make_node(nursery, sockdir, dockerd=False)
        settings_frame = b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x05\x00\x00\x40\x00"

        async def grpc_like(stream: trio.SocketStream) -> None:
            async with stream:
                await stream.send_all(settings_frame)
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await stream.receive_some(65536)

        listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(_listening(node.docker_socket)))]
        await nursery.start(trio.serve_listeners, grpc_like, listeners)
        await node.start_proxy(wait_recovered=False)
        reply = await node.call("GET", "/_ping")
        message = json.loads(reply.body)["message"]
        assert 502 == reply.status
        assert "the peer speaks HTTP/2 (gRPC), not the Docker API" in message
        assert "--remote-runtime-service-endpoint=unix:///var/run/docker.sock" in message


def _listening(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen()
    return sock


class TestHijack:
    async def exec_id(self, node: DockerNode) -> str:
        ident = await running_container(node)
        reply = await node.call(
            "POST", f"/v1.41/containers/{ident}/exec", {"Cmd": ["cat"], "AttachStdin": True}
        )
        exec_id: str = json.loads(reply.body)["Id"]
        return exec_id

    @pytest.mark.parametrize("upgrade", [True, False], ids=["upgrade-tcp", "raw-stream-200"])
    async def test_exec_session_relays_both_ways(self, node: DockerNode, upgrade: bool) -> None:
        """An exec start that dockerd hijacks (101 after ``Upgrade: tcp``, or 200 raw-stream) becomes a
        byte relay: what the client writes comes back echoed byte for byte, also after the client
        half-closes, and the session ends when dockerd closes."""
        exec_id = await self.exec_id(node)
        body = b'{"Detach":false,"Tty":false}'
        extra = b"Connection: Upgrade\r\nUpgrade: tcp\r\n" if upgrade else b""
        head = (
            (
                f"POST /v1.41/exec/{exec_id}/start HTTP/1.1\r\nHost: docker\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n"
            ).encode()
            + extra
            + b"\r\n"
        )
        payload = os.urandom(200_000) + bytes(range(256))
        stream = await open_raw(node.proxy_socket)
        async with stream:
            await stream.send_all(head + body)
            response = await receive_until(stream, lambda d: b"\r\n\r\n" in d)
            status_line = response.split(b"\r\n")[0]
            assert (b"HTTP/1.1 101 UPGRADED" if upgrade else b"HTTP/1.1 200 OK") == status_line
            assert b"Content-Type: application/vnd.docker.raw-stream" in response
            echoed = response.split(b"\r\n\r\n", 1)[1]
            await stream.send_all(payload[:1000])
            echoed += await receive_until(stream, lambda d: len(echoed) + len(d) >= 1000)
            await stream.send_all(payload[1000:])
            await stream.send_eof()
            echoed += await receive_until(stream, lambda d: False)  # until dockerd ends the session
        assert payload == echoed
        assert payload == b"".join(node.fake.hijacked)


class TestBadInput:
    async def test_garbage_gets_400_and_the_proxy_keeps_serving(self, node: DockerNode) -> None:
        """Bytes that are not HTTP get 400 and the connection is closed; other clients are served."""
        stream = await open_raw(node.proxy_socket)
        async with stream:
            await stream.send_all(b"\x16\x03\x01 hello there\r\n\r\n")
            head, body = await read_response(stream)
        assert 400 == head.status_code
        assert b"bad request" in body
        assert 200 == (await node.call("GET", "/_ping")).status
        assert [] == node.fake.requests[:-1]

    async def test_oversized_head_gets_431(self, node: DockerNode) -> None:
        """A request head beyond the limit is refused with 431 without reaching dockerd."""
        stream = await open_raw(node.proxy_socket)
        async with stream:
            await stream.send_all(
                b"GET /_ping HTTP/1.1\r\nHost: docker\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"
            )
            head, _ = await read_response(stream)
        assert 431 == head.status_code
        assert [] == node.fake.requests

    async def test_invalid_json_on_create_gets_400(self, node: DockerNode) -> None:
        """A kubelet create whose body is not JSON gets 400 and nothing is forwarded."""
        reply = await node.call("POST", f"/containers/create?name={CONTAINER_NAME}", b"{not json")
        assert 400 == reply.status
        assert "invalid JSON" in json.loads(reply.body)["message"]
        assert [] == node.fake.requests
        assert 200 == (await node.call("GET", "/_ping")).status

    @pytest.mark.parametrize(
        "body",
        [b'\xef\xbb\xbf{"Image":"busybox"}', b'{"Image":"busybox","HostConfig":{"Memory":NaN}}'],
        ids=["a byte order mark", "NaN"],
    )
    async def test_a_create_dockerd_refuses_gets_400(self, node: DockerNode, body: bytes) -> None:
        """A create body Go's decoder refuses (dockerd answers 500 "invalid character") and Python's
        would read gets 400 and nothing is forwarded, where a BOM's was read and re-encoded for dockerd."""
        reply = await node.call("POST", f"/containers/create?name={CONTAINER_NAME}", body)
        assert 400 == reply.status
        assert "invalid JSON" in json.loads(reply.body)["message"]
        assert [] == node.fake.requests

    @pytest.mark.parametrize(
        "body",
        [
            b'{"Image":"busybox","HostConfig":{"Memory":1},"HostConfig":{"CpuShares":2}}',
            b'{"Image":"busybox","Labels":{"a":"1"},"Labels":{"b":"2"}}',
            b'{"Image":"busybox","HostConfig":{"CpuShares":2},"hostconfig":{"Memory":1}}',
        ],
        ids=["a key twice", "a map twice", "a field under two spellings"],
    )
    async def test_a_create_dockerd_would_merge_gets_400(self, node: DockerNode, body: bytes) -> None:
        """A create whose body names a key twice, or a field under two spellings, which dockerd reads
        merged (tests/e2e/test_docker_json_reading.py), gets 400 saying so, and nothing is forwarded."""
        reply = await node.call("POST", f"/containers/create?name={CONTAINER_NAME}", body)
        assert 400 == reply.status
        assert "send" in json.loads(reply.body)["message"]
        assert [] == node.fake.requests

    async def test_oversized_create_body_gets_413(self, node: DockerNode) -> None:
        """An intercepted request body beyond the limit gets 413 and nothing is forwarded."""
        size = 9 << 20
        stream = await open_raw(node.proxy_socket)
        async with stream, trio.open_nursery() as nursery:

            async def send_body() -> None:
                with contextlib.suppress(trio.BrokenResourceError):
                    await stream.send_all(b" " * size)

            await stream.send_all(
                f"POST /containers/create?name={CONTAINER_NAME} HTTP/1.1\r\nHost: d\r\nContent-Length: {size}\r\n\r\n".encode()
            )
            nursery.start_soon(send_body)
            head, _ = await read_response(stream)
            nursery.cancel_scope.cancel()
        assert 413 == head.status_code
        assert [] == node.fake.requests

    async def test_client_leaving_mid_request_harms_nothing(self, node: DockerNode) -> None:
        """A client that sends half a request body and goes away leaves the proxy serving."""
        stream = await open_raw(node.proxy_socket)
        async with stream:
            await stream.send_all(
                b"POST /containers/create?name=x HTTP/1.1\r\nHost: d\r\nContent-Length: 100\r\n\r\n{"
            )
        assert 200 == (await node.call("GET", "/_ping")).status


class TestShutdown:
    async def test_shutdown_removes_the_socket(self, node: DockerNode) -> None:
        """A requested shutdown stops the proxy and removes its socket file."""
        await node.stop_proxy()
        with pytest.raises(OSError):
            await request(node.proxy_socket, "GET", "/_ping")

    async def test_draining_refuses_connections_keeps_successors_socket(self, node: DockerNode) -> None:
        """Once draining starts, a new connection is refused at once (not left in the backlog), and a
        socket file another instance put in its place meanwhile is not removed at the end."""
        stream = await open_raw(node.proxy_socket)  # a request in flight holds the drain open
        async with stream:
            await stream.send_all(
                b"POST /containers/create?name=x HTTP/1.1\r\nHost: d\r\nContent-Length: 100\r\n\r\n{"
            )
            await wait_until(lambda: node.proxy.proxy.in_flight == 1)
            node.proxy.request_shutdown()
            await wait_until(lambda: node.proxy.proxy.draining)
            late = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            with late, pytest.raises((ConnectionRefusedError, FileNotFoundError)):
                late.connect(node.proxy_socket)
            await trio.Path(node.proxy_socket).unlink()
            successor = bind_unix_socket(node.proxy_socket)
            try:
                await wait_until(lambda: node.proxy.proxy.in_flight == 0)  # the grace period ended it
                await trio.sleep(0.2)
                assert await trio.Path(node.proxy_socket).exists()
            finally:
                successor.close()
