"""The fake containerd over a real unix socket, driven by the independent grpcio CRI client."""

from __future__ import annotations

import functools
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy.fakes.containerd import (
    FakeContainerd,
    Fault,
    run_fake_containerd,
)
from krproxy.grpcstatus import Status
from krproxy.proto.runtime import v1 as cri
from tests.conftest import serve_fake_containerd
from tests.integration.support import LIVENESS_LIMIT, wait_until

FakeFixture = tuple[FakeContainerd, str]
#: ``cri_client`` from tests/conftest.py: socket path -> CriClient (grpcio stubs + ``call``).
CriClient = Any
ClientFactory = Callable[[str], CriClient]


def pod_config(name: str = "web", **labels: str) -> api_pb2.PodSandboxConfig:
    return api_pb2.PodSandboxConfig(
        metadata=api_pb2.PodSandboxMetadata(name=name, uid=f"uid-{name}", namespace="default"),
        labels={"app": name, **labels},
        annotations={"note": "x"},
    )


def container_config(name: str = "app") -> api_pb2.ContainerConfig:
    return api_pb2.ContainerConfig(
        metadata=api_pb2.ContainerMetadata(name=name),
        image=api_pb2.ImageSpec(image="nginx:1.25"),
        labels={"io.kubernetes.container.name": name},
        annotations={"a": "b"},
        linux=api_pb2.LinuxContainerConfig(
            resources=api_pb2.LinuxContainerResources(cpu_shares=512, memory_limit_in_bytes=1 << 28)
        ),
    )


async def run_pod(client: CriClient, name: str = "web") -> str:
    reply = await client.call(
        client.runtime.RunPodSandbox, api_pb2.RunPodSandboxRequest(config=pod_config(name))
    )
    return str(reply.pod_sandbox_id)


async def create_container(client: CriClient, pod_id: str, name: str = "app") -> str:
    reply = await client.call(
        client.runtime.CreateContainer,
        api_pb2.CreateContainerRequest(
            pod_sandbox_id=pod_id, config=container_config(name), sandbox_config=pod_config()
        ),
    )
    return str(reply.container_id)


async def status_code_of(client: CriClient, method: Any, request: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        await client.call(method, request)
    code: grpc.StatusCode = info.value.code()
    return code


class TestPodLifecycle:
    async def test_whole_lifecycle(self, fake_containerd: FakeFixture, cri_client: ClientFactory) -> None:
        """A pod and its container go through every state and are gone at the end."""
        _fake, path = fake_containerd
        client = cri_client(path)
        rt = client.runtime
        pod_id = await run_pod(client)
        ctr_id = await create_container(client, pod_id)
        assert (64, 64) == (len(pod_id), len(ctr_id))

        await client.call(rt.StartContainer, api_pb2.StartContainerRequest(container_id=ctr_id))
        status = (
            await client.call(rt.ContainerStatus, api_pb2.ContainerStatusRequest(container_id=ctr_id))
        ).status
        assert api_pb2.CONTAINER_RUNNING == status.state
        assert 0 < status.created_at < status.started_at
        assert 512 == status.resources.linux.cpu_shares

        exec_reply = await client.call(
            rt.ExecSync, api_pb2.ExecSyncRequest(container_id=ctr_id, cmd=["echo", "hi"], timeout=5)
        )
        assert (0, b"echo hi") == (exec_reply.exit_code, exec_reply.stdout)

        await client.call(rt.StopContainer, api_pb2.StopContainerRequest(container_id=ctr_id, timeout=10))
        status = (
            await client.call(rt.ContainerStatus, api_pb2.ContainerStatusRequest(container_id=ctr_id))
        ).status
        assert (api_pb2.CONTAINER_EXITED, 0, "Completed") == (status.state, status.exit_code, status.reason)
        assert status.started_at < status.finished_at

        await client.call(rt.RemoveContainer, api_pb2.RemoveContainerRequest(container_id=ctr_id))
        await client.call(rt.StopPodSandbox, api_pb2.StopPodSandboxRequest(pod_sandbox_id=pod_id))
        pod = await client.call(rt.PodSandboxStatus, api_pb2.PodSandboxStatusRequest(pod_sandbox_id=pod_id))
        assert api_pb2.SANDBOX_NOTREADY == pod.status.state
        await client.call(rt.RemovePodSandbox, api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod_id))

        assert [] == list((await client.call(rt.ListPodSandbox, api_pb2.ListPodSandboxRequest())).items)
        assert [] == list((await client.call(rt.ListContainers, api_pb2.ListContainersRequest())).containers)

    async def test_list_filters(self, fake_containerd: FakeFixture, cri_client: ClientFactory) -> None:
        """ListContainers and ListPodSandbox honour id prefix, state, pod and label filters."""
        _fake, path = fake_containerd
        client = cri_client(path)
        rt = client.runtime
        web, db = await run_pod(client, "web"), await run_pod(client, "db")
        web_ctr = await create_container(client, web)
        db_ctr = await create_container(client, db)
        await client.call(rt.StartContainer, api_pb2.StartContainerRequest(container_id=db_ctr))

        async def containers(**kw: Any) -> list[str]:
            reply = await client.call(
                rt.ListContainers, api_pb2.ListContainersRequest(filter=api_pb2.ContainerFilter(**kw))
            )
            return [c.id for c in reply.containers]

        assert [web_ctr] == await containers(id=web_ctr[:12])
        assert [db_ctr] == await containers(
            state=api_pb2.ContainerStateValue(state=api_pb2.CONTAINER_RUNNING)
        )
        assert [web_ctr] == await containers(pod_sandbox_id=web)
        assert sorted([web_ctr, db_ctr]) == sorted(
            await containers(label_selector={"io.kubernetes.container.name": "app"})
        )
        assert [] == await containers(id="nope")

        reply = await client.call(
            rt.ListPodSandbox,
            api_pb2.ListPodSandboxRequest(filter=api_pb2.PodSandboxFilter(label_selector={"app": "db"})),
        )
        assert [db] == [p.id for p in reply.items]

    async def test_version_and_status(self, fake_containerd: FakeFixture, cri_client: ClientFactory) -> None:
        """Version names containerd and Status reports both conditions ready."""
        _fake, path = fake_containerd
        client = cri_client(path)
        version = await client.call(client.runtime.Version, api_pb2.VersionRequest(version="v1"))
        status = await client.call(client.runtime.Status, api_pb2.StatusRequest())
        assert ("containerd", "v1") == (version.runtime_name, version.runtime_api_version)
        assert {("RuntimeReady", True), ("NetworkReady", True)} == {
            (c.type, c.status) for c in status.status.conditions
        }

    async def test_images(self, fake_containerd: FakeFixture, cri_client: ClientFactory) -> None:
        """Pulled images are listed and found; a missing one is an empty status and removes fine."""
        _fake, path = fake_containerd
        client = cri_client(path)
        img = client.image
        pulled = await client.call(
            img.PullImage, api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image="busybox"))
        )
        status = await client.call(
            img.ImageStatus, api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image="busybox"))
        )
        listed = await client.call(img.ListImages, api_pb2.ListImagesRequest())
        missing = await client.call(
            img.ImageStatus, api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image="nope"))
        )
        await client.call(img.RemoveImage, api_pb2.RemoveImageRequest(image=api_pb2.ImageSpec(image="nope")))
        fs = await client.call(img.ImageFsInfo, api_pb2.ImageFsInfoRequest())

        assert pulled.image_ref == status.image.id
        assert ["docker.io/library/busybox:latest"] == list(status.image.repo_tags)
        assert [pulled.image_ref] == [i.id for i in listed.images]
        assert not missing.HasField("image")
        assert status.image.size == fs.image_filesystems[0].used_bytes.value

    async def test_seeded_list_is_large(
        self, fake_containerd: FakeFixture, cri_client: ClientFactory
    ) -> None:
        """1000 seeded containers list as one ~860 KB ListContainers answer."""
        fake, path = fake_containerd
        fake.seed(pods=1000, containers_per_pod=1)
        client = cri_client(path)
        reply = await client.call(client.runtime.ListContainers, api_pb2.ListContainersRequest())
        assert 1000 == len(reply.containers)
        assert 800_000 < reply.ByteSize() < 920_000


class TestEncodedAnswers:
    """The calls a store recovery makes in bulk are answered from encodings kept on the records
    (RuntimeState.ENCODED_CALLS; tests/unit/test_recovery_fake_answers.py checks the bytes)."""

    async def test_served_over_the_socket(
        self, fake_containerd: FakeFixture, cri_client: ClientFactory
    ) -> None:
        """A seeded pod's status reaches a client whole, its containers' statuses included."""
        fake, path = fake_containerd
        [first, second] = fake.seed(1, 2)
        client = cri_client(path)
        [pod_id] = fake.state.sandboxes

        reply = await client.call(
            client.runtime.PodSandboxStatus,
            api_pb2.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=True),
        )

        assert pod_id == reply.status.id
        assert [first, second] == [c.id for c in reply.containers_statuses]
        assert 512 == reply.containers_statuses[0].resources.linux.cpu_shares


class TestErrors:
    async def test_unknown_ids(self, fake_containerd: FakeFixture, cri_client: ClientFactory) -> None:
        """Unknown IDs are NOT_FOUND for status and stop, but removing them succeeds like containerd."""
        _fake, path = fake_containerd
        client = cri_client(path)
        rt = client.runtime
        codes = [
            await status_code_of(
                client, rt.ContainerStatus, api_pb2.ContainerStatusRequest(container_id="x")
            ),
            await status_code_of(client, rt.StopContainer, api_pb2.StopContainerRequest(container_id="x")),
            await status_code_of(
                client, rt.PodSandboxStatus, api_pb2.PodSandboxStatusRequest(pod_sandbox_id="x")
            ),
            await status_code_of(
                client, rt.StopPodSandbox, api_pb2.StopPodSandboxRequest(pod_sandbox_id="x")
            ),
        ]
        await client.call(rt.RemoveContainer, api_pb2.RemoveContainerRequest(container_id="x"))
        await client.call(rt.RemovePodSandbox, api_pb2.RemovePodSandboxRequest(pod_sandbox_id="x"))
        assert [grpc.StatusCode.NOT_FOUND] * 4 == codes

    async def test_not_found_message(self, fake_containerd: FakeFixture, cri_client: ClientFactory) -> None:
        """The NOT_FOUND message reads like containerd's."""
        _fake, path = fake_containerd
        client = cri_client(path)
        with pytest.raises(grpc.RpcError) as info:
            await client.call(
                client.runtime.PodSandboxStatus, api_pb2.PodSandboxStatusRequest(pod_sandbox_id="abc")
            )
        assert 'an error occurred when try to find sandbox "abc": not found' == info.value.details()

    async def test_unknown_method(self, fake_containerd: FakeFixture, cri_client: ClientFactory) -> None:
        """A method path nobody serves answers UNIMPLEMENTED."""
        _fake, path = fake_containerd
        call = cri_client(path).channel.unary_unary(
            "/runtime.v1.RuntimeService/NoSuchMethod",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.RpcError) as info:
            await trio.to_thread.run_sync(functools.partial(call, b"", timeout=10))
        assert grpc.StatusCode.UNIMPLEMENTED == info.value.code()

    async def test_known_but_unimplemented(
        self, fake_containerd: FakeFixture, cri_client: ClientFactory
    ) -> None:
        """A CRI method the fake does not model (Attach) answers UNIMPLEMENTED."""
        _fake, path = fake_containerd
        client = cri_client(path)
        with pytest.raises(grpc.RpcError) as info:
            await client.call(client.runtime.Attach, api_pb2.AttachRequest(container_id="x"))
        # grpc-go's generated answer (UnimplementedRuntimeServiceServer), as containerd sends it
        assert (grpc.StatusCode.UNIMPLEMENTED, "method Attach not implemented") == (
            info.value.code(),
            info.value.details(),
        )


class TestRequestLog:
    async def test_records_decoded_and_raw(
        self, fake_containerd: FakeFixture, cri_client: ClientFactory
    ) -> None:
        """Each request is kept decoded and as the exact bytes the client sent."""
        fake, path = fake_containerd
        client = cri_client(path)
        request = api_pb2.RunPodSandboxRequest(config=pod_config("logged"))
        await client.call(client.runtime.RunPodSandbox, request)
        [recorded] = fake.requests("RunPodSandbox")
        assert request.SerializeToString() == recorded.raw
        message = recorded.message
        assert isinstance(message, cri.RunPodSandboxRequest)
        assert message.config is not None and message.config.metadata is not None
        assert "logged" == message.config.metadata.name


class TestFaults:
    async def test_error_status_once(self, fake_containerd: FakeFixture, cri_client: ClientFactory) -> None:
        """A one-shot fault fails one call with the given status, message and trailer, then clears."""
        fake, path = fake_containerd
        client = cri_client(path)
        fake.inject(
            "Version",
            Fault(
                status=Status.RESOURCE_EXHAUSTED, message="slow down", trailing_metadata=(("x-why", "test"),)
            ),
        )
        future = client.runtime.Version.future(api_pb2.VersionRequest(), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            await trio.to_thread.run_sync(future.result)
        await client.call(client.runtime.Version, api_pb2.VersionRequest())
        assert (grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down") == (info.value.code(), info.value.details())
        assert ("x-why", "test") in tuple(future.trailing_metadata())

    async def test_persistent_fault(self, fake_containerd: FakeFixture, cri_client: ClientFactory) -> None:
        """A fault with times=None keeps failing until cleared, and the state is never touched."""
        fake, path = fake_containerd
        client = cri_client(path)
        fake.inject("RunPodSandbox", Fault(status=Status.UNAVAILABLE, times=None))
        request = api_pb2.RunPodSandboxRequest(config=pod_config())
        codes = [await status_code_of(client, client.runtime.RunPodSandbox, request) for _ in range(3)]
        fake.clear_faults()
        await client.call(client.runtime.RunPodSandbox, request)
        assert [grpc.StatusCode.UNAVAILABLE] * 3 == codes
        assert 1 == len(fake.state.sandboxes)

    async def test_fault_after_call(self, fake_containerd: FakeFixture, cri_client: ClientFactory) -> None:
        """An after_call fault loses the reply although the runtime did the work."""
        fake, path = fake_containerd
        client = cri_client(path)
        fake.inject("RunPodSandbox", Fault(status=Status.INTERNAL, after_call=True))
        code = await status_code_of(
            client, client.runtime.RunPodSandbox, api_pb2.RunPodSandboxRequest(config=pod_config())
        )
        assert (grpc.StatusCode.INTERNAL, 1) == (code, len(fake.state.sandboxes))

    async def test_dropped_connection(self, fake_containerd: FakeFixture, cri_client: ClientFactory) -> None:
        """A dropped connection surfaces as UNAVAILABLE, and the next call reconnects.

        The next call waits until grpcio has seen the connection go: a call made before that
        may be written to the dead socket and fail too ("Stream removed (sendmsg: Broken pipe)",
        seen under load), which is grpcio's race, not the fake's."""
        fake, path = fake_containerd
        client = cri_client(path)
        await client.call(client.runtime.Version, api_pb2.VersionRequest())
        fake.inject("Version", Fault(drop=True))
        code = await status_code_of(client, client.runtime.Version, api_pb2.VersionRequest())
        await trio.to_thread.run_sync(_wait_not_ready, client.channel)
        reply = await client.call(client.runtime.Version, api_pb2.VersionRequest())
        assert (grpc.StatusCode.UNAVAILABLE, "containerd") == (code, reply.runtime_name)

    async def test_delay_uses_trio_clock(
        self, short_tmp: Any, cri_client: ClientFactory, mock_clock: trio.testing.MockClock
    ) -> None:
        """A fault's delay passes in trio's time: a 10 min delay ends when the clock is moved on
        10 min, long before the client's deadline of a few seconds of wall time runs out.

        The clock stands still (rate 0, no autojump) and moves only by the test's jump, once the
        fake holds the whole request: an autojump clock also jumps whenever the trio loop waits for
        the grpcio client thread (connecting, or between the request's HEADERS and its DATA), onto
        the server's deadline timer for the call — DEADLINE_EXCEEDED for a call nothing delayed —
        or onto any other timer the server's connection runs.
        """
        path = str(short_tmp / "containerd.sock")
        async with trio.open_nursery() as nursery:
            # The server would enforce the client's (wall) deadline in trio time: at the jump it
            # would fire before the delay ends.
            fake = await serve_fake_containerd(nursery, path, enforce_deadlines=False)
            fake.inject("Version", Fault(delay=600))
            client = cri_client(path)
            start = trio.current_time()
            future = client.runtime.Version.future(api_pb2.VersionRequest(), timeout=LIVENESS_LIMIT)
            until = time.monotonic() + LIVENESS_LIMIT
            while not fake.requests("Version"):  # the handler is in its delay once it logged the request
                assert time.monotonic() < until, "the fake never received the call"
                await trio.to_thread.run_sync(time.sleep, 0.01)
            assert not future.done()
            mock_clock.jump(600)
            reply = await trio.to_thread.run_sync(future.result)
            assert ("containerd", 600) == (reply.runtime_name, trio.current_time() - start)
            nursery.cancel_scope.cancel()


class TestEvents:
    async def test_lifecycle_events(self, fake_containerd: FakeFixture, cri_client: ClientFactory) -> None:
        """Every subscriber receives CREATED, STARTED, STOPPED and DELETED for a container."""
        fake, path = fake_containerd
        client = cri_client(path)
        pod_id = await run_pod(client)
        events: queue.Queue[Any] = queue.Queue()
        stream = client.runtime.GetContainerEvents(api_pb2.GetEventsRequest(), timeout=30)

        def read() -> None:
            try:
                for event in stream:
                    events.put(event)
            except grpc.RpcError:
                pass

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        await wait_until(lambda: fake.event_subscribers > 0)
        ctr_id = await create_container(client, pod_id)
        await client.call(client.runtime.StartContainer, api_pb2.StartContainerRequest(container_id=ctr_id))
        fake.exit_container(ctr_id, 137, "OOMKilled")
        await client.call(client.runtime.RemoveContainer, api_pb2.RemoveContainerRequest(container_id=ctr_id))

        received = [
            await trio.to_thread.run_sync(functools.partial(events.get, timeout=10)) for _ in range(4)
        ]
        stream.cancel()
        await trio.to_thread.run_sync(reader.join, 10)
        assert [
            api_pb2.CONTAINER_CREATED_EVENT,
            api_pb2.CONTAINER_STARTED_EVENT,
            api_pb2.CONTAINER_STOPPED_EVENT,
            api_pb2.CONTAINER_DELETED_EVENT,
        ] == [e.container_event_type for e in received]
        assert {ctr_id} == {e.container_id for e in received}
        assert {pod_id} == {e.pod_sandbox_status.id for e in received}
        stopped = received[2].containers_statuses[0]
        assert (137, "OOMKilled") == (stopped.exit_code, stopped.reason)


class TestSocket:
    async def test_socket_removed_on_shutdown(self, short_tmp: Any) -> None:
        """Cancelling the fake removes its socket file."""
        path = str(short_tmp / "c.sock")
        async with trio.open_nursery() as nursery:
            await nursery.start(run_fake_containerd, path)
            existed = await trio.Path(path).exists()
            nursery.cancel_scope.cancel()
        assert (True, False) == (existed, await trio.Path(path).exists())


class TestCli:
    async def test_serves_until_sigint(self, short_tmp: Any, cri_client: ClientFactory) -> None:
        """``python -m krproxy.fakes.containerd`` serves seeded pods, exits 0 on SIGINT and removes its socket."""
        path = str(short_tmp / "cli.sock")
        argv = [
            sys.executable,
            "-m",
            "krproxy.fakes.containerd",
            "--socket",
            path,
            "--seed-pods",
            "2",
            "--log-level",
            "WARNING",
        ]
        proc = await trio.lowlevel.open_process(argv)
        try:
            await wait_until(lambda: os.path.exists(path))  # the process has started
            client = cri_client(path)
            reply = await client.call(client.runtime.ListContainers, api_pb2.ListContainersRequest())
            proc.send_signal(signal.SIGINT)
            with trio.fail_after(LIVENESS_LIMIT):
                rc = await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert (2, 0, False) == (len(reply.containers), rc, await trio.Path(path).exists())


def _wait_not_ready(channel: grpc.Channel) -> None:
    """Block until ``channel`` reports a state other than READY (its connection is gone)."""
    left = threading.Event()

    def seen(state: grpc.ChannelConnectivity) -> None:
        if state is not grpc.ChannelConnectivity.READY:
            left.set()

    channel.subscribe(seen)
    try:
        assert left.wait(LIVENESS_LIMIT), "grpcio never saw the dropped connection"
    finally:
        channel.unsubscribe(seen)
