"""CRI mode pointed at a backend that speaks HTTP/1 (dockerd): the error says so and what to do."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2 as pb

from krproxy.config import ProxyConfig
from krproxy.daemon import serve
from krproxy.fakes.dockerd import run_fake_dockerd
from krproxy.relay import Relay
from krproxy.relay.rpc import UpstreamError
from tests.integration.support import LIVENESS_LIMIT

HINT = "the peer speaks HTTP/1, not gRPC over HTTP/2; if it is dockerd, run krproxy with --backend-runtime-mode=Docker"


async def test_the_relays_own_call_to_dockerd_names_http1(nursery: trio.Nursery, short_tmp: Path) -> None:
    """A call of the relay's own (store recovery's) to dockerd's socket fails saying HTTP/1 and
    what to do (it used to say only "frame of 4740180 bytes exceeds 16384")."""
    docker = str(short_tmp / "docker.sock")
    await nursery.start(run_fake_dockerd, docker)
    relay = Relay()
    await nursery.start(relay.run)
    route = relay.route_to(docker, f"backend runtime {docker}")
    with trio.fail_after(LIVENESS_LIMIT), pytest.raises(UpstreamError) as raised:
        await relay.transport.call(route, "/runtime.v1.RuntimeService/Version", b"", within=LIVENESS_LIMIT)
    assert HINT in str(raised.value)


async def test_cri_mode_against_dockerd_suggests_docker_mode(
    nursery: trio.Nursery, short_tmp: Path, cri_client: Callable[[str], Any]
) -> None:
    """kubelet's call through krproxy (CRI mode) to dockerd: UNAVAILABLE, with the hint in its details."""
    docker = str(short_tmp / "docker.sock")
    await nursery.start(run_fake_dockerd, docker)
    config = ProxyConfig(listen=str(short_tmp / "p.sock"), runtime_endpoint=docker, hook_dir=str(short_tmp))
    await nursery.start(functools.partial(serve, config, handle_signals=False))
    client = cri_client(config.listen)
    with pytest.raises(grpc.RpcError) as raised:
        await client.call(client.runtime.Version, pb.VersionRequest())
    assert grpc.StatusCode.UNAVAILABLE == raised.value.code()
    assert HINT in raised.value.details()
