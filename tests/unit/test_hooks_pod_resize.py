"""PreUpdatePodSandboxResources, krproxy's pod-level resize hook: records, hook request, merge rules,
validation, store and registration."""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any, cast

import attrs
import trio

from krproxy.fakes.plugin.server import echo_container, echo_pod
from krproxy.forward import Reply
from krproxy.hooks import convert, encode
from krproxy.hooks.dispatch import Dispatcher
from krproxy.hooks.merge import Change, merge_pod_resize
from krproxy.hooks.model import ContainerInfo, PodAnswer, PodResize, Resources
from krproxy.hooks.points import EXTENSIONS, HookPoint
from krproxy.hooks.registration import PluginRegistration, Registry
from krproxy.hooks.runtime import HookRuntime
from krproxy.hooks.store import HookStore
from krproxy.hooks.validate import check_answer
from krproxy.hooks.writeback import apply_pod_resize, resources_to_cri, resources_to_hook
from krproxy.proto.runtime import v1, v1alpha1
from tests.records import RESIZED_CPU, WEB_POD

POD = attrs.evolve(WEB_POD, cgroup_parent="/kubepods/burstable/podu1")
REQUESTED = Resources(**RESIZED_CPU, memory_limit_in_bytes=1 << 30)
OVERHEAD = Resources(cpu_shares=25, memory_limit_in_bytes=64 << 20)


def resize_request(resources: Resources = REQUESTED) -> v1.UpdatePodSandboxResourcesRequest:
    return v1.UpdatePodSandboxResourcesRequest(
        pod_sandbox_id="sb1",
        overhead=resources_to_cri(OVERHEAD),
        resources=resources_to_cri(resources),
    )


def resize() -> PodResize:
    return convert.pod_resize_from_request(resize_request(), POD)


class TestHookRequest:
    def test_carries_the_stored_pod_and_the_requested_resources(self) -> None:
        """The hook is told the stored pod (meta, handler, labels, annotations, cgroup parent) with
        resources = the requested pod resources and overhead = the requested overhead."""
        request = v1alpha1.PodSandboxHookRequest.FromString(encode.pod_resize_request(resize()))

        assert (
            v1alpha1.PodSandboxHookRequest(
                pod_meta=v1alpha1.PodSandboxMetadata(name="web", uid="u1", namespace="default", attempt=1),
                runtime_handler="runc",
                labels={"app": "web"},
                annotations={"a": "1"},
                cgroup_parent="/kubepods/burstable/podu1",
                overhead=resources_to_hook(OVERHEAD),
                resources=resources_to_hook(REQUESTED),
            )
            == request
        )

    def test_absent_overhead_and_resources_stay_absent(self) -> None:
        """A request without overhead (no RuntimeClass overhead) sends none: not an all-zero one."""
        request = v1.UpdatePodSandboxResourcesRequest(pod_sandbox_id="sb1")

        pod = convert.pod_resize_from_request(request, POD).pod

        assert (None, None) == (pod.resources, pod.overhead)


class TestMerge:
    def test_answer_resources_merged_like_container_resources(self) -> None:
        """Positive values replace, quota ≠ 0 replaces, cpusets always, unified added; the change is listed."""
        answer = PodAnswer(resources=Resources(cpu_quota=200000, unified={"memory.high": "900"}))

        merged = merge_pod_resize(resize(), answer)

        assert attrs.evolve(REQUESTED, cpu_quota=200000, unified={"memory.high": "900"}) == (
            merged.value.pod.resources
        )
        assert (
            Change("resources.cpu_quota", 150000, 200000),
            Change("resources.unified[memory.high]", None, "900"),
        ) == merged.changes

    def test_everything_but_resources_is_ignored(self) -> None:
        """Labels, annotations and cgroup parent of an answer have nowhere to go: the resize is unchanged."""
        answer = PodAnswer(labels={"x": "1"}, annotations={"y": "2"}, cgroup_parent="/elsewhere")

        merged = merge_pod_resize(resize(), answer)

        assert (resize(), ()) == (merged.value, merged.changes)

    def test_request_without_resources_cannot_gain_them(self) -> None:
        """As for containers (Koordinator: both must be non-nil), no requested resources → nothing merged."""
        bare = convert.pod_resize_from_request(v1.UpdatePodSandboxResourcesRequest(pod_sandbox_id="sb1"), POD)
        answer = PodAnswer(resources=Resources(cpu_shares=4))

        assert bare == merge_pod_resize(bare, answer).value

    def test_apply_replaces_resources_keeps_the_rest(self) -> None:
        """The forwarded request carries the merged resources; id and overhead are the request's."""
        merged = attrs.evolve(
            resize(), pod=attrs.evolve(POD, resources=attrs.evolve(REQUESTED, cpu_shares=4))
        )

        out = apply_pod_resize(resize_request(), merged)

        assert resize_request(attrs.evolve(REQUESTED, cpu_shares=4)) == out

    def test_apply_keeps_unknown_fields(self) -> None:
        """A field a newer kubelet sends (unknown to our schema) survives a merged resize."""
        data = bytes(resize_request()) + b"\xa2\x06\x03abc"  # field 100, length-delimited

        out = apply_pod_resize(v1.UpdatePodSandboxResourcesRequest.FromString(data), resize())

        assert bytes(out).endswith(b"\xa2\x06\x03abc")


class TestValidate:
    def test_resources_are_checked(self) -> None:
        """The applied field is checked with the container resources' bounds."""
        answer = PodAnswer(resources=Resources(cpu_shares=1))

        assert ["resources.cpu_shares=1 is not 0 or 2..262144"] == check_answer(resize(), answer)

    def test_fields_not_applied_are_not_checked(self) -> None:
        """A bad cgroup parent in a resize answer is ignored, not a failure (it is never applied)."""
        answer = PodAnswer(cgroup_parent="../..", labels={"": "x"})

        assert [] == check_answer(resize(), answer)


class TestStore:
    def test_resize_reaches_the_pod_and_its_containers(self) -> None:
        """Later container hooks get the new pod resources as pod_resources."""
        store = HookStore()
        store.put_pod("sb1", POD)
        store.put_container("c1", ContainerInfo(pod_sandbox_id="sb1", pod=POD, name="a", id="c1"))
        store.put_container("c2", ContainerInfo(pod_sandbox_id="sb2", pod=POD, name="b", id="c2"))

        assert store.resize_pod("sb1", REQUESTED, OVERHEAD)

        stored_c1 = store.get_container("c1")
        stored_c2 = store.get_container("c2")
        assert stored_c1 is not None and stored_c2 is not None
        assert attrs.evolve(POD, resources=REQUESTED, overhead=OVERHEAD) == store.get_pod("sb1")
        assert (
            resources_to_hook(REQUESTED)
            == v1alpha1.ContainerResourceHookRequest.FromString(
                encode.container_request(stored_c1)
            ).pod_resources
        )
        assert stored_c2.pod == POD

    def test_unknown_pod_is_not_created(self) -> None:
        store = HookStore()

        assert not store.resize_pod("sb1", REQUESTED, None)
        assert store.get_pod("sb1") is None


class TestRegistration:
    def test_listed_only(self) -> None:
        """A server is called at the new point only if its file lists it; existing files are untouched."""
        registry = Registry().apply(
            "koordlet.json",
            json.dumps({"remote-endpoint": "/run/k.sock", "runtime-hooks": ["PreRunPodSandbox"]}).encode(),
        )
        registry = registry.apply(
            "resizer.json",
            json.dumps(
                {"remote-endpoint": "/run/r.sock", "runtime-hooks": ["PreUpdatePodSandboxResources"]}
            ).encode(),
        )

        assert ["resizer"] == [
            p.name for p in registry.plugins_for(HookPoint.PRE_UPDATE_POD_SANDBOX_RESOURCES)
        ]

    def test_the_extension_is_pod_level_and_pre(self) -> None:
        point = HookPoint.PRE_UPDATE_POD_SANDBOX_RESOURCES
        assert (frozenset({point}), True, "UpdatePodSandboxResources") == (
            EXTENSIONS,
            point.is_pod_level,
            point.cri_method,
        )


# --- a resize while a container call of the same pod is in its hooks ---------------------------------------


class _HeldDispatcher(Dispatcher):
    """Plugins that echo (with one annotation added) without a socket; a call at ``hold`` waits for
    ``release``, so a test can run another CRI call while that one is in its hooks."""

    def __init__(self, hold: HookPoint) -> None:
        super().__init__(cast(Any, None))
        self.hold = hold
        self.entered = trio.Event()
        self.release = trio.Event()
        hooks = [p.value for p in HookPoint if p.stage.value == "pre"]
        self.publish(
            Registry().apply(
                "p.json", json.dumps({"remote-endpoint": "/run/p.sock", "runtime-hooks": hooks}).encode()
            )
        )

    async def _unary(self, plugin: PluginRegistration, path: str, request: bytes, within: float) -> bytes:
        point = next(p for p in HookPoint if p.rpc_path == path)
        if point is self.hold:
            self.entered.set()
            await self.release.wait()
        if point.is_pod_level:
            return bytes(echo_pod(v1alpha1.PodSandboxHookRequest.FromString(request)))
        answer = echo_container(v1alpha1.ContainerResourceHookRequest.FromString(request))
        answer.container_annotations["seen"] = "yes"
        return bytes(answer)


class TestResizeDuringContainerHooks:
    """The pod part of a container record is the pod's: a container call whose hooks were running while
    the pod was resized must not write the old pod resources back (later hooks would get them)."""

    async def _resized_during(
        self, hold: HookPoint, call: Callable[[HookRuntime], Awaitable[Any]]
    ) -> HookStore:
        store = HookStore()
        store.put_pod("sb1", POD)
        store.put_container(
            "c1", ContainerInfo(pod_sandbox_id="sb1", pod=POD, name="a", id="c1", resources=REQUESTED)
        )
        dispatcher = _HeldDispatcher(hold)
        runtime = HookRuntime(store, dispatcher, ("skip", "true"))
        runtime.mark_recovered()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, runtime)
            await dispatcher.entered.wait()
            forward = functools.partial(_forward_ok, v1.UpdatePodSandboxResourcesResponse())
            await runtime.update_pod_sandbox_resources(bytes(resize_request()), forward)
            dispatcher.release.set()
        return store

    async def test_update_container_resources(self) -> None:
        async def update(runtime: HookRuntime) -> None:
            request = v1.UpdateContainerResourcesRequest(container_id="c1", linux=resources_to_cri(REQUESTED))
            forward = functools.partial(_forward_ok, v1.UpdateContainerResourcesResponse())
            await runtime.update_container_resources(bytes(request), forward)

        store = await self._resized_during(HookPoint.PRE_UPDATE_CONTAINER_RESOURCES, update)

        stored = store.get_container("c1")
        assert stored is not None and "yes" == stored.annotations.get("seen")  # the update was stored
        assert (REQUESTED, OVERHEAD) == (stored.pod.resources, stored.pod.overhead)

    async def test_start_container(self) -> None:
        async def start(runtime: HookRuntime) -> None:
            forward = functools.partial(_forward_ok, v1.StartContainerResponse())
            await runtime.start_container(bytes(v1.StartContainerRequest(container_id="c1")), forward)

        store = await self._resized_during(HookPoint.PRE_START_CONTAINER, start)

        stored = store.get_container("c1")
        assert stored is not None and "yes" == stored.annotations.get("seen")
        assert (REQUESTED, OVERHEAD) == (stored.pod.resources, stored.pod.overhead)

    async def test_create_container(self) -> None:
        async def create(runtime: HookRuntime) -> None:
            request = v1.CreateContainerRequest(
                pod_sandbox_id="sb1",
                config=v1.ContainerConfig(metadata=v1.ContainerMetadata(name="b")),
                sandbox_config=v1.PodSandboxConfig(),
            )
            forward = functools.partial(_forward_ok, v1.CreateContainerResponse(container_id="c2"))
            await runtime.create_container(bytes(request), forward)

        store = await self._resized_during(HookPoint.PRE_CREATE_CONTAINER, create)

        stored = store.get_container("c2")
        assert stored is not None and "yes" == stored.annotations.get("seen")
        assert (REQUESTED, OVERHEAD) == (stored.pod.resources, stored.pod.overhead)


async def _forward_ok(message: Any, data: bytes) -> Reply:
    """A runtime that accepts every call, answering *message*."""
    return Reply(bytes(message))
