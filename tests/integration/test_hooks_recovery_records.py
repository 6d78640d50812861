"""Store recovery through the daemon against the fake containerd, whose list answer carries one record krproxy
cannot use as it came (an annotation not UTF-8, as containerd 1.6 stores it; a field of the wrong wire type;
an oversized annotation; an item cut short): the store is recovered and /readyz ready, the other pod's calls
at hook points run their hooks, and the bad pod's are refused only where a Fail plugin needs its record.
And when recovery cannot finish at all, calls at hook points wait out --recovery-grace, then go on."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy import protowire
from krproxy.fakes.containerd import Fault
from krproxy.grpcstatus import Status
from krproxy.hooks.points import HookPoint
from krproxy.hookserver.testing import logged_events
from tests.integration.hooks_support import Node, make_node, pod_config, refused
from tests.integration.support import wait_until

UPDATE = HookPoint.PRE_UPDATE_CONTAINER_RESOURCES


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


def _field(number: int, payload: bytes) -> bytes:
    return protowire.varint(number << 3 | 2) + protowire.varint(len(payload)) + payload


#: What is appended to the bad pod's ListPodSandbox item (PodSandbox: annotations are field 6).
POISON = {
    "annotation not UTF-8": _field(6, _field(1, b"note") + _field(2, b"caf\xe9")),
    "field of the wrong wire type": b"\x30\x07",
    "oversized annotation": _field(6, _field(1, b"big") + _field(2, b"x" * (256 * 1024 + 1))),
    "item cut short": b"\x32\x09ab",
}


def poison(node: Node, pod_id: str, kind: str) -> None:
    """Make the fake list *pod_id* with its item spoilt as *kind* says (its other answers stay good)."""
    state = node.fake.state
    sandbox = state.sandboxes[pod_id]
    item = bytes(state.tables.sandbox_message(sandbox).SerializeToString()) + POISON[kind]
    sandbox.wire["ListPodSandboxResponse.items"] = _field(1, item)
    if kind == "annotation not UTF-8":  # containerd's status answer lists it too (PodSandboxStatus: field 8)
        status = bytes(state.tables.sandbox_status(sandbox).SerializeToString()) + _field(8, POISON[kind][2:])
        sandbox.wire["PodSandboxStatusResponse.status"] = _field(1, status)


async def two_pods(node: Node) -> tuple[str, str, str, str]:
    """A good pod and a bad one, each with a container, created through a first proxy that then stops."""
    await node.start_proxy()
    good_pod = await node.run_pod()
    good = await node.create_container(good_pod)
    bad_pod = await node.run_pod(pod_config("bad"))
    bad = await node.create_container(bad_pod)
    await node.stop_proxy()
    return good_pod, good, bad_pod, bad


def update(container_id: str) -> api_pb2.UpdateContainerResourcesRequest:
    return api_pb2.UpdateContainerResourcesRequest(
        container_id=container_id, linux=api_pb2.LinuxContainerResources(cpu_shares=512)
    )


@pytest.mark.parametrize("kind", list(POISON))
async def test_one_bad_record_leaves_the_node_ready(
    node: Node, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The store is recovered and /readyz ready; the good pod's UpdateContainerResources runs its Fail
    plugin's hook with the recovered record. The bad record is logged once by id with the reason: kept with
    U+FFFD (its hooks run, shown that) when only a string is not UTF-8, else left out, and then its pod's
    call at that point is refused FAILED_PRECONDITION, naming recovery, before anything reaches the runtime."""
    _, good, bad_pod, bad = await two_pods(node)
    poison(node, bad_pod, kind)
    plugin = await node.add_plugin("policy", hooks=[UPDATE], failure_policy="Fail")
    caplog.set_level(logging.INFO, logger="krproxy.daemon")
    caplog.clear()  # the first proxy's events (logged when another test left the level at INFO) are not ours

    await node.start_proxy(socket_name="proxy-2.sock")

    ready, reasons = node.proxy.admin_view.readiness() if node.proxy.admin_view else (False, ["no view"])
    assert (True, []) == (ready, reasons)
    await node.call("UpdateContainerResources", update(good))
    [request] = plugin.requests(UPDATE)
    assert good == request.container_meta.id
    assert "web" == request.pod_meta.name
    if kind == "annotation not UTF-8":
        [repaired] = logged_events(caplog.records, "recovery_record_repaired")
        assert ("pod", bad_pod) == (repaired["kind"], repaired["id"])
        await node.call("UpdateContainerResources", update(bad))
        assert "caf\ufffd" == plugin.requests(UPDATE)[-1].pod_annotations["note"]
        return
    left = {e["id"]: e for e in logged_events(caplog.records, "recovery_record_left_out")}
    assert {bad_pod, bad} == set(left)
    assert f"its pod {bad_pod} was left out" == left[bad]["reason"]
    [recovered] = logged_events(caplog.records, "store_recovered")
    assert (1, 1, 2) == (recovered["pods"], recovered["containers"], recovered["left_out"])
    node.fake.clear_requests()
    details = await refused(
        node, "UpdateContainerResources", update(bad), grpc.StatusCode.FAILED_PRECONDITION
    )
    assert f"container {bad} has no record (store recovery left its record out" in details
    assert "hook server policy (failure-policy Fail, PreUpdateContainerResources)" in details


async def test_left_out_record_is_forwarded_without_fail_plugins(node: Node) -> None:
    """With only an Ignore plugin at the point, the left-out pod's call is forwarded without hooks (the
    runtime gets it and answers), as for any id the store does not know; its Stops too."""
    _, _, bad_pod, bad = await two_pods(node)
    poison(node, bad_pod, "field of the wrong wire type")
    plugin = await node.add_plugin("observer", hooks=[UPDATE, HookPoint.POST_STOP_CONTAINER])
    await node.start_proxy(socket_name="proxy-2.sock")

    await node.call("UpdateContainerResources", update(bad))
    await node.call("StopContainer", api_pb2.StopContainerRequest(container_id=bad))
    assert [] == plugin.requests(UPDATE)
    assert 1 == len(node.fake.requests("UpdateContainerResources"))
    assert 1 == len(node.fake.requests("StopContainer"))


async def test_left_out_record_is_refused_by_required_servers(node: Node) -> None:
    """A --required-hook-server at the point refuses the left-out pod's calls there (Stop included: its
    Post point), while the good pod's calls run the server's hooks."""
    _, good, bad_pod, bad = await two_pods(node)
    poison(node, bad_pod, "oversized annotation")
    plugin = await node.add_plugin("koordlet", hooks=[UPDATE, HookPoint.POST_STOP_CONTAINER])
    await node.start_proxy(
        socket_name="proxy-2.sock",
        requirements=_requirements("koordlet", UPDATE, HookPoint.POST_STOP_CONTAINER),
    )
    node.fake.clear_requests()
    details = await refused(node, "StopContainer", api_pb2.StopContainerRequest(container_id=bad), _FAILED)
    assert "required hook server koordlet (PostStopContainer) needs it" in details
    await refused(node, "UpdateContainerResources", update(bad), _FAILED)
    await node.call("UpdateContainerResources", update(good))
    assert [good] == [r.container_meta.id for r in plugin.requests(UPDATE)]


_FAILED = grpc.StatusCode.FAILED_PRECONDITION


def _requirements(name: str, *points: HookPoint) -> Any:
    from krproxy.hooks.required import RequiredServer, Requirements

    return Requirements(servers=(RequiredServer(name, frozenset(points)),))


class TestGrace:
    async def test_calls_go_on_after_the_grace(self, node: Node, caplog: pytest.LogCaptureFixture) -> None:
        """While ListPodSandbox keeps failing, a call at a hook point waits out --recovery-grace, then runs
        (RunPodSandbox: its hooks on its own config) and is kept in the store; a call on a container the
        store lacks is forwarded without hooks where nothing needs its record. The store stays not recovered,
        and the grace's end is logged once with recovery's last error. (Whether a call also logs why it waits
        depends on its arriving inside the grace, which real time on a busy machine does not promise:
        test_hooks_startup.py holds that log in virtual time.)"""
        await node.start_proxy()
        _, container = await node.pod_with_container()
        await node.stop_proxy()
        node.fake.inject("ListPodSandbox", Fault(status=Status.UNAVAILABLE, message="boom", times=None))
        plugin = await node.add_plugin("p", hooks=[HookPoint.PRE_RUN_POD_SANDBOX, UPDATE])
        caplog.set_level(logging.INFO, logger="krproxy.hooks.startup")
        caplog.set_level(logging.INFO, logger="krproxy.recovery")
        started = trio.current_time()
        await node.start_proxy(socket_name="proxy-2.sock", wait_recovered=False, recovery_grace=0.5)
        await wait_until(lambda: logged_events(caplog.records, "recovery_retry"))

        async with trio.open_nursery() as calls:
            for _ in range(3):
                calls.start_soon(node.call, "UpdateContainerResources", update(container))
        waited = trio.current_time() - started
        pod_id = await node.run_pod(pod_config("late"))

        assert waited >= 0.5
        assert [] == plugin.requests(UPDATE)  # no record: forwarded without hooks
        assert 3 == len(node.fake.requests("UpdateContainerResources"))
        assert ["late"] == [r.pod_meta.name for r in plugin.requests(HookPoint.PRE_RUN_POD_SANDBOX)]
        assert node.proxy.hooks.store.get_pod(pod_id) is not None
        assert not node.proxy.hooks.recovered
        [over] = logged_events(caplog.records, "recovery_grace_over")
        assert "boom" in over["last_error"]
        assert len(logged_events(caplog.records, "hook_calls_wait_for_store")) <= 1

        node.fake.clear_faults()  # recovery then finishes, and keeps what the late call stored
        await node.wait_recovered()
        assert node.proxy.hooks.store.get_pod(pod_id) is not None

    async def test_required_servers_refuse_after_the_grace(self, node: Node) -> None:
        """With a --required-hook-server at the point, a call on a container the store lacks for want of
        recovery is refused UNAVAILABLE after the grace, naming recovery; nothing reaches the runtime."""
        await node.start_proxy()
        _, container = await node.pod_with_container()
        await node.stop_proxy()
        node.fake.inject("ListPodSandbox", Fault(status=Status.UNAVAILABLE, message="boom", times=None))
        await node.add_plugin("koordlet", hooks=[UPDATE])
        await node.start_proxy(
            socket_name="proxy-2.sock",
            wait_recovered=False,
            recovery_grace=0.5,
            requirements=_requirements("koordlet", UPDATE),
        )
        node.fake.clear_requests()
        details = await refused(
            node, "UpdateContainerResources", update(container), grpc.StatusCode.UNAVAILABLE
        )
        assert "the hook store is not recovered from the runtime yet" in details
        assert "required hook server koordlet (PreUpdateContainerResources) needs it" in details
