"""The benchmark's Go anchor (tests/goproxy, a grpc-go raw-forwarding proxy) forwards what it is
measured forwarding: the bench compares krproxy's cost with this program's, which means nothing
if the program answers differently from the runtime behind it.

Built by ``scripts/install-go-client --offline --program goproxy`` from the packages that
``scripts/install-go-client`` unpacked; skipped with the script's reason where they are absent.
Run against the fake containerd as separate processes, called with grpcio.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from krproxy.bench._support import Processes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def goproxy() -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "install-go-client"), "--offline", "--program", "goproxy"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        pytest.skip(f"no grpc-go proxy: {done.stdout.strip() or done.stderr.strip()}")
    return done.stdout.strip()


@pytest.fixture
def sockets(goproxy: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(the fake containerd's socket, the Go proxy's socket in front of it)."""
    procs = Processes(str(tmp_path))
    runtime, proxied = str(tmp_path / "containerd.sock"), str(tmp_path / "goproxy.sock")
    try:
        procs.start("containerd", ["-m", "krproxy.fakes.containerd", "--socket", runtime], runtime)
        procs.start("goproxy", [goproxy, "-listen", proxied, "-backend", runtime], proxied, python=False)
        yield runtime, proxied
    finally:
        procs.stop()


def _call(socket: str, path: str, request: bytes) -> tuple[grpc.StatusCode, bytes | str]:
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        try:
            return grpc.StatusCode.OK, channel.unary_unary(path)(request, timeout=10)
        except grpc.RpcError as err:
            return err.code(), err.details()


def test_answers_and_errors_are_the_runtimes(sockets: tuple[str, str]) -> None:
    runtime, proxied = sockets
    cases = [
        ("/runtime.v1.RuntimeService/Version", pb.VersionRequest(version="v1").SerializeToString()),
        ("/runtime.v1.RuntimeService/ListContainers", pb.ListContainersRequest().SerializeToString()),
        (
            "/runtime.v1.RuntimeService/ContainerStatus",
            pb.ContainerStatusRequest(container_id="no-such-container").SerializeToString(),
        ),
        ("/runtime.v1.NoSuchService/Method", b""),
    ]
    direct = [_call(runtime, path, request) for path, request in cases]
    through = [_call(proxied, path, request) for path, request in cases]
    assert [code for code, _ in direct] == [
        grpc.StatusCode.OK,
        grpc.StatusCode.OK,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNIMPLEMENTED,
    ]
    assert direct == through
