"""The benchmark's Go hook-path anchor (tests/gohookproxy in front of the runtime, tests/gohookserver as
its hook server) does the work it is measured doing: a hooked CreateContainer reaches the runtime with
the hook server's change merged, as krproxy merges it, and a call with no hook server unchanged.

The bench (``python -m krproxy.bench --only-hook-anchor``) compares krproxy's cost with these programs';
that means nothing if they skip the hook or send the runtime something else. Built by
``scripts/install-go-client --offline --program gohookproxy|gohookserver``; skipped with the script's
reason where the packages are absent. Run against the fake containerd as separate processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from krproxy.bench._support import Processes, _serve_args

ROOT = Path(__file__).resolve().parents[2]


def _build(program: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "install-go-client"), "--offline", "--program", program],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        pytest.skip(f"no {program}: {done.stdout.strip() or done.stderr.strip()}")
    return done.stdout.strip()


@pytest.fixture(scope="module")
def binaries() -> tuple[str, str]:
    return _build("gohookproxy"), _build("gohookserver")


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(str(tmp_path))
    try:
        yield procs
    finally:
        procs.stop()


def _runtime(procs: Processes, tmp_path: Path) -> str:
    socket = str(tmp_path / "containerd.sock")
    procs.start("containerd", ["-m", "krproxy.fakes.containerd", "--socket", socket], socket)
    return socket


def _go_proxy(procs: Processes, tmp_path: Path, binary: str, runtime: str, hook_dir: Path) -> str:
    socket = str(tmp_path / "gohookproxy.sock")
    argv = [binary, "-listen", socket, "-backend", runtime, "-hook-dir", str(hook_dir)]
    procs.start("gohookproxy", argv, socket, python=False)
    return socket


def _go_hook_server(procs: Processes, tmp_path: Path, binary: str, hook_dir: Path) -> None:
    socket = str(tmp_path / "gohookserver.sock")
    procs.start("gohookserver", [binary, "-socket", socket, "-hook-dir", str(hook_dir)], socket, python=False)


def _create(proxy: str, runtime: str, pod_name: str, uid: str = "1") -> dict[str, Any]:
    """RunPodSandbox and CreateContainer through ``proxy`` (pod ``pod_name``, uid ``uid``); the
    container's config as the runtime keeps it."""
    sandbox = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=pod_name, uid=uid, namespace="bench"),
        annotations={"pod": "a"},
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
                envs=[pb.KeyValue(key="A", value="1"), pb.KeyValue(key="B", value="2")],
                annotations={"c": "1"},
                linux=pb.LinuxContainerConfig(
                    resources=pb.LinuxContainerResources(cpu_shares=512, cpuset_cpus="0")
                ),
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
    config: dict[str, Any] = json.loads(status.info["info"])["config"]
    return config


def _envs(config: dict[str, Any]) -> list[tuple[str, str]]:
    return sorted((kv["key"], kv.get("value", "")) for kv in config.get("envs", []))


def test_go_pair_merges_the_hook_server_s_env(
    binaries: tuple[str, str], procs: Processes, tmp_path: Path
) -> None:
    """Through the Go proxy and the Go hook server the runtime gets BENCH=<pod name> beside the
    request's envs, with its annotations and resources as they were."""
    proxy, server = binaries
    runtime, hook_dir = _runtime(procs, tmp_path), tmp_path / "hooks"
    _go_hook_server(procs, tmp_path, server, hook_dir)
    config = _create(_go_proxy(procs, tmp_path, proxy, runtime, hook_dir), runtime, "web")
    assert [("A", "1"), ("B", "2"), ("BENCH", "web")] == _envs(config)
    assert {"c": "1"} == config["annotations"]
    assert {"cpu_shares": 512, "cpuset_cpus": "0"} == config["linux"]["resources"]


def test_go_proxy_sends_what_krproxy_sends(
    binaries: tuple[str, str], procs: Processes, tmp_path: Path
) -> None:
    """With the same Go hook server, the runtime gets the same container config from the Go proxy as
    from krproxy (envs compared as a set: both rebuild them from a map)."""
    proxy, server = binaries
    runtime, hook_dir = _runtime(procs, tmp_path), tmp_path / "hooks"
    _go_hook_server(procs, tmp_path, server, hook_dir)
    go = _go_proxy(procs, tmp_path, proxy, runtime, hook_dir)
    mine = str(tmp_path / "krproxy.sock")
    procs.start("krproxy", _serve_args(mine, runtime, str(hook_dir)), mine)
    through_go, through_krproxy = _create(go, runtime, "web"), _create(mine, runtime, "web", "2")
    assert ("BENCH", "web") in _envs(through_krproxy)
    assert _envs(through_krproxy) == _envs(through_go)
    for config in (through_go, through_krproxy):
        del config["envs"]
    assert through_krproxy == through_go


def test_no_hook_server_leaves_the_request(
    binaries: tuple[str, str], procs: Processes, tmp_path: Path
) -> None:
    """With no hook server registered, the Go proxy decodes and re-encodes but changes nothing: the
    runtime keeps the config it keeps for a direct call, envs in their order."""
    proxy, _ = binaries
    runtime, hook_dir = _runtime(procs, tmp_path), tmp_path / "hooks"
    hook_dir.mkdir()
    through_go = _create(_go_proxy(procs, tmp_path, proxy, runtime, hook_dir), runtime, "web")
    assert through_go == _create(runtime, runtime, "web", "2")
