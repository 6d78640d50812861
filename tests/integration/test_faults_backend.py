"""Faults of the runtime behind the proxy: killed mid-call and mid-stream, answering slowly.

The runtime is a fake containerd; where it must die it is a process of its own, SIGKILLed. In every case
the caller gets the status docs/operations.md documents, the proxy keeps serving (Version works once the
runtime is back) and it holds no more fds or tasks than before.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2, api_pb2_grpc

from krproxy.daemon import Daemon
from krproxy.fakes.containerd import Fault
from krproxy.hookserver.testing import logged_events
from tests.integration.faults_support import (
    Processes,
    Usage,
    assert_no_leak,
    channel,
    processes,
    version_ok,
)
from tests.integration.support import in_thread, start_proxy, wait_until


@pytest.fixture
def procs(sockdir: str) -> Iterator[Processes]:
    with processes(sockdir) as started:
        yield started


def pod_request(name: str) -> api_pb2.RunPodSandboxRequest:
    metadata = api_pb2.PodSandboxMetadata(name=name, uid=f"uid-{name}", namespace="default")
    return api_pb2.RunPodSandboxRequest(config=api_pb2.PodSandboxConfig(metadata=metadata))


async def warm_up(listen: str) -> Usage:
    """One call through a throw-away channel (grpcio's own process-wide fds get opened), then the usage."""
    assert await in_thread(version_ok, listen)
    return Usage.now()


class TestBackendKilled:
    async def test_killed_mid_call(self, nursery: trio.Nursery, sockdir: str, procs: Processes) -> None:
        """A call in flight when the runtime is SIGKILLed fails UNAVAILABLE naming the runtime socket;
        while it is down calls fail the same way, fast; once it is back Version works; nothing leaks."""
        runtime = os.path.join(sockdir, "backend.sock")
        backend = procs.containerd(runtime, delays={"Status": 30})
        daemon = await start_proxy(nursery, sockdir)
        before = await warm_up(daemon.config.listen)

        with channel(daemon.config.listen) as ch:
            stub = api_pb2_grpc.RuntimeServiceStub(ch)
            in_flight = stub.Status.future(api_pb2.StatusRequest(), timeout=20)
            await wait_until(lambda: 1 == daemon.relay.transport.in_flight)
            backend.kill()
            with pytest.raises(grpc.RpcError) as killed:
                await in_thread(in_flight.result)
            with pytest.raises(grpc.RpcError) as down:
                await in_thread(stub.Version, api_pb2.VersionRequest(), timeout=5)

        assert grpc.StatusCode.UNAVAILABLE == killed.value.code()
        assert f"backend runtime {runtime} is unavailable" in killed.value.details()
        assert grpc.StatusCode.UNAVAILABLE == down.value.code()
        procs.containerd(runtime)
        assert await in_thread(version_ok, daemon.config.listen)
        await assert_no_leak(before)

    async def test_killed_mid_stream(self, nursery: trio.Nursery, sockdir: str, procs: Processes) -> None:
        """An open GetContainerEvents stream ends UNAVAILABLE when the runtime dies; the proxy keeps
        answering; after the restart a new stream delivers events again."""
        runtime = os.path.join(sockdir, "backend.sock")
        backend = procs.containerd(runtime)
        daemon = await start_proxy(nursery, sockdir)
        before = await warm_up(daemon.config.listen)

        with channel(daemon.config.listen) as ch:
            stub = api_pb2_grpc.RuntimeServiceStub(ch)
            events = stub.GetContainerEvents(api_pb2.GetEventsRequest(), timeout=20)
            await wait_until(lambda: 1 == daemon.relay.transport.in_flight)
            backend.kill()
            with pytest.raises(grpc.RpcError) as ended:
                await in_thread(list, events)
            assert grpc.StatusCode.UNAVAILABLE == ended.value.code()
            assert await wait_in_flight(daemon, 0)

            procs.containerd(runtime)
            events = stub.GetContainerEvents(api_pb2.GetEventsRequest(), timeout=20)
            await wait_until(lambda: 1 == daemon.relay.transport.in_flight)
            pod = await in_thread(stub.RunPodSandbox, pod_request("after"), timeout=5)
            create = api_pb2.CreateContainerRequest(
                pod_sandbox_id=pod.pod_sandbox_id,
                config=api_pb2.ContainerConfig(
                    metadata=api_pb2.ContainerMetadata(name="c"), image=api_pb2.ImageSpec(image="busybox:1")
                ),
            )
            created = await in_thread(stub.CreateContainer, create, timeout=5)
            seen = []
            while created.container_id not in {e.container_id for e in seen}:
                seen.append(await in_thread(next, events))
            events.cancel()

        # The sandbox's own events (created, started) come first, as containerd sends them.
        assert [
            (pod.pod_sandbox_id, api_pb2.CONTAINER_CREATED_EVENT),
            (pod.pod_sandbox_id, api_pb2.CONTAINER_STARTED_EVENT),
            (created.container_id, api_pb2.CONTAINER_CREATED_EVENT),
        ] == [(e.container_id, e.container_event_type) for e in seen]
        assert await in_thread(version_ok, daemon.config.listen)
        await assert_no_leak(before)


async def wait_in_flight(daemon: Daemon, count: int) -> bool:
    await wait_until(lambda: count == daemon.relay.transport.in_flight)
    return True


class TestBackendSlow:
    @pytest.fixture
    async def daemon(self, nursery: trio.Nursery, sockdir: str, fake_containerd: Any) -> Daemon:
        _, runtime = fake_containerd
        return await start_proxy(nursery, sockdir, runtime_endpoint=runtime)

    @pytest.mark.parametrize(
        ("method", "request_", "done"),
        [
            pytest.param("RunPodSandbox", pod_request("slow"), lambda s: s.sandboxes, id="hooked"),
            pytest.param(
                "PullImage",
                api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image="busybox:1")),
                lambda s: s.images,
                id="forwarded",
            ),
        ],
    )
    async def test_beyond_the_deadline(
        self, daemon: Daemon, fake_containerd: Any, method: str, request_: Any, done: Any
    ) -> None:
        """A runtime slower than the caller's deadline: DEADLINE_EXCEEDED, and the runtime call is cancelled
        (the delayed work is never done), for a hooked and a plain forwarded method alike."""
        fake, _ = fake_containerd
        # The call must reach the runtime before the caller's deadline: 1 s (0.3 s was tight under load),
        # and a delay well beyond it.
        fake.inject(method, Fault(delay=4.0, times=None))
        before = await warm_up(daemon.config.listen)

        with channel(daemon.config.listen) as ch:
            stubs = [api_pb2_grpc.RuntimeServiceStub(ch), api_pb2_grpc.ImageServiceStub(ch)]
            call = next(getattr(s, method) for s in stubs if hasattr(s, method))
            with pytest.raises(grpc.RpcError) as info:
                await in_thread(call, request_, timeout=1.0)

        assert grpc.StatusCode.DEADLINE_EXCEEDED == info.value.code()
        await trio.sleep(4.2)  # past the fault's delay: a call still running would have done the work
        assert [] == list(done(fake.state))
        assert 1 == len(fake.requests(method))
        assert await in_thread(version_ok, daemon.config.listen)
        await assert_no_leak(before)

    async def test_within_the_deadline(self, daemon: Daemon, fake_containerd: Any) -> None:
        """A slow runtime that answers within the caller's deadline: the call succeeds."""
        fake, _ = fake_containerd
        fake.inject("RunPodSandbox", Fault(delay=0.3, times=None))
        with channel(daemon.config.listen) as ch:
            stub = api_pb2_grpc.RuntimeServiceStub(ch)
            reply = await in_thread(stub.RunPodSandbox, pod_request("slow"), timeout=30)
        assert [reply.pod_sandbox_id] == list(fake.state.sandboxes)

    async def test_burst_of_expiring_calls(self, daemon: Daemon, fake_containerd: Any) -> None:
        """50 concurrent calls that all outlive their deadline: all DEADLINE_EXCEEDED, then no call is left
        in flight and no fd or task is left behind."""
        fake, _ = fake_containerd
        fake.inject("ListContainers", Fault(delay=5.0, times=None))
        before = await warm_up(daemon.config.listen)
        codes: list[grpc.StatusCode] = []

        with channel(daemon.config.listen) as ch:
            call = functools.partial(
                api_pb2_grpc.RuntimeServiceStub(ch).ListContainers,
                api_pb2.ListContainersRequest(),
                timeout=0.5,
            )

            async def one() -> None:
                try:
                    await in_thread(call)
                except grpc.RpcError as err:
                    codes.append(err.code())

            async with trio.open_nursery() as calls:
                for _ in range(50):
                    calls.start_soon(one)

        assert [grpc.StatusCode.DEADLINE_EXCEEDED] * 50 == codes
        await wait_until(lambda: 0 == daemon.relay.transport.in_flight)
        assert await in_thread(version_ok, daemon.config.listen)
        await assert_no_leak(before)


def _unavailable(listen: str) -> grpc.StatusCode:
    """The status of a Version call on a fresh connection to ``listen`` (blocking; use a thread)."""
    try:
        version_ok(listen)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


class TestBackendDownLogging:
    async def test_an_outage_warns_once_not_per_call(
        self,
        nursery: trio.Nursery,
        sockdir: str,
        procs: Processes,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """While the runtime is down every call fails UNAVAILABLE, but only the first failure logs
        ``backend_unavailable`` at warning level, as operations.md says (once per event, not per
        call); the others at debug. An outage after the runtime was reached again warns again.
        (Every call and every recovery retry used to warn: a line per kubelet call.)"""
        runtime = os.path.join(sockdir, "backend.sock")

        def warnings() -> list[dict[str, Any]]:
            records = [r for r in caplog.records if r.levelno >= logging.WARNING]
            return logged_events(records, "backend_unavailable")

        with caplog.at_level(logging.DEBUG, logger="krproxy.relay"):
            daemon = await start_proxy(nursery, sockdir)  # the runtime is not there yet
            listen = daemon.config.listen
            for _ in range(3):
                assert grpc.StatusCode.UNAVAILABLE == await in_thread(_unavailable, listen)
            assert 1 == len(warnings())
            assert 3 <= len(logged_events(caplog.records, "backend_unavailable"))  # the rest at debug

            backend = procs.containerd(runtime)
            assert await in_thread(version_ok, listen)
            backend.kill()
            for _ in range(3):
                assert grpc.StatusCode.UNAVAILABLE == await in_thread(_unavailable, listen)
            assert 2 == len(warnings())
