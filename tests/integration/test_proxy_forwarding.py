"""The transparent proxy: every call reaches the backend and comes back unchanged.

Clients are grpcio (an independent gRPC implementation) sending raw bytes, so what is
compared is exactly what crossed the wire.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable

import grpc
import pytest
import trio

from krproxy import rpc
from krproxy.daemon import Daemon
from krproxy.forward import known_routes
from krproxy.grpcstatus import Cardinality, Status
from tests.integration.support import (
    LIVENESS_LIMIT,
    ScriptedBackend,
    hang,
    in_thread,
    raw_unary,
    start_proxy,
    start_scripted_backend,
    wait_until,
)

# A VersionRequest (field 1 = "v1") followed by a field number krproxy's protos lack (99),
# which a decoding proxy could drop or reorder.
REQUEST_WITH_UNKNOWN_FIELD = b"\x0a\x02v1" + b"\x9a\x06\x05extra"
VERSION = "/runtime.v1.RuntimeService/Version"


def only_unknown_fields(path: str) -> bytes:
    """A valid protobuf message, distinct per path, made only of field numbers no CRI request uses."""
    text = path.encode()
    return b"\xfa\x3e" + bytes([len(text)]) + text  # field 1007, length-delimited


#: The hooked methods whose request, naming no id, krproxy refuses as containerd does.
EMPTY_ID_REFUSED = {
    "CreateContainer",
    "StartContainer",
    "StopContainer",
    "StopPodSandbox",
    "UpdateContainerResources",
    "UpdatePodSandboxResources",
}


class TestForwarding:
    async def test_bytes_identical_both_ways(
        self, scripted_backend: ScriptedBackend, proxy: Daemon, channel_to: Callable[[str], grpc.Channel]
    ) -> None:
        """A request with unknown fields reaches the backend byte for byte, and so does the reply."""
        reply_bytes = b"\x0a\x071.2.3-x" + b"\xa2\x06\x03abc"

        async def reply(stream: rpc.Stream, messages: list[bytes]) -> None:
            await stream.send_message(reply_bytes)

        scripted_backend.behaviours[VERSION] = reply
        call = raw_unary(channel_to(proxy.config.listen), VERSION)
        answer = await in_thread(call, REQUEST_WITH_UNKNOWN_FIELD, timeout=10)
        assert reply_bytes == answer
        assert [[REQUEST_WITH_UNKNOWN_FIELD]] == scripted_backend.messages_for(VERSION)

    async def test_every_known_method_forwarded(
        self, scripted_backend: ScriptedBackend, proxy: Daemon, channel_to: Callable[[str], grpc.Channel]
    ) -> None:
        """All RuntimeService and ImageService methods reach the backend on their own path, unchanged,
        including the ones that carry hook points (no plugin is registered) — but for the hooked ones
        whose request names no id at all (only unknown fields here): krproxy refuses those as containerd
        does, UNKNOWN "prefix can't be empty", before any hook or forward (docs/hooks.md, ids)."""
        channel = channel_to(proxy.config.listen)
        routes = known_routes()
        assert 43 == len(routes)
        refused = set()
        for path, cardinality in routes.items():
            payload = only_unknown_fields(path)
            if cardinality is Cardinality.UNARY_STREAM:
                call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
                answer = await in_thread(lambda c=call, p=payload: list(c(p, timeout=10)))
                assert [payload] == answer, path
            else:
                try:
                    assert payload == await in_thread(raw_unary(channel, path), payload, timeout=10), path
                except grpc.RpcError as err:
                    assert (grpc.StatusCode.UNKNOWN, True) == (err.code(), "can't be empty" in err.details())
                    assert [] == scripted_backend.messages_for(path), path
                    refused.add(path.rpartition("/")[2])
                    continue
            # exactly once (recovery may also have listed pods and containers, with empty requests)
            assert 1 == scripted_backend.messages_for(path).count([payload]), path
        assert EMPTY_ID_REFUSED == refused

    async def test_unknown_method_forwarded(
        self, scripted_backend: ScriptedBackend, proxy: Daemon, channel_to: Callable[[str], grpc.Channel]
    ) -> None:
        """A method path our protos lack (a newer kubelet's RPC) still reaches the backend."""
        path = "/runtime.v1.RuntimeService/SomethingFromTheFuture"
        answer = await in_thread(raw_unary(channel_to(proxy.config.listen), path), b"\x08\x01", timeout=10)
        assert b"\x08\x01" == answer
        assert [[b"\x08\x01"]] == scripted_backend.messages_for(path)

    async def test_request_metadata_and_deadline_passed_on(
        self, scripted_backend: ScriptedBackend, proxy: Daemon, channel_to: Callable[[str], grpc.Channel]
    ) -> None:
        """Caller metadata (text and -bin) arrives at the backend, and so does the caller's deadline."""
        call = raw_unary(channel_to(proxy.config.listen), VERSION)
        await in_thread(call, b"", timeout=30, metadata=[("x-trace", "abc"), ("x-blob-bin", b"\x00\xff")])
        (received,) = [r for r in scripted_backend.received if r.path == VERSION]
        assert "abc" == received.metadata["x-trace"]
        assert b"\x00\xff" == received.metadata["x-blob-bin"]
        assert received.timeout is not None
        # The relay passes grpc-timeout on as the caller wrote it; grpcio rounds it up to its unit
        # (e.g. "30100m"), so allow a little over 30 s, and for slow machines below.
        assert 25 < received.timeout <= 30.5


class TestErrors:
    async def test_status_details_and_trailers_relayed(
        self, scripted_backend: ScriptedBackend, proxy: Daemon, channel_to: Callable[[str], grpc.Channel]
    ) -> None:
        """The backend's status code, message, rich details and trailing metadata reach the caller."""

        async def fail(stream: rpc.Stream, messages: list[bytes]) -> None:
            await stream.send_trailing_metadata(
                Status.NOT_FOUND,
                'container "abc" not found',
                details=b"\x08\x05\x12\x03xyz",
                metadata=[(b"x-reason", b"gone")],
            )

        scripted_backend.behaviours["/runtime.v1.RuntimeService/ContainerStatus"] = fail
        call = raw_unary(channel_to(proxy.config.listen), "/runtime.v1.RuntimeService/ContainerStatus")
        with pytest.raises(grpc.RpcError) as info:
            await in_thread(call, b"", timeout=10)
        err = info.value
        assert grpc.StatusCode.NOT_FOUND == err.code()
        assert 'container "abc" not found' == err.details()
        trailers = dict(err.trailing_metadata())
        assert "gone" == trailers["x-reason"]
        assert b"\x08\x05\x12\x03xyz" == trailers["grpc-status-details-bin"]

    async def test_backend_unimplemented_comes_back_unimplemented(
        self, nursery: trio.Nursery, sockdir: str, channel_to: Callable[[str], grpc.Channel]
    ) -> None:
        """A path the backend does not know is answered UNIMPLEMENTED, exactly as the backend said."""
        from tests.integration.support import start_proxy

        await nursery.start(rpc.Server({}).serve, os.path.join(sockdir, "backend.sock"))
        daemon = await start_proxy(nursery, sockdir)
        path = "/runtime.v1.RuntimeService/SomethingFromTheFuture"
        with pytest.raises(grpc.RpcError) as info:
            await in_thread(raw_unary(channel_to(daemon.config.listen), path), b"", timeout=10)
        assert grpc.StatusCode.UNIMPLEMENTED == info.value.code()
        assert f"unknown method {path}" == info.value.details()

    async def test_deadline_expiry(
        self, scripted_backend: ScriptedBackend, proxy: Daemon, channel_to: Callable[[str], grpc.Channel]
    ) -> None:
        """A backend slower than the caller's deadline yields DEADLINE_EXCEEDED, and the backend call is cancelled."""

        scripted_backend.behaviours[VERSION] = hang
        with pytest.raises(grpc.RpcError) as info:
            await in_thread(raw_unary(channel_to(proxy.config.listen), VERSION), b"", timeout=1.0)
        assert grpc.StatusCode.DEADLINE_EXCEEDED == info.value.code()
        await wait_until(lambda: VERSION in scripted_backend.cancelled)

    async def test_deadline_expiry_of_an_intercepted_call(
        self,
        scripted_backend: ScriptedBackend,
        proxy: Daemon,
        channel_to: Callable[[str], grpc.Channel],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """An intercepted call (RemoveContainer) forwarded to a backend slower than the caller's deadline:
        DEADLINE_EXCEEDED, and the backend call is cancelled, by the relay's timer of the caller's call
        alone: the forward opens no cancel scope of its own for the same deadline."""
        remove = "/runtime.v1.RuntimeService/RemoveContainer"
        scopes: list[object] = []  # the paths of the relay's own calls that waited in a scope of their own
        move_on_at = trio.move_on_at

        def counted(deadline: float, **kwargs: bool) -> trio.CancelScope:
            caller = sys._getframe(1)
            if caller.f_code.co_name == "_exchange":
                scopes.append(caller.f_locals["path"])
            return move_on_at(deadline, **kwargs)

        monkeypatch.setattr(trio, "move_on_at", counted)
        scripted_backend.behaviours[remove] = hang
        with pytest.raises(grpc.RpcError) as info:
            await in_thread(raw_unary(channel_to(proxy.config.listen), remove), b"\x0a\x01c", timeout=1.0)
        assert grpc.StatusCode.DEADLINE_EXCEEDED == info.value.code()
        await wait_until(lambda: remove in scripted_backend.cancelled)
        assert [remove] == scripted_backend.started[-1:]
        assert remove not in scopes

    async def test_cancelled_caller_cancels_backend_call(
        self, scripted_backend: ScriptedBackend, proxy: Daemon, channel_to: Callable[[str], grpc.Channel]
    ) -> None:
        """When the caller cancels, the proxy cancels its call to the backend."""
        scripted_backend.behaviours[VERSION] = hang
        future = raw_unary(channel_to(proxy.config.listen), VERSION).future(b"", timeout=60)
        await wait_until(lambda: VERSION in scripted_backend.started)
        future.cancel()
        await wait_until(lambda: VERSION in scripted_backend.cancelled)
        assert [VERSION] == scripted_backend.cancelled


class TestBackendAvailability:
    async def test_starts_without_backend_and_recovers(
        self, nursery: trio.Nursery, sockdir: str, channel_to: Callable[[str], grpc.Channel]
    ) -> None:
        """With no backend the proxy still listens and answers UNAVAILABLE naming the socket; once the
        backend appears, calls succeed without a restart."""
        from tests.integration.support import start_proxy

        daemon = await start_proxy(nursery, sockdir)
        call = raw_unary(channel_to(daemon.config.listen), VERSION)
        with pytest.raises(grpc.RpcError) as info:
            await in_thread(call, b"x", timeout=10)
        assert grpc.StatusCode.UNAVAILABLE == info.value.code()
        assert daemon.config.runtime_endpoint in (info.value.details() or "")
        await start_scripted_backend(nursery, daemon.config.runtime_endpoint)
        assert b"x" == await in_thread(call, b"x", timeout=10)

    async def test_backend_killed_and_restarted(
        self, nursery: trio.Nursery, sockdir: str, channel_to: Callable[[str], grpc.Channel]
    ) -> None:
        """A backend SIGKILLed mid-call fails that call with UNAVAILABLE; once it is back, calls work again."""
        daemon = await start_proxy(nursery, sockdir)
        call = raw_unary(channel_to(daemon.config.listen), VERSION)

        async def start_backend() -> trio.Process:
            script = os.path.join(os.path.dirname(__file__), "echo_backend.py")
            process = await trio.lowlevel.open_process(
                [sys.executable, script, daemon.config.runtime_endpoint]
            )
            with trio.fail_after(LIVENESS_LIMIT):
                while True:
                    try:
                        await in_thread(call, b"ping", timeout=5)
                        return process
                    except grpc.RpcError:
                        await trio.sleep(0.05)

        process = await start_backend()
        try:
            in_flight = call.future(b"hang", timeout=30)
            await wait_until(lambda: 1 == daemon.relay.transport.in_flight)  # the relay has it
            await trio.sleep(0.3)  # and has sent it on
            process.kill()
            await process.wait()
            with pytest.raises(grpc.RpcError) as info:
                await in_thread(in_flight.result)
            assert grpc.StatusCode.UNAVAILABLE == info.value.code()
            assert daemon.config.runtime_endpoint in (info.value.details() or "")
            process = await start_backend()
            assert b"again" == await in_thread(call, b"again", timeout=10)
        finally:
            process.kill()
            await process.wait()

    async def test_socket_mode_and_stale_socket(self, nursery: trio.Nursery, sockdir: str) -> None:
        """A stale socket file is replaced, and the new socket has mode 0660."""
        import socket

        from tests.integration.support import start_proxy

        listen = os.path.join(sockdir, "proxy.sock")
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(listen)
        stale.close()  # the file stays, nobody listens: what a crash leaves behind
        daemon = await start_proxy(nursery, sockdir)
        assert 0o660 == stat.S_IMODE(os.stat(daemon.config.listen).st_mode)

    async def test_live_socket_refused(self, nursery: trio.Nursery, sockdir: str) -> None:
        """A socket another process listens on is an error, not a silent takeover."""
        from krproxy.unixsock import SocketInUseError
        from tests.integration.support import start_proxy

        await start_proxy(nursery, sockdir)
        with pytest.raises(SocketInUseError):
            await start_proxy(nursery, sockdir)
