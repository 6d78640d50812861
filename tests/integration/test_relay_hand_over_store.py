"""Tests of createlat5's hand-over (a hooked RunPodSandbox or CreateContainer whose forward the relay
takes): the store after it, against the intercepted path (d5d66c5's, where the interceptor awaited its
own forward and kept the record), field for field; failed, dropped, late answers; the deadline left to
the runtime; the call records.

"Intercepted" here is the same daemon with the relay's ``forward`` offering no ``hand_over`` (as an
OCI-hook-wrapped interceptor gets): ``HookRuntime._forward_created`` then awaits the forward and keeps
the record itself, exactly as on d5d66c5.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import attrs
import grpc
import pytest
import trio
from cri_api.v1 import api_pb2

import krproxy.relay.intercepted as local_module
from krproxy.fakes.containerd import Fault
from krproxy.grpcstatus import Status
from krproxy.hooks.points import HookPoint
from krproxy.proto.runtime import v1alpha1 as hookapi
from tests.integration.hooks_support import (
    FAILED_WORK,
    Node,
    container_config,
    hook_resources,
    make_node,
    pod_config,
)
from tests.integration.support import LIVENESS_LIMIT, in_thread, wait_until

CREATES = [HookPoint.PRE_RUN_POD_SANDBOX, HookPoint.PRE_CREATE_CONTAINER]


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


def intercepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on the relay's forward offers no hand_over: the interceptor forwards as on d5d66c5."""
    monkeypatch.setattr(local_module, "CallForward", lambda forward, hand_over: forward)


async def changing_plugin(node: Node) -> Any:
    """A plugin at both creates that changes the pod's annotations, labels and cgroup parent, and the
    container's annotations, envs and resources."""
    plugin = await node.add_plugin("changer", hooks=CREATES)
    plugin.answer(
        HookPoint.PRE_RUN_POD_SANDBOX,
        lambda request: hookapi.PodSandboxHookResponse(
            annotations={"changed": "pod"},
            labels={"extra": "label"},
            cgroup_parent="/kubepods/changed",
        ),
    )
    plugin.answer(
        HookPoint.PRE_CREATE_CONTAINER,
        lambda request: hookapi.ContainerResourceHookResponse(
            container_annotations={"changed": "container"},
            container_envs={"ADDED": "1", "MODE": "c"},
            container_resources=hook_resources(cpu_shares=4096, memory_limit_in_bytes=2 << 30),
        ),
    )
    return plugin


async def create(node: Node) -> tuple[str, str]:
    pod_id = await node.run_pod(pod_config())
    container_id = await node.create_container(pod_id, container_config())
    return pod_id, container_id


async def remove(node: Node, pod_id: str, container_id: str) -> None:
    await node.call("RemoveContainer", api_pb2.RemoveContainerRequest(container_id=container_id))
    await node.stop_pod(pod_id)
    await node.call("RemovePodSandbox", api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod_id))


def stored(node: Node, pod_id: str, container_id: str) -> tuple[Any, Any]:
    """The store's pod and container, less the ids the runtime chose."""
    store = node.proxy.hooks.store
    pod, container = store.get_pod(pod_id), store.get_container(container_id)
    assert pod is not None and container is not None
    return attrs.asdict(pod), attrs.asdict(attrs.evolve(container, id="", pod_sandbox_id=""))


class TestTheStoreAfterAHandedOverCreate:
    async def test_holds_what_the_intercepted_path_kept_field_for_field(
        self, node: Node, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        await changing_plugin(node)
        await node.start_proxy()
        handed = await create(node)
        handed_records = stored(node, *handed)
        handed_forwarded = [r.message for r in node.fake.requests("CreateContainer")]
        await remove(node, *handed)  # (the runtime reserves the names)
        intercepted(monkeypatch)
        plain = await create(node)

        assert handed_records == stored(node, *plain)
        assert "pod" == handed_records[0]["annotations"]["changed"]
        assert {"ADDED": "1", "MODE": "c"}.items() <= handed_records[1]["envs"].items()
        assert 4096 == handed_records[1]["resources"]["cpu_shares"]
        # The runtime got the rewritten request, the same both ways but for the pod id.
        first, second = handed_forwarded[0], node.fake.requests("CreateContainer")[1].message
        assert (first.config, first.sandbox_config) == (second.config, second.sandbox_config)

    async def test_is_what_later_hooks_and_the_call_record_see(self, node: Node) -> None:
        """PreStartContainer gets the changed container; the create's record has the request, the
        rewritten request, the reply, OK, the hooks that ran and a backend time."""
        await changing_plugin(node)
        late = await node.add_plugin("late", hooks=[HookPoint.PRE_START_CONTAINER])
        records: list[Any] = []
        await node.start_proxy()
        node.proxy.relay.transport.observers.append(records.append)
        node.proxy.relay.transport.keep_messages = True
        _, container_id = await create(node)
        await node.start(container_id)

        (started,) = late.requests(HookPoint.PRE_START_CONTAINER)
        assert "container" == started.container_annotations["changed"]
        assert "1" == started.container_envs["ADDED"]
        assert 4096 == started.container_resources.cpu_shares
        (record,) = [r for r in records if r.path.endswith("/CreateContainer")]
        assert Status.OK == record.status
        assert record.forwarded is not None and record.forwarded != record.request
        assert container_id == api_pb2.CreateContainerResponse.FromString(record.reply).container_id
        assert 1 == record.replies
        assert [HookPoint.PRE_CREATE_CONTAINER] == [hook.point for hook in record.hooks]
        assert record.backend_seconds > 0


#: Answers after which nothing may be kept (the caller got an error).
FAILURES = {**FAILED_WORK, "not found": Fault(status=Status.NOT_FOUND, message="no such pod")}


async def failing(node: Node, method: str, request: Any, timeout: float | None = None) -> grpc.StatusCode:  # noqa: ASYNC109
    with pytest.raises(grpc.RpcError) as failed:
        await in_thread(getattr(node.client.runtime, method), request, timeout=timeout)
    code: grpc.StatusCode = failed.value.code()
    return code


class TestAFailedHandedOverCreate:
    @pytest.mark.parametrize("path", ["handed over", "intercepted"])
    @pytest.mark.parametrize("fault", FAILURES.values(), ids=FAILURES.keys())
    async def test_keeps_nothing_and_tells_the_caller_the_runtimes_status(
        self, node: Node, monkeypatch: pytest.MonkeyPatch, fault: Fault, path: str
    ) -> None:
        await changing_plugin(node)
        if path == "intercepted":
            intercepted(monkeypatch)
        await node.start_proxy()
        pod_id = await node.run_pod(pod_config())
        node.fake.inject("CreateContainer", fault)
        code = await failing(node, "CreateContainer", node.create_request(pod_id, container_config()))

        expected = fault.status.name if fault.status is not None else "UNAVAILABLE"
        assert expected == code.name
        assert {} == node.proxy.hooks.store.containers()
        await node.proxy.relay.transport.wait_idle()

    @pytest.mark.parametrize("path", ["handed over", "intercepted"])
    async def test_answered_after_the_deadline_keeps_nothing(
        self, node: Node, monkeypatch: pytest.MonkeyPatch, path: str
    ) -> None:
        """The runtime creates the container after the caller's deadline: kubelet got
        DEADLINE_EXCEEDED and will retry; the late answer is dropped, nothing kept, no call left."""
        await changing_plugin(node)
        if path == "intercepted":
            intercepted(monkeypatch)
        await node.start_proxy()
        pod_id = await node.run_pod(pod_config())
        node.fake.inject("CreateContainer", Fault(delay=3.0))
        request = node.create_request(pod_id, container_config())
        code = await failing(node, "CreateContainer", request, timeout=1.0)

        assert grpc.StatusCode.DEADLINE_EXCEEDED == code
        await wait_until(lambda: bool(node.fake.requests("CreateContainer")))
        with trio.fail_after(LIVENESS_LIMIT):
            await node.proxy.relay.transport.wait_idle()
        await trio.sleep(3.0)  # the runtime's late answer comes (and is dropped)
        assert {} == node.proxy.hooks.store.containers()
        assert 0 == node.proxy.relay.transport.in_flight


def timeout_seconds(value: str) -> float:
    units = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
    return int(value[:-1]) * units[value[-1]]


class TestTheDeadlineOfAHandedOverForward:
    async def test_is_what_the_hooks_left_of_the_callers(self, node: Node) -> None:
        """A plugin taking 3 s of a 20 s deadline: the runtime is given about 17 s, and the caller's
        metadata; not the caller's grpc-accept-encoding (the store reads the answer)."""
        answer = trio.Event()
        plugin = await node.add_plugin("slow", hooks=[HookPoint.PRE_CREATE_CONTAINER], answer_after=answer)
        await node.start_proxy()
        pod_id = await node.run_pod(pod_config())
        request = node.create_request(pod_id, container_config())
        async with trio.open_nursery() as calls:
            calls.start_soon(
                functools.partial(
                    in_thread,
                    node.client.runtime.CreateContainer,
                    request,
                    timeout=20.0,
                    metadata=(("x-caller", "kubelet"),),
                )
            )
            await trio.sleep(3.0)  # the plugin takes about 3 s of the call's 20
            answer.set()

        assert plugin.requests(HookPoint.PRE_CREATE_CONTAINER)
        (headers,) = node.fake.headers("CreateContainer")
        fields = dict(headers)
        # (a second's slack for the client's thread starting late: the caller's deadline starts then)
        assert 10.0 < timeout_seconds(fields["grpc-timeout"]) <= 18.0
        assert "kubelet" == fields["x-caller"]
        assert "grpc-accept-encoding" not in fields
        assert len(node.proxy.hooks.store.containers()) == 1


class TestWhereOciHooksWrapTheInterceptor:
    async def test_the_create_is_not_handed_over_and_both_stores_keep_it(
        self, node: Node, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """--oci-hook-dirs: the OCI interceptor (inner) needs CreateContainer's answer, so the plugins'
        interceptor gets a plain forward and hands nothing over; RunPodSandbox, which OCI hooks do not
        intercept, still is. The plugin store keeps the changed container, the OCI one tracks it."""
        handed: list[str] = []
        hand_over = local_module.LocalCall.hand_over

        def spy(call: local_module.LocalCall, data: bytes, watcher: Any) -> Any:
            handed.append(call.state.path.rsplit("/", 1)[-1])
            return hand_over(call, data, watcher)

        monkeypatch.setattr(local_module.LocalCall, "hand_over", spy)
        oci_dir = os.path.join(node.sockdir, "oci-hooks")
        os.makedirs(oci_dir)
        await changing_plugin(node)
        await node.start_proxy(oci_hook_dirs=(oci_dir,))
        _, container_id = await create(node)

        assert ["RunPodSandbox"] == handed
        container = node.proxy.hooks.store.get_container(container_id)
        assert container is not None and "container" == container.annotations["changed"]
        assert node.proxy.oci_hooks is not None
        assert container_id in node.proxy.oci_hooks._containers
