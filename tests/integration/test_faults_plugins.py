"""Faults of hook plugins, under load: crashing, hanging, garbage and wrong-type answers, a plugin process
killed mid-call, a plugin socket replaced by a new server.

test_hooks_failures.py pins the single-call semantics of each failure; here each trouble hits a burst of
concurrent calls, and afterwards the proxy must still serve, every call must have had the documented
outcome (docs/operations.md: ``Fail`` rejects with UNKNOWN "hook server err: ...", ``Ignore`` goes on without
the plugin's changes) and no fd or task may be left behind.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy.fakes.plugin import (
    GARBAGE,
    Changes,
    FakePlugin,
    Misbehaviour,
    run_fake_plugin,
    write_registration,
)
from krproxy.grpcstatus import Status
from krproxy.hooks.points import HookPoint
from krproxy.proto.runtime import v1alpha1 as hookapi
from tests.integration.faults_support import Processes, Usage, assert_no_leak, processes, version_ok
from tests.integration.hooks_support import HANG_TIMEOUT, PLUGIN_TIMEOUT, Node, container_config, make_node
from tests.integration.support import in_thread, wait_until

CREATE = HookPoint.PRE_CREATE_CONTAINER
BURST = 16

#: A PodSandboxHookResponse where a ContainerResourceHookResponse is expected: a plugin mixing up its
#: answer types. Both are valid protobuf; field numbers overlap with other types and wire types.
WRONG_TYPE = bytes(
    hookapi.PodSandboxHookResponse(
        labels={"l": "v"},
        annotations={"a": "b"},
        cgroup_parent="/kubepods/x",
        resources=hookapi.LinuxContainerResources(cpu_quota=7),
    ).SerializeToString()
)
#: A message whose field 1 is a varint where the response has a map: does not decode.
WRONG_WIRE_TYPE = bytes(hookapi.LinuxContainerResources(cpu_period=5, cpu_quota=3).SerializeToString())

TROUBLES: dict[str, Misbehaviour] = {
    "error": Misbehaviour(status=Status.INTERNAL, message="boom"),
    "crash": Misbehaviour(drop=True),
    "hang": Misbehaviour(hang=True),
    "garbage": Misbehaviour(garbage=GARBAGE),
    "wrong_type": Misbehaviour(garbage=WRONG_TYPE),
    "wrong_wire_type": Misbehaviour(garbage=WRONG_WIRE_TYPE),
}


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


@pytest.fixture
def procs(sockdir: str) -> Iterator[Processes]:
    with processes(sockdir) as started:
        yield started


async def burst(
    node: Node, pod_id: str, count: int = BURST, prefix: str = "c"
) -> tuple[list[grpc.StatusCode | str], list[str]]:
    """``count`` concurrent CreateContainer calls through the proxy: each one's container id or error code,
    and the error details."""
    outcomes: list[grpc.StatusCode | str] = []
    details: list[str] = []

    async def one(i: int) -> None:
        config = api_pb2.ContainerConfig(
            metadata=api_pb2.ContainerMetadata(name=f"{prefix}{i}"),
            image=api_pb2.ImageSpec(image="busybox:1"),
        )
        request = api_pb2.CreateContainerRequest(pod_sandbox_id=pod_id, config=config)
        try:
            reply = await node.call("CreateContainer", request)
        except grpc.RpcError as err:
            outcomes.append(err.code())
            details.append(err.details())
        else:
            outcomes.append(reply.container_id)

    async with trio.open_nursery() as calls:
        for i in range(count):
            calls.start_soon(one, i)
    return outcomes, details


def plugin_argv(node: Node, path: str, *flags: str) -> list[str]:
    """``python -m krproxy.fakes.plugin`` arguments; it registers itself in a directory the proxy does not watch
    (the test writes the registration the proxy reads, with the policy it wants)."""
    hook_dir = os.path.join(node.sockdir, "plugin-hooks")
    return ["-m", "krproxy.fakes.plugin", "--socket", path, "--hook-dir", hook_dir, *flags]


async def warm_up(node: Node, pod_id: str) -> Usage:
    """One hooked call while the plugin behaves (the proxy's plugin channel connects) and a Version call
    on a fresh connection; then the usage to compare with after the trouble."""
    outcomes, _ = await burst(node, pod_id, 1, "warm-up")
    assert [] == [o for o in outcomes if isinstance(o, grpc.StatusCode)]
    assert await in_thread(version_ok, node.proxy_socket)
    return Usage.now()


async def misbehave(node: Node, plugin: FakePlugin, trouble: str, policy: str) -> None:
    """From now on *plugin* fails as *trouble* says; a hang gets the short timeout (meant to fire), set
    only now so that the warm-up call had the long one (the proxy keeps its connection to the plugin)."""
    if trouble == "hang":
        await node.add_plugin(
            "bad", plugin, [CREATE], failure_policy=policy, call_timeout=HANG_TIMEOUT, serve=False
        )
    plugin.misbehave(TROUBLES[trouble])


async def misbehaving_plugin(node: Node, trouble: str, policy: str) -> tuple[FakePlugin, str, Usage]:
    """A plugin "bad" at PreCreateContainer with ``policy``, changing cpu_quota to 1; the proxy and a
    pod; the warm-up; then the plugin fails as ``trouble`` says. The plugin, the pod and the usage
    before the trouble."""
    plugin = FakePlugin(Changes(cpu_quota=1))
    await node.add_plugin("bad", plugin, [CREATE], failure_policy=policy)
    await node.start_proxy()
    pod_id = await node.run_pod()
    before = await warm_up(node, pod_id)
    await misbehave(node, plugin, trouble, policy)
    return plugin, pod_id, before


class TestMisbehavingPlugin:
    @pytest.mark.parametrize("trouble", list(TROUBLES))
    async def test_ignore_policy(self, node: Node, trouble: str) -> None:
        """Ignore: every call of the burst succeeds, none carries the plugin's change; the proxy still
        serves and holds no more fds or tasks than before."""
        plugin, pod_id, before = await misbehaving_plugin(node, trouble, "Ignore")

        outcomes, details = await burst(node, pod_id)

        assert [] == [o for o in outcomes if isinstance(o, grpc.StatusCode)], details
        # A crash cuts every hook call in flight on the connection, so some never reach the plugin.
        assert 1 + BURST >= len(plugin.calls) > 1
        assert [] == [
            r for r in node.received("CreateContainer")[1:] if r.config.linux.resources.cpu_quota == 1
        ]
        assert await in_thread(version_ok, node.proxy_socket)
        await assert_no_leak(before)

    @pytest.mark.parametrize("trouble", list(TROUBLES))
    async def test_fail_policy(self, node: Node, trouble: str) -> None:
        """Fail: every call of the burst is rejected UNKNOWN "hook server err: hook server bad failed
        PreCreateContainer: ..." and nothing reaches the runtime; the proxy still serves, nothing leaks."""
        _, pod_id, before = await misbehaving_plugin(node, trouble, "Fail")

        outcomes, details = await burst(node, pod_id)

        assert [grpc.StatusCode.UNKNOWN] * BURST == outcomes, details
        prefix = "hook server err: hook server bad failed PreCreateContainer: "
        assert [] == [d for d in details if not d.startswith(prefix)]
        assert 1 == len(node.fake.requests("CreateContainer"))  # the warm-up call's
        assert await in_thread(version_ok, node.proxy_socket)
        await assert_no_leak(before)


class TestPluginReplaced:
    async def test_new_server_on_the_same_socket(self, node: Node, procs: Processes) -> None:
        """A plugin process exits and a new one serves the same socket path: the next hooked call reaches
        the new one and carries its change (no restart, no registration change)."""
        path = node.plugin_socket("p")
        write_registration(node.hook_dir, "p", path, [CREATE], failure_policy="Fail", timeout="5s")
        await node.start_proxy()
        pod_id = await node.run_pod()

        first = procs.plugin(plugin_argv(node, path, "--set-cpu-quota=111"), path)
        await node.create_container(pod_id, container_config("one"))
        first.kill()
        procs.plugin(plugin_argv(node, path, "--set-cpu-quota=222"), path)
        await node.create_container(pod_id, container_config("two"))

        assert [111, 222] == [r.config.linux.resources.cpu_quota for r in node.received("CreateContainer")]

    async def test_socket_file_replaced_while_old_server_runs(self, node: Node) -> None:
        """The socket file is unlinked and a new server binds the path while the old one still has the
        proxy's connection open: the proxy's calls go on working (to one of the two; no call fails)."""
        path = node.plugin_socket("p")
        write_registration(node.hook_dir, "p", path, [CREATE], failure_policy="Fail", timeout=PLUGIN_TIMEOUT)
        await node.start_proxy()
        pod_id = await node.run_pod()
        first, second = FakePlugin(Changes(cpu_quota=111)), FakePlugin(Changes(cpu_quota=222))

        async with trio.open_nursery() as serving:
            await serving.start(run_fake_plugin, path, first)
            await node.create_container(pod_id, container_config("one"))
            os.unlink(path)
            await serving.start(run_fake_plugin, path, second)
            outcomes, _ = await burst(node, pod_id, 4)
            serving.cancel_scope.cancel()

        assert [] == [o for o in outcomes if isinstance(o, grpc.StatusCode)]
        assert 5 == len(first.calls) + len(second.calls)


class TestPluginProcessKilled:
    @pytest.mark.parametrize(
        ("policy", "expected"), [("Ignore", grpc.StatusCode.OK), ("Fail", grpc.StatusCode.UNKNOWN)]
    )
    async def test_killed_mid_call(
        self, node: Node, procs: Processes, policy: str, expected: grpc.StatusCode
    ) -> None:
        """A plugin process (``python -m krproxy.fakes.plugin``) SIGKILLed while it holds a hook call: the call
        proceeds unmodified (Ignore) or is rejected UNKNOWN (Fail); later calls see an unreachable plugin
        the same way, until a new process serves the socket again."""
        path = node.plugin_socket("p")
        argv = plugin_argv(node, path, "--set-cpu-quota=5")
        plugin = procs.plugin([*argv, "--delay=30"], path)
        write_registration(node.hook_dir, "p", path, [CREATE], failure_policy=policy, timeout="20s")
        await node.start_proxy()
        pod_id = await node.run_pod()

        async def create(name: str) -> grpc.StatusCode:
            config = api_pb2.ContainerConfig(
                metadata=api_pb2.ContainerMetadata(name=name), image=api_pb2.ImageSpec(image="busybox:1")
            )
            try:
                await node.call(
                    "CreateContainer", api_pb2.CreateContainerRequest(pod_sandbox_id=pod_id, config=config)
                )
            except grpc.RpcError as err:
                return err.code()
            return grpc.StatusCode.OK

        async with trio.open_nursery() as calls:
            result: list[grpc.StatusCode] = []

            async def in_flight() -> None:
                result.append(await create("mid"))

            calls.start_soon(in_flight)
            await wait_until(lambda: 1 == node.proxy.relay.transport.in_flight)
            await trio.sleep(0.3)  # the hook call is at the plugin, which waits 30 s before answering
            plugin.kill()
        after_kill = await create("after")
        procs.plugin(argv, path)
        restarted = await create("restarted")

        assert [expected, expected, grpc.StatusCode.OK] == [*result, after_kill, restarted]
        quotas = [r.config.linux.resources.cpu_quota for r in node.received("CreateContainer")]
        assert 5 == quotas[-1]
        assert 5 not in quotas[:-1]
        assert await in_thread(version_ok, node.proxy_socket)
