"""Header list limits through the proxy: an answer over krproxy's advertised limit ends that call
alone, with the status grpc-go gives, intercepted and relayed calls alike.

The runtime is the fake containerd, served by krproxy's own HTTP/2 core, which honours the
SETTINGS_MAX_HEADER_LIST_SIZE krproxy advertises as grpc-go does: trailers over it are not sent,
the stream is reset with INTERNAL_ERROR (docs/security.md, "Header list limits, per side").
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2, api_pb2_grpc

from krproxy.fakes.containerd import Fault
from krproxy.grpcstatus import Status
from krproxy.h2.connection import ADVERTISED_HEADER_LIST
from tests.integration.faults_support import channel, version_ok
from tests.integration.support import in_thread, start_proxy

#: Trailing metadata whose header list is over what krproxy advertises to the runtime.
OVERSIZED = (("x-echo", "e" * (ADVERTISED_HEADER_LIST + 1)),)


@pytest.mark.parametrize(
    ("method", "request_"),
    [
        pytest.param(
            "StartContainer", api_pb2.StartContainerRequest(container_id="c" * 64), id="intercepted"
        ),
        pytest.param("ExecSync", api_pb2.ExecSyncRequest(container_id="c" * 64, cmd=["true"]), id="relayed"),
    ],
)
async def test_answer_over_the_limit_ends_one_call(
    nursery: trio.Nursery, sockdir: str, fake_containerd: Any, method: str, request_: Any
) -> None:
    """The runtime's answer is over krproxy's header list limit: the runtime resets the stream,
    the caller gets INTERNAL naming the reset (as grpc-go's client does), not UNAVAILABLE, and the
    next call on the same runtime connection is answered."""
    fake, runtime = fake_containerd
    fake.inject(
        method, Fault(status=Status.NOT_FOUND, message="no such container", trailing_metadata=OVERSIZED)
    )
    daemon = await start_proxy(nursery, sockdir, runtime_endpoint=runtime)
    with channel(daemon.config.listen) as ch:
        call = getattr(api_pb2_grpc.RuntimeServiceStub(ch), method)
        with pytest.raises(grpc.RpcError) as failed:
            await in_thread(call, request_, timeout=30)
    assert grpc.StatusCode.INTERNAL == failed.value.code(), failed.value.details()
    assert "reset the stream (INTERNAL_ERROR)" in (failed.value.details() or "")
    assert await in_thread(version_ok, daemon.config.listen)
