"""Failing plugins: error status, timeout, unreachable, crash, garbage answers — under Fail and Ignore.

Fail on a pre hook rejects the CRI call with UNKNOWN naming plugin, hook and cause, and nothing is
forwarded; Ignore forwards the request as if that plugin were not there; post hooks never fail a call.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import grpc
import pytest
import trio

from krproxy import rpc
from krproxy.fakes.plugin import GARBAGE, Changes, FakePlugin, Misbehaviour
from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks.points import HookPoint
from krproxy.proto.runtime import v1 as cri
from krproxy.proto.runtime import v1alpha1
from krproxy.relay.grpc import MAX_STATUS_MESSAGE
from tests.integration.hooks_support import (
    HANG_TIMEOUT,
    PLUGIN_TIMEOUT,
    Node,
    make_node,
    pod_config,
    refused,
    rejection,
)
from tests.integration.support import unary_call

CREATE = HookPoint.PRE_CREATE_CONTAINER
POST_HOOKS = [HookPoint.POST_START_CONTAINER, HookPoint.POST_STOP_CONTAINER, HookPoint.POST_STOP_POD_SANDBOX]

#: The cause of a timeout: the proxy's own deadline fired, or the plugin's server enforced the
#: deadline the proxy sent it (grpc-timeout) first and answered DEADLINE_EXCEEDED.
TIMEOUT_CAUSES = (f"no answer within {HANG_TIMEOUT}", "DEADLINE_EXCEEDED")
_BIG_5MB = {"big": "x" * (5 << 20)}
_BIG_300K = {"big": "x" * (300 << 10)}

#: How to make the plugin fail, and the starts of the cause the proxy may report.
TROUBLES: dict[str, tuple[Misbehaviour | None, tuple[str, ...]]] = {
    "error": (Misbehaviour(status=Status.INTERNAL, message="boom"), ("INTERNAL: boom",)),
    "timeout": (Misbehaviour(hang=True), TIMEOUT_CAUSES),
    # A crash ends the connection; with the proxy's request still unread the kernel resets it. If the
    # proxy happens to write (a SETTINGS ACK) after the crash, the write is what fails.
    "crash": (
        Misbehaviour(drop=True),
        (
            "connection closed by peer",
            "connection reset by peer",
            "send failed: connection closed by peer",
            "send failed: connection reset by peer",
        ),
    ),
    "garbage": (Misbehaviour(garbage=GARBAGE), ("EOFError",)),
    # Decodes without error (betterproto2 ignores wire types) but pod_cgroup_parent comes out an int.
    "loose": (Misbehaviour(garbage=b"\x18\x05"), ("invalid answer: answer has fields of the wrong type",)),
    "unreachable": (None, ("unreachable at ",)),
    # A 5 MB answer: beyond the 4 MiB a plugin may answer (grpc-go's default limit).
    "oversized": (
        Misbehaviour(garbage=bytes(v1alpha1.ContainerResourceHookResponse(container_annotations=_BIG_5MB))),
        ("the answer is larger than 4194304 bytes",),
    ),
    # Within the answer limit, but a value larger than any kubelet sends.
    "value too large": (
        Misbehaviour(garbage=bytes(v1alpha1.ContainerResourceHookResponse(container_annotations=_BIG_300K))),
        ("invalid answer: container_annotations[big] is longer than 262144 characters",),
    ),
}


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


def call_timeout(trouble: str) -> str:
    """The plugin's timeout for *trouble*: short where it is meant to fire (a hang), else the long default."""
    return HANG_TIMEOUT if trouble == "timeout" else PLUGIN_TIMEOUT


async def failing_plugin(node: Node, trouble: str, policy: str, name: str = "bad") -> FakePlugin:
    """A plugin on PreCreateContainer that would raise cpu_quota, but fails as *trouble* says."""
    plugin = FakePlugin(Changes(cpu_quota=1))
    misbehaviour, _ = TROUBLES[trouble]
    if misbehaviour is not None:
        plugin.misbehave(misbehaviour)
    await node.add_plugin(
        name,
        plugin,
        [CREATE],
        failure_policy=policy,
        call_timeout=call_timeout(trouble),
        serve=misbehaviour is not None,
    )
    return plugin


async def create_rejected_by_unserved(node: Node, name: str) -> grpc.RpcError:
    """Plugin ``name`` registered (Fail, at PreCreateContainer) but not served by the harness (the
    test serves its socket itself, or not at all); the proxy, a pod, and the CreateContainer that
    fails: its error."""
    await node.add_plugin(name, hooks=[CREATE], failure_policy="Fail", serve=False)
    await node.start_proxy()
    pod_id = await node.run_pod()
    return await rejection(node, "CreateContainer", node.create_request(pod_id))


@pytest.mark.parametrize("trouble", list(TROUBLES))
class TestPreHookFailure:
    async def test_fail_rejects_and_forwards_nothing(self, node: Node, trouble: str) -> None:
        """Fail: UNKNOWN "hook server err: hook server bad failed PreCreateContainer: <cause>", and the
        runtime never sees the CreateContainer."""
        await failing_plugin(node, trouble, "Fail")
        await node.start_proxy()
        pod_id = await node.run_pod()

        details = await refused(node, "CreateContainer", node.create_request(pod_id), grpc.StatusCode.UNKNOWN)

        prefix = "hook server err: hook server bad failed PreCreateContainer: "
        assert details.startswith(tuple(prefix + c for c in TROUBLES[trouble][1])), details
        assert {} == node.proxy.hooks.store.containers()
        metrics = node.proxy.metrics.registry
        labels = {"plugin": "bad", "hook": "PreCreateContainer", "result": "rejected"}
        assert 1.0 == metrics.get_sample_value("krproxy_hook_calls_total", labels)

    async def test_ignore_forwards_unmodified(self, node: Node, trouble: str) -> None:
        """Ignore: the call goes on, and the runtime gets kubelet's request without that plugin's change."""
        await failing_plugin(node, trouble, "Ignore")
        await node.start_proxy()
        pod_id = await node.run_pod()

        container_id = await node.create_container(pod_id)

        assert [node.create_request(pod_id)] == node.received("CreateContainer")
        assert container_id in node.proxy.hooks.store.containers()
        metrics = node.proxy.metrics.registry
        labels = {"plugin": "bad", "hook": "PreCreateContainer", "result": "failed"}
        assert 1.0 == metrics.get_sample_value("krproxy_hook_calls_total", labels)


class TestRegistrationReading:
    async def test_policy_spelt_otherwise_fails_closed(self, node: Node) -> None:
        """A file whose keys koord-runtime-proxy's Go decoder folds (``Failure-Policy``,
        ``Runtime-Hooks``) registers a Fail plugin, as it does for Go: with its socket unserved, the
        create is refused, where krproxy used to skip the keys and create the container unhooked."""
        path = node.plugin_socket("spelt")
        node.write_file(
            "spelt.json",
            {"Remote-Endpoint": path, "Failure-Policy": "Fail", "Runtime-Hooks": [CREATE.value]},
        )
        await node.start_proxy()
        pod_id = await node.run_pod()

        details = await refused(node, "CreateContainer", node.create_request(pod_id), grpc.StatusCode.UNKNOWN)

        assert f"hook server spelt failed PreCreateContainer: unreachable at {path}" in details

    async def test_endpoint_of_another_scheme_fails_closed(self, node: Node) -> None:
        """A Fail plugin registered at a ``tcp://`` endpoint (no unix socket krproxy can dial) holds the
        create, as koord-runtime-proxy's failed dial does, where krproxy used to refuse the file and
        create the container unhooked; the error says why."""
        node.write_file(
            "tcp.json",
            {
                "remote-endpoint": "tcp://127.0.0.1:9",
                "failure-policy": "Fail",
                "runtime-hooks": [CREATE.value],
            },
        )
        await node.start_proxy()
        pod_id = await node.run_pod()

        details = await refused(node, "CreateContainer", node.create_request(pod_id), grpc.StatusCode.UNKNOWN)

        assert (
            "hook server tcp failed PreCreateContainer: unreachable: remote-endpoint 'tcp://127.0.0.1:9' is not "
            "a unix socket (only unix:// is supported)"
        ) in details


class TestPreHookFailureDetails:
    async def test_stale_socket_file_is_unreachable(self, node: Node) -> None:
        """A socket file nobody listens on (a crashed plugin's) is reported as unreachable."""
        path = node.plugin_socket("stale")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.bind(path)
        error = await create_rejected_by_unserved(node, "stale")

        assert f"hook server stale failed PreCreateContainer: unreachable at {path}" in error.details()
        assert await trio.Path(path).exists()

    async def test_plugin_that_closes_with_our_request_unread_is_reset(self, node: Node) -> None:
        """A plugin that dies with the proxy's bytes unread resets the connection (ECONNRESET):
        reported as what happened, "connection reset by peer", not as an errno string."""
        path = node.plugin_socket("reset")
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await listener.bind(path)
        listener.listen()

        async def accept_then_die() -> None:
            conn, _ = await listener.accept()
            await trio.lowlevel.wait_readable(conn)  # the proxy's preface and request are queued, unread
            await trio.sleep(0.1)
            conn.close()  # closing with unread input makes the kernel reset the peer

        node.nursery.start_soon(accept_then_die)
        error = await create_rejected_by_unserved(node, "reset")

        listener.close()
        assert "hook server reset failed PreCreateContainer: connection reset by peer" in error.details()

    async def test_plugin_that_stops_reading_is_reported_in_words(self, node: Node) -> None:
        """A plugin that stops reading (shutdown SHUT_RD) and then speaks makes the proxy's next write
        fail (EPIPE): reported as "connection closed by peer", like a close seen while reading, not as
        an errno string ("send failed: [Errno 32] Broken pipe")."""
        path = node.plugin_socket("deaf")
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await listener.bind(path)
        listener.listen()
        done = trio.Event()

        async def accept_then_stop_reading() -> None:
            conn, _ = await listener.accept()
            with conn:
                await trio.lowlevel.wait_readable(conn)
                await trio.sleep(0.1)  # the proxy's preface and request have arrived
                await conn.recv(1 << 20)
                conn.shutdown(socket.SHUT_RD)
                await conn.send(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # SETTINGS: the proxy answers an ACK
                await done.wait()

        node.nursery.start_soon(accept_then_stop_reading)
        error = await create_rejected_by_unserved(node, "deaf")

        done.set()
        listener.close()
        assert "hook server deaf failed PreCreateContainer: send failed: connection closed by peer" in (
            error.details()
        )

    async def test_fail_on_pre_start_rejects_start(self, node: Node) -> None:
        """A Fail plugin failing PreStartContainer rejects StartContainer; the runtime never sees it."""
        plugin = FakePlugin()
        plugin.misbehave(
            Misbehaviour(status=Status.UNAVAILABLE, message="busy"), HookPoint.PRE_START_CONTAINER
        )
        await node.add_plugin("p", plugin, failure_policy="Fail")
        await node.start_proxy()
        _, container_id = await node.pod_with_container()

        details = await refused(node, "StartContainer", cri_start(container_id), grpc.StatusCode.UNKNOWN)

        assert "hook server p failed PreStartContainer: UNAVAILABLE: busy" in details
        assert HookPoint.POST_START_CONTAINER not in plugin.hooks_called()

    async def test_a_long_error_message_is_cut_to_reach_kubelet(self, node: Node) -> None:
        """A Fail plugin answering with 20 000 characters of message: the caller still gets UNKNOWN naming
        plugin, hook and cause, cut to fit (grpcio refused the whole status with RESOURCE_EXHAUSTED
        "received metadata size exceeds hard limit" when krproxy sent the message whole)."""
        plugin = FakePlugin()
        plugin.misbehave(Misbehaviour(status=Status.FAILED_PRECONDITION, message="why " * 5000))
        await node.add_plugin("p", plugin, failure_policy="Fail")
        await node.start_proxy()

        details = await refused(node, "RunPodSandbox", cri_run_pod(), grpc.StatusCode.UNKNOWN)

        assert details.startswith(
            "hook server err: hook server p failed PreRunPodSandbox: FAILED_PRECONDITION: why"
        )
        assert details.endswith(" more characters cut by krproxy)"), details[-100:]
        assert len(details) <= MAX_STATUS_MESSAGE

    async def test_fail_stops_the_chain(self, node: Node) -> None:
        """After a Fail plugin failed, later plugins are not called."""
        await failing_plugin(node, "error", "Fail", name="a")
        later = await node.add_plugin("b", hooks=[CREATE])
        await node.start_proxy()
        pod_id = await node.run_pod()

        await rejection(node, "CreateContainer", node.create_request(pod_id))

        assert [] == later.calls

    async def test_ignored_failure_leaves_the_chain_going(self, node: Node) -> None:
        """After an Ignore plugin failed, the next plugin gets the request as it was before it."""
        await failing_plugin(node, "error", "Ignore", name="a")
        later = await node.add_plugin("b", FakePlugin(Changes(cpu_shares=3)), [CREATE])
        await node.start_proxy()
        pod_id = await node.run_pod()

        await node.create_container(pod_id)

        [seen] = later.requests(CREATE)
        assert 2048 == seen.container_resources.cpu_shares
        assert 0 < seen.container_resources.cpu_quota != 1
        [received] = node.received("CreateContainer")
        assert 3 == received.config.linux.resources.cpu_shares

    async def test_plugin_recovers_after_a_failure(self, node: Node) -> None:
        """A failure affects one call only: the plugin's next answer is used again."""
        plugin = FakePlugin(Changes(cpu_quota=1))
        plugin.misbehave(Misbehaviour(drop=True, times=1), CREATE)
        await node.add_plugin("p", plugin, [CREATE], failure_policy="Fail")
        await node.start_proxy()
        pod_id = await node.run_pod()
        await rejection(node, "CreateContainer", node.create_request(pod_id))

        await node.create_container(pod_id)

        [received] = node.received("CreateContainer")
        assert 1 == received.config.linux.resources.cpu_quota


class TestPostHookFailure:
    @pytest.mark.parametrize("trouble", ["error", "timeout", "garbage", "crash"])
    async def test_post_hook_failures_never_fail_the_call(self, node: Node, trouble: str) -> None:
        """Post hooks of a Fail plugin may fail in any way: Start/Stop/StopPodSandbox still succeed."""
        plugin = FakePlugin()
        misbehaviour, _ = TROUBLES[trouble]
        assert misbehaviour is not None
        for point in POST_HOOKS:
            plugin.misbehave(misbehaviour, point)
        # Registered on the post hooks only: the pre hooks it would answer must not meet a hang's timeout.
        await node.add_plugin(
            "p", plugin, POST_HOOKS, failure_policy="Fail", call_timeout=call_timeout(trouble)
        )
        await node.start_proxy()
        pod_id, container_id = await node.pod_with_container()

        await node.start(container_id)
        await node.stop(container_id)
        await node.stop_pod(pod_id)

        assert POST_HOOKS == [h for h in plugin.hooks_called() if h in POST_HOOKS]
        assert 1 == len(node.fake.requests("StopPodSandbox"))

    async def test_unreachable_post_hook_plugin(self, node: Node) -> None:
        """A Fail plugin that is not running at all does not fail post-hook calls."""
        await node.add_plugin("gone", hooks=POST_HOOKS, failure_policy="Fail", serve=False)
        await node.start_proxy()
        pod_id, container_id = await node.pod_with_container()

        await node.start(container_id)
        await node.stop(container_id)
        await node.stop_pod(pod_id)


def cri_start(container_id: str) -> Any:
    from cri_api.v1 import api_pb2

    return api_pb2.StartContainerRequest(container_id=container_id)


def cri_run_pod() -> Any:
    from cri_api.v1 import api_pb2

    return api_pb2.RunPodSandboxRequest(config=pod_config(), runtime_handler="runc")


class TestTimeoutInVirtualTime:
    async def test_hung_plugin_times_out_on_its_own_deadline(self, node: Node, autojump_clock: Any) -> None:
        """With trio's autojump clock a plugin's 60 s timeout passes in no real time: the Fail plugin's
        hang rejects the call after exactly its timeout (virtual), with a client on trio (krproxy.rpc) so
        no real thread waits."""
        plugin = FakePlugin()
        plugin.misbehave(Misbehaviour(hang=True), CREATE)
        await node.add_plugin("slow", plugin, [CREATE], failure_policy="Fail", call_timeout="60s")
        await node.start_proxy()
        async with rpc.Channel(node.proxy_socket) as channel:
            pod = await unary_call(
                channel,
                "/runtime.v1.RuntimeService/RunPodSandbox",
                cri.RunPodSandboxRequest(
                    config=cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="web", uid="u"))
                ),
                cri.RunPodSandboxResponse,
            )
            request = cri.CreateContainerRequest(
                pod_sandbox_id=pod.pod_sandbox_id,
                config=cri.ContainerConfig(metadata=cri.ContainerMetadata(name="app")),
            )
            started, real_started = trio.current_time(), time.monotonic()
            with pytest.raises(GRPCError) as info:
                await unary_call(
                    channel,
                    "/runtime.v1.RuntimeService/CreateContainer",
                    request,
                    cri.CreateContainerResponse,
                )
            elapsed = trio.current_time() - started

        assert Status.UNKNOWN == info.value.status
        # Under the autojump clock the plugin's server-side deadline always fires first: it is the
        # grpc-timeout header the proxy sent, i.e. the remaining time rounded down (to 59999m here).
        # Either way the proxy words it as the plugin's timeout.
        message = info.value.message or ""
        assert message.startswith(
            "hook server err: hook server slow failed PreCreateContainer: no answer within 60s"
        )
        assert 59.99 <= elapsed <= 60.0
        # Far less real time than the timeout (how much less depends on the machine's load).
        assert time.monotonic() - real_started < 30.0
        assert [] == node.fake.requests("CreateContainer")
