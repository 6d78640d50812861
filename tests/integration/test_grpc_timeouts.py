"""The grpc-timeout krproxy writes on its own calls is one grpc-go accepts, for every deadline (issue 15).

krproxy forwards the 8 intercepted CRI methods, and calls plugins, through calls of its own, with a
``grpc-timeout`` it writes itself. Until d1b6bf2 it wrote microseconds with no digit limit, and
grpc-go (containerd, koordlet) resets a stream whose value has more than 8 digits: any deadline of
100 s or more (kubelet's are 2 and 4 min) failed every pod. Here the proxy runs in front of the
fake containerd and a fake plugin, both as strict as grpc-go (:mod:`krproxy.fakes.strict`), and each
method is called with deadlines from 1 ms to 10 h; the plugin is registered with timeouts from 1
ms to the 5 min maximum and failure policy Fail, so a refused plugin call fails the CRI call.

The trio clock is stopped (MockClock rate 0) while the calls run: a 1 ms deadline must not expire
on a busy machine, and the deadline left when the proxy forwards is then exactly the caller's, so
the header the peer got can be checked tightly. The fake containerd checks each ``grpc-timeout``
but does not enforce it here (a deadline enforced in trio time would fire at a clock jump). The caller is a raw HTTP/2 client that writes
``grpc-timeout`` as grpc-go does and has no timers of its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing
from cri_api.v1 import api_pb2

from krproxy.fakes.containerd import (
    FakeContainerd,
)
from krproxy.fakes.plugin import FakePlugin
from krproxy.fakes.strict import Headers, timeout_error
from krproxy.hooks.points import HookPoint
from krproxy.hooks.registration import MAX_TIMEOUT
from krproxy.relay.rpc import encode_grpc_timeout, grpc_timeout
from tests.conftest import CriClient, serve_fake_containerd
from tests.integration.h2_client import framed, grpc_request, request
from tests.integration.hooks_support import LIFECYCLE_HOOKS, Node, container_config, pod_config

RUNTIME = "/runtime.v1.RuntimeService/"

#: Caller deadlines in seconds: 1 ms to 10 h, around the 8-digit limit of each unit (the old
#: microsecond encoding broke from 100 s on), and kubelet's defaults.
DEADLINES = [0.001, 0.0123, 0.1, 1.0, 99.999999, 100.0, 120.0, 240.0, 3600.0, 36000.0]


def _timeout_of(headers: Headers) -> str:
    values = [value for name, value in headers if name == "grpc-timeout"]
    assert len(values) == 1, headers
    return values[0]


def _assert_carries(headers: Headers, seconds: float, who: str) -> None:
    """``headers`` carry a grpc-timeout grpc-go accepts, for no less than ``seconds`` and not much more."""
    value = _timeout_of(headers)
    assert timeout_error(value) is None, (who, value)
    got = grpc_timeout(value.encode())
    assert got is not None, (who, value)
    assert seconds - 1e-9 <= got <= seconds * (1 + 1e-5) + 1e-9, (who, value, seconds)


class _Caller:
    """Makes CRI calls through the proxy with a given deadline, as kubelet's grpc-go does."""

    def __init__(self, node: Node, deadline: float) -> None:
        self.node = node
        self.deadline = deadline

    async def __call__(self, method: str, message: Any, reply_type: Any) -> Any:
        answer = await request(
            self.node.proxy_socket,
            grpc_request(RUNTIME + method, self.deadline),
            framed(message.SerializeToString()),
        )
        assert (None, 0) == (answer.reset, answer.grpc_status), (method, answer.grpc_message, answer)
        return reply_type.FromString(answer.message)


async def _lifecycle(call: _Caller) -> list[str]:
    """The 8 intercepted methods, in a pod's life; returns the methods called."""
    pod = (
        await call(
            "RunPodSandbox",
            api_pb2.RunPodSandboxRequest(config=pod_config(), runtime_handler="runc"),
            api_pb2.RunPodSandboxResponse,
        )
    ).pod_sandbox_id
    ctr = (
        await call(
            "CreateContainer",
            api_pb2.CreateContainerRequest(
                pod_sandbox_id=pod, config=container_config(), sandbox_config=pod_config()
            ),
            api_pb2.CreateContainerResponse,
        )
    ).container_id
    await call(
        "StartContainer", api_pb2.StartContainerRequest(container_id=ctr), api_pb2.StartContainerResponse
    )
    await call(
        "UpdateContainerResources",
        api_pb2.UpdateContainerResourcesRequest(
            container_id=ctr, linux=api_pb2.LinuxContainerResources(cpu_shares=512, cpu_quota=50_000)
        ),
        api_pb2.UpdateContainerResourcesResponse,
    )
    await call(
        "StopContainer",
        api_pb2.StopContainerRequest(container_id=ctr, timeout=0),
        api_pb2.StopContainerResponse,
    )
    await call(
        "RemoveContainer", api_pb2.RemoveContainerRequest(container_id=ctr), api_pb2.RemoveContainerResponse
    )
    await call(
        "StopPodSandbox", api_pb2.StopPodSandboxRequest(pod_sandbox_id=pod), api_pb2.StopPodSandboxResponse
    )
    await call(
        "RemovePodSandbox",
        api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod),
        api_pb2.RemovePodSandboxResponse,
    )
    return [
        "RunPodSandbox",
        "CreateContainer",
        "StartContainer",
        "UpdateContainerResources",
        "StopContainer",
        "RemoveContainer",
        "StopPodSandbox",
        "RemovePodSandbox",
    ]


async def _settle(done: Callable[[], bool]) -> None:
    """Let the other tasks run until ``done()`` (no clock needed: it is stopped)."""
    for _ in range(10_000):
        if done():
            return
        await trio.lowlevel.checkpoint()
    raise AssertionError("not settled")


@pytest.mark.parametrize("with_plugin", [False, True], ids=["forwards", "forwards-and-plugin"])
@pytest.mark.parametrize("deadline", DEADLINES)
async def test_forwards_and_plugin_calls_carry_a_grpc_go_timeout(
    nursery: trio.Nursery,
    sockdir: str,
    cri_client: Callable[[str], CriClient],
    mock_clock: trio.testing.MockClock,
    deadline: float,
    with_plugin: bool,
) -> None:
    """Without a plugin the forwards alone are shown (a refused plugin call would fail first)."""
    mock_clock.rate = 1  # real time while the proxy starts
    path = os.path.join(sockdir, "containerd.sock")
    fake = await serve_fake_containerd(nursery, path, enforce_deadlines=False)
    node = Node(nursery, sockdir, fake, path, cri_client)
    plugin_timeout = min(deadline, MAX_TIMEOUT)
    plugin = FakePlugin()
    if with_plugin:
        await node.add_plugin("strict", plugin, call_timeout=plugin_timeout, failure_policy="Fail")
    await node.start_proxy()
    fake.clear_requests()

    mock_clock.rate = 0  # stopped: no deadline can pass while the calls run
    methods = await _lifecycle(_Caller(node, deadline))
    if with_plugin:
        await _settle(lambda: len(plugin.calls) >= len(LIFECYCLE_HOOKS))
    mock_clock.rate = 1

    # What the proxy received from the caller: the deadline it forwards (none has passed since).
    sent = grpc_timeout(encode_grpc_timeout(deadline))
    assert sent is not None
    for method in methods:
        received = fake.headers(method)
        assert 1 == len(received), (method, received)
        _assert_carries(received[0], sent, method)
    assert [] == fake.rejected
    if not with_plugin:
        return
    assert LIFECYCLE_HOOKS == plugin.hooks_called()
    assert len(LIFECYCLE_HOOKS) == len(plugin.headers)
    for hook, headers in zip(LIFECYCLE_HOOKS, plugin.headers, strict=True):
        _assert_carries(headers, plugin_timeout, hook.value)
    assert [] == plugin.rejected


async def test_kubelet_s_deadlines_and_a_5_minute_plugin(
    fake_containerd: tuple[FakeContainerd, str],
    nursery: trio.Nursery,
    sockdir: str,
    cri_client: Callable[[str], CriClient],
) -> None:
    """kubelet's defaults (2 min; RunPodSandbox 4 min) from a grpcio client, in real time, and a plugin
    registered with the 5-minute maximum: every call succeeds against the strict fakes, and the
    plugin is given kubelet's remaining deadline, not its own longer timeout."""
    fake, path = fake_containerd
    node = Node(nursery, sockdir, fake, path, cri_client)
    plugin = await node.add_plugin("koordlet-like", FakePlugin(), call_timeout="5m", failure_policy="Fail")
    await node.start_proxy()
    client = node.client
    pod = await client.call(
        client.runtime.RunPodSandbox,
        api_pb2.RunPodSandboxRequest(config=pod_config(), runtime_handler="runc"),
        deadline=240,
    )
    ctr = await client.call(
        client.runtime.CreateContainer,
        node.create_request(pod.pod_sandbox_id),
        deadline=120,
    )
    await client.call(
        client.runtime.StartContainer,
        api_pb2.StartContainerRequest(container_id=ctr.container_id),
        deadline=120,
    )
    assert [HookPoint.PRE_RUN_POD_SANDBOX, HookPoint.PRE_CREATE_CONTAINER, HookPoint.PRE_START_CONTAINER] == (
        plugin.hooks_called()[:3]
    )
    # The plugin's 5 minutes are cut to what is left of kubelet's deadline (4 min for
    # RunPodSandbox, 2 min for the others; grpcio rounds what it sends up, as 241S for 240 s), as
    # koord-runtime-proxy passes kubelet's context on: a plugin is never told to take longer
    # than kubelet waits.
    for hook, headers in zip(plugin.hooks_called(), plugin.headers, strict=True):
        value = _timeout_of(headers)
        seconds = grpc_timeout(value.encode())
        kubelet = 240 if hook is HookPoint.PRE_RUN_POD_SANDBOX else 120
        assert timeout_error(value) is None and seconds is not None, value
        assert kubelet - 10 < seconds <= kubelet * 1.01, (hook, value)
    assert ([], []) == (fake.rejected, plugin.rejected)
    run_pod_timeout = grpc_timeout(_timeout_of(fake.headers("RunPodSandbox")[0]).encode())
    # grpcio (C-core) rounds the timeout it sends up to a few significant digits (241S for 240 s).
    assert run_pod_timeout is not None and 200 < run_pod_timeout <= 245
