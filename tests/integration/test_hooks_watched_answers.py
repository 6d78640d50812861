"""Tests of watched calls (issue 24): a runtime whose answer to a watched call is not one readable reply.

Two messages, none (OK trailers-only), bytes that are not the reply message: the store keeps nothing
(it has no id to keep the pod under), the daemon serves on, and a later good answer is kept. On main
f1593e7 the interceptor refused such answers at once (UNAVAILABLE "the answer is not one uncompressed
gRPC message"); a watched call relays them as they came, and the caller's gRPC library judges them,
as for any passthrough call (grpcio takes no message as an empty reply, and waits for its deadline
after two, whether through the proxy or not).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy import rpc
from tests.integration.hooks_support import Node, pod_config
from tests.integration.support import ScriptedBackend, in_thread, start_scripted_backend

RUN = "/runtime.v1.RuntimeService/RunPodSandbox"
GOOD = api_pb2.RunPodSandboxResponse(pod_sandbox_id="p" * 64).SerializeToString()


async def twice(stream: rpc.Stream, messages: list[bytes]) -> None:
    await stream.send_message(GOOD)
    await stream.send_message(GOOD)


async def nothing(stream: rpc.Stream, messages: list[bytes]) -> None:
    return


async def garbage(stream: rpc.Stream, messages: list[bytes]) -> None:
    await stream.send_message(b"\x0a\xff\xff")  # field 1, a length past the end


async def good(stream: rpc.Stream, messages: list[bytes]) -> None:
    await stream.send_message(GOOD)


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    fake, _ = fake_containerd  # unused: the node's runtime is the scripted one
    return Node(nursery, sockdir, fake, os.path.join(sockdir, "scripted.sock"), cri_client)


@pytest.fixture
async def backend(nursery: trio.Nursery, node: Node) -> ScriptedBackend:
    scripted, _ = await start_scripted_backend(nursery, node.runtime_socket)
    return scripted


class TestUnreadableAnswers:
    @pytest.mark.parametrize("answer", [twice, nothing, garbage])
    async def test_nothing_is_stored_and_the_daemon_serves_on(
        self, node: Node, backend: ScriptedBackend, answer: Any
    ) -> None:
        backend.behaviours[RUN] = answer
        await node.start_proxy()
        request = api_pb2.RunPodSandboxRequest(config=pod_config(), runtime_handler="runc")

        # What the caller gets is its gRPC library's judgement (grpcio: an empty reply for none, its
        # deadline for two; on main, the relay's UNAVAILABLE): not asserted here.
        with contextlib.suppress(grpc.RpcError):
            await in_thread(node.client.runtime.RunPodSandbox, request, timeout=2.0)
        assert {} == node.proxy.hooks.store.pods()

        backend.behaviours[RUN] = good
        assert "p" * 64 == (await node.call("RunPodSandbox", request)).pod_sandbox_id
        assert ["p" * 64] == list(node.proxy.hooks.store.pods())
