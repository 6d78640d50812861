"""The floor programs of the hook anchor (:mod:`krproxy.bench.floor`) do the socket work they are
measured doing: a CreateContainer through the floor proxy costs one call to the hook server, then
reaches the runtime as it was sent; other calls are forwarded without one; and with no hook server the
floor proxy forwards CreateContainer as is.

The hook anchor compares krproxy's cost with theirs; that means nothing if the floor proxy skipped the
hook call or answered without the runtime. Run as separate processes in front of the fake containerd,
as the bench runs them; the counts are those each program prints when it stops.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from krproxy.bench._support import Processes, _serve_args

CREATE = "PreCreateContainerHook"


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(str(tmp_path))
    try:
        yield procs
    finally:
        procs.stop()


def _start(procs: Processes, tmp_path: Path, *, hook: bool) -> tuple[str, str]:
    """The fake containerd, the floor hook server (if ``hook``) and the floor proxy: (proxy, runtime)."""
    runtime, proxy = str(tmp_path / "containerd.sock"), str(tmp_path / "floor.sock")
    procs.start("containerd", ["-m", "krproxy.fakes.containerd", "--socket", runtime], runtime)
    argv = ["-m", "krproxy.bench.floor", "proxy", "--listen", proxy, "--backend", runtime]
    if hook:
        socket = str(tmp_path / "floorhook.sock")
        hook_dir = str(tmp_path / "hooks")
        procs.start(
            "hook", ["-m", "krproxy.bench.floor", "hook", "--socket", socket, "--hook-dir", hook_dir], socket
        )
        argv += ["--hook", socket]
    procs.start("proxy", argv, proxy)
    return proxy, runtime


def _create(proxy: str, runtime: str) -> tuple[pb.CreateContainerRequest, dict[str, object]]:
    """RunPodSandbox and CreateContainer through ``proxy``: the request sent, and the container's config
    as the runtime keeps it."""
    sandbox = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="web", uid="1", namespace="bench"),
        linux=pb.LinuxPodSandboxConfig(cgroup_parent="/kubepods/bench"),
    )
    with grpc.insecure_channel(f"unix://{proxy}") as channel:
        run = channel.unary_unary("/runtime.v1.RuntimeService/RunPodSandbox")
        pod_id = pb.RunPodSandboxResponse.FromString(
            run(pb.RunPodSandboxRequest(config=sandbox).SerializeToString(), timeout=10)
        ).pod_sandbox_id
        request = pb.CreateContainerRequest(
            pod_sandbox_id=pod_id,
            config=pb.ContainerConfig(
                metadata=pb.ContainerMetadata(name="app"),
                image=pb.ImageSpec(image="docker.io/library/busybox:latest"),
                envs=[pb.KeyValue(key="A", value="1")],
            ),
            sandbox_config=sandbox,
        )
        create = channel.unary_unary("/runtime.v1.RuntimeService/CreateContainer")
        container_id = pb.CreateContainerResponse.FromString(
            create(request.SerializeToString(), timeout=10)
        ).container_id
    with grpc.insecure_channel(f"unix://{runtime}") as channel:
        status = pb.ContainerStatusResponse.FromString(
            channel.unary_unary("/runtime.v1.RuntimeService/ContainerStatus")(
                pb.ContainerStatusRequest(container_id=container_id, verbose=True).SerializeToString(),
                timeout=10,
            )
        )
    config: dict[str, object] = json.loads(status.info["info"])["config"]
    return request, config


def _counts(tmp_path: Path, name: str, prefix: str) -> dict[str, str]:
    """The ``key=value`` counts ``name`` printed as it stopped (the bench's processes are stopped first)."""
    lines = [line for line in (tmp_path / f"{name}.log").read_text().splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, (tmp_path / f"{name}.log").read_text()
    return dict(field.partition("=")[::2] for field in lines[0][len(prefix) :].split())


def _counted(counts: dict[str, str]) -> dict[str, str]:
    """The counts without ``lost=runtime``: said when the runtime, stopped first, closed before the proxy."""
    return {key: value for key, value in counts.items() if key != "lost"}


def test_create_calls_the_hook_then_the_runtime(procs: Processes, tmp_path: Path) -> None:
    """A CreateContainer through the floor proxy makes one PreCreateContainerHook call; the runtime gets
    the request as it was sent; RunPodSandbox goes by without a hook call."""
    _, config = _create(*_start(procs, tmp_path, hook=True))
    assert "app" == config["metadata"]["name"]  # type: ignore[index]
    assert [{"key": "A", "value": "1"}] == config["envs"]
    procs.stop()
    hook = _counts(tmp_path, "hook", "floor hook server stopped:")
    assert {"answered": "1", f"/runtime.v1alpha1.RuntimeHookService/{CREATE}": "1"} == hook
    proxy = _counts(tmp_path, "proxy", "floor proxy stopped:")
    assert {"calls": "2", "hook_calls": "1", "hook_failures": "0"} == _counted(proxy)


def test_no_hook_server_forwards_create_as_is(procs: Processes, tmp_path: Path) -> None:
    """With no hook server the floor proxy forwards CreateContainer without a hook call."""
    _, config = _create(*_start(procs, tmp_path, hook=False))
    assert [{"key": "A", "value": "1"}] == config["envs"]
    procs.stop()
    proxy = _counts(tmp_path, "proxy", "floor proxy stopped:")
    assert {"calls": "2", "hook_calls": "0", "hook_failures": "0"} == _counted(proxy)


def test_registration_is_what_krproxy_hooks_serve_writes(procs: Processes, tmp_path: Path) -> None:
    """The floor hook server registers as krproxy hooks serve does (same JSON, compact), and removes the
    file when it stops."""
    socket = str(tmp_path / "floorhook.sock")
    hook_dir = tmp_path / "hooks"
    procs.start(
        "hook", ["-m", "krproxy.bench.floor", "hook", "--socket", socket, "--hook-dir", str(hook_dir)], socket
    )
    expected = json.dumps(
        {"remote-endpoint": socket, "failure-policy": "Ignore", "runtime-hooks": ["PreCreateContainer"]},
        separators=(",", ":"),
    )
    assert expected == (hook_dir / "floorhook.json").read_text()
    procs.stop()
    assert [] == list(hook_dir.iterdir())


def test_krproxy_calls_the_floor_hook_server(procs: Processes, tmp_path: Path) -> None:
    """krproxy finds the floor hook server by its registration and calls it on CreateContainer."""
    runtime, socket, hook_dir = (
        str(tmp_path / "containerd.sock"),
        str(tmp_path / "h.sock"),
        tmp_path / "hooks",
    )
    procs.start("containerd", ["-m", "krproxy.fakes.containerd", "--socket", runtime], runtime)
    procs.start(
        "hook", ["-m", "krproxy.bench.floor", "hook", "--socket", socket, "--hook-dir", str(hook_dir)], socket
    )
    proxy = str(tmp_path / "krproxy.sock")
    procs.start("krproxy", _serve_args(proxy, runtime, str(hook_dir)), proxy)
    _create(proxy, runtime)
    procs.stop()
    assert "1" == _counts(tmp_path, "hook", "floor hook server stopped:")["answered"]
