"""The fake containerd on the wire as the containerd version it imitates: grpc-go's routing of that
version, and tables that stay bounded over a long run."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy.fakes.containerd import FakeContainerd, RuntimeState, run_fake_containerd
from tests.conftest import CriClient

SLASH_LESS = "runtime.v1.RuntimeService/RunPodSandbox"


def _pod(name: str) -> api_pb2.PodSandboxConfig:
    return api_pb2.PodSandboxConfig(
        metadata=api_pb2.PodSandboxMetadata(name=name, uid=f"uid-{name}", namespace="ns")
    )


def _raw(client: CriClient, path: str, request: bytes, timeout: float = 10) -> tuple[grpc.StatusCode, str]:
    call = client.channel.unary_unary(path, request_serializer=None, response_deserializer=None)
    try:
        call(request, timeout=timeout)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize(
    ("version", "expected", "pods"),
    [
        ("1.6", (grpc.StatusCode.OK, ""), 1),
        ("1.7", (grpc.StatusCode.OK, ""), 1),
        ("2.1", (grpc.StatusCode.UNIMPLEMENTED, f'malformed method name: "{SLASH_LESS}"'), 0),
        ("2.3", (grpc.StatusCode.UNIMPLEMENTED, f'malformed method name: "{SLASH_LESS}"'), 0),
    ],
)
async def test_slash_less_path_routed_as_the_version(
    short_tmp: Path, cri_client: object, version: str, expected: tuple[grpc.StatusCode, str], pods: int
) -> None:
    """RunPodSandbox under ``runtime.v1.RuntimeService/RunPodSandbox`` creates the pod on 1.6 and 1.7
    (grpc-go before 1.79.3) and is refused, unread, on 2.x."""
    path = str(short_tmp / "containerd.sock")
    async with trio.open_nursery() as nursery:
        fake = await nursery.start(run_fake_containerd, path, FakeContainerd(imitate=version))
        client = cri_client(path)  # type: ignore[operator]
        request = api_pb2.RunPodSandboxRequest(config=_pod("web")).SerializeToString()
        answer = await trio.to_thread.run_sync(_raw, client, SLASH_LESS, request)
        assert (expected, pods) == (answer, len(fake.state.sandboxes))
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("version", ["1.6", "2.1"])
async def test_other_path_spellings_are_unimplemented(
    short_tmp: Path, cri_client: object, version: str
) -> None:
    path = str(short_tmp / "containerd.sock")
    spellings = [
        "//runtime.v1.RuntimeService/Version",
        "/runtime.v1.RuntimeService/Version/",
        "/runtime.v1.RuntimeService/Version?x",
        "/runtime.v1.RuntimeService/Versio%6E",
        "/runtime.v1.runtimeservice/Version",
    ]
    async with trio.open_nursery() as nursery:
        await nursery.start(run_fake_containerd, path, FakeContainerd(imitate=version))
        client = cri_client(path)  # type: ignore[operator]
        answers = [await trio.to_thread.run_sync(_raw, client, p, b"") for p in spellings]
        assert [grpc.StatusCode.UNIMPLEMENTED] * len(spellings) == [code for code, _ in answers]
        nursery.cancel_scope.cancel()


def _long_run(client: CriClient, cycles: int, big: bytes) -> None:
    """``cycles`` pod lifecycles (run, create, start, stop, remove: 7 calls each) and one large status
    request per cycle (NOT_FOUND), all from one thread."""
    rt = client.runtime
    for n in range(cycles):
        config = _pod(f"p{n}")
        pod = rt.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=10).pod_sandbox_id
        ctr_config = api_pb2.ContainerConfig(
            metadata=api_pb2.ContainerMetadata(name="c"), image=api_pb2.ImageSpec(image="busybox")
        )
        request = api_pb2.CreateContainerRequest(pod_sandbox_id=pod, config=ctr_config, sandbox_config=config)
        ctr = rt.CreateContainer(request, timeout=10).container_id
        rt.StartContainer(api_pb2.StartContainerRequest(container_id=ctr), timeout=10)
        rt.StopContainer(api_pb2.StopContainerRequest(container_id=ctr, timeout=0), timeout=10)
        rt.RemoveContainer(api_pb2.RemoveContainerRequest(container_id=ctr), timeout=10)
        rt.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=pod), timeout=10)
        rt.RemovePodSandbox(api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod), timeout=10)
        with pytest.raises(grpc.RpcError):
            rt.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=big.decode()), timeout=10)


async def test_tables_stay_bounded_over_a_long_run(short_tmp: Path, cri_client: object) -> None:
    """2,400 calls (300 lifecycles, 300 status requests of 256 KiB): the fake ends holding no record,
    no reserved name, no queued event, and no more logged request bytes than its budget (it kept 100
    requests per method whatever their size: 25 MiB of statuses here)."""
    path = str(short_tmp / "containerd.sock")
    budget = 2 << 20
    fake = FakeContainerd(RuntimeState(), history_bytes=budget)
    async with trio.open_nursery() as nursery:
        await nursery.start(run_fake_containerd, path, fake)
        client = cri_client(path)  # type: ignore[operator]
        await trio.to_thread.run_sync(_long_run, client, 100, b"a" * (256 << 10))
        middle = fake.footprint()
        await trio.to_thread.run_sync(_long_run, client, 200, b"b" * (256 << 10))
        end = fake.footprint()
        nursery.cancel_scope.cancel()
    held = {k: end[k] for k in ("sandboxes", "containers", "reserved_names", "pod_index", "events")}
    assert dict.fromkeys(held, 0) == held
    assert end["request_bytes"] <= budget + (256 << 10) + 1024
    assert middle["requests"] == end["requests"], (middle, end)
