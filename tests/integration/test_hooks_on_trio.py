"""Regressions of the move of the hooks from asyncio to trio (each failed before its fix)."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from typing import Any

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy.fakes.containerd.server import Fault
from krproxy.fakes.plugin import FakePlugin
from krproxy.hooks.dispatch import Dispatcher
from krproxy.hooks.model import FrozenMap
from krproxy.hooks.points import HookPoint
from krproxy.hooks.registration import PluginRegistration, Registry
from krproxy.proto.runtime import v1alpha1 as hookapi
from krproxy.relay import Relay
from tests.conftest import CriClient
from tests.integration.hooks_support import Node as HooksNode
from tests.integration.hooks_support import container_config, make_node
from tests.integration.support import in_thread, wait_until
from tests.integration.test_ocihooks_proxy import Node, node, wait_reload

__all__ = ["node"]  # the fixture, shared with test_ocihooks_proxy


START = HookPoint.PRE_START_CONTAINER


async def start_failure(client: CriClient, container_id: str, deadline: float) -> grpc.StatusCode:
    """The status a StartContainer of ``container_id`` through ``client`` with a deadline of
    ``deadline`` seconds (grpcio's timeout, sent as grpc-timeout) fails with (it must fail)."""
    with pytest.raises(grpc.RpcError) as caught:
        await in_thread(
            client.runtime.StartContainer,
            api_pb2.StartContainerRequest(container_id=container_id),
            timeout=deadline,
        )
    return caught.value.code()


class TestCancelledOciHook:
    async def test_start_abandoned_during_a_prestart_hook_is_not_forwarded(
        self, node: Node, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """kubelet gives up while a pre-start OCI hook runs: the proxy still waits for the hook's process
        (bounded by its timeout), but then must not send StartContainer to the runtime (as with asyncio,
        where the cancelled call ended at once)."""
        node.hooks.write("slow.json", {"always": True}, ["prestart"], sleep=1.0)
        await wait_reload(node, 1)
        container_id = await node.create()
        transport = node.daemon.relay.transport  # intercepted calls forward through its unary()
        unary, forwarded = transport.unary, []

        async def spy(route: Any, path: str, *args: Any, **kwargs: Any) -> Any:
            forwarded.append(path.rsplit("/", 1)[-1])
            return await unary(route, path, *args, **kwargs)

        monkeypatch.setattr(transport, "unary", spy)
        assert grpc.StatusCode.DEADLINE_EXCEEDED == await start_failure(node.client, container_id, 0.3)
        # The hook records its label, then sleeps 1 s: it started (however loaded the machine), and 1.5 s
        # later it has ended and the proxy has had its chance to forward.
        await wait_until(lambda: ["slow.json"] == node.hooks.labels())
        await trio.sleep(1.5)
        assert ([], []) == (forwarded, node.started_by_runtime())


@pytest.fixture
async def hooks_node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> HooksNode:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


class TestDeadlineDuringForward:
    async def test_no_post_hook_after_the_callers_deadline(self, hooks_node: HooksNode) -> None:
        """The runtime outlives kubelet's deadline: the call ends DEADLINE_EXCEEDED and, kubelet having
        given up, no post hook runs (the proxy's own timeout of the forward is not a runtime error)."""
        node = hooks_node
        plugin = await node.add_plugin(
            "post", FakePlugin(), [HookPoint.POST_START_CONTAINER], call_timeout="2s"
        )
        await node.start_proxy()
        pod_id = await node.run_pod()
        for attempt in range(8):  # the relay's deadline and the forward's own timeout fire together
            container_id = await node.create_container(pod_id, container_config(f"app{attempt}"))
            node.fake.inject("StartContainer", Fault(delay=2.0))
            assert grpc.StatusCode.DEADLINE_EXCEEDED == await start_failure(node.client, container_id, 0.1)
        await trio.sleep(0.2)
        assert [] == plugin.hooks_called()


class TestDrain:
    async def test_new_connections_are_refused_while_draining(self, hooks_node: HooksNode) -> None:
        """While in-flight calls drain, a new kubelet connection is refused at once (as when the
        listening socket is closed), rather than accepted by the kernel and left unanswered."""
        node = hooks_node
        daemon = await node.start_proxy(grace_period=5.0)
        node.fake.inject("Version", Fault(delay=1.0))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                functools.partial(in_thread, node.client.runtime.Version, api_pb2.VersionRequest())
            )
            await wait_until(lambda: daemon.relay.transport.in_flight == 1)
            daemon.request_shutdown()
            await wait_until(lambda: daemon.relay.transport.draining)
            await trio.sleep(0.05)
            late = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            with late, pytest.raises((ConnectionRefusedError, FileNotFoundError)):
                late.connect(node.proxy_socket)
        # the call in flight was let finish
        assert 1 == len(node.fake.requests("Version"))


class TestPluginBacklogFull:
    async def test_cause_names_the_full_backlog(self, sockdir: str) -> None:
        """A plugin whose listen backlog is full fails its call as unreachable, with a cause that
        says why (the relay's refusal carries no strerror: the cause read "(None)")."""
        path = os.path.join(sockdir, "full.sock")
        with contextlib.ExitStack() as stack:
            server = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            server.bind(path)
            server.listen(0)
            for _ in range(8):  # fill the backlog: nobody accepts
                client = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
                client.setblocking(False)
                try:
                    client.connect(path)
                except BlockingIOError:
                    break
            async with trio.open_nursery() as nursery:
                relay = Relay()
                await nursery.start(relay.run)
                dispatcher = Dispatcher(relay)
                plugin = PluginRegistration("full", "full.json", path, hooks=(START,), timeout=0.5)
                dispatcher.publish(Registry(FrozenMap({"full.json": plugin})))
                chain = await dispatcher.run(
                    START, hookapi.ContainerResourceHookRequest(), lambda record: record, _unused_merge
                )
                nursery.cancel_scope.cancel()
        (outcome,) = chain.outcomes
        assert ("failed", f"unreachable at {path} ({path}: listen backlog full)") == (
            outcome.result,
            outcome.detail,
        )


def _unused_merge(record: Any, answer: Any) -> Any:
    raise AssertionError("the plugin cannot have answered")
