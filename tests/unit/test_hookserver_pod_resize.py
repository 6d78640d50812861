"""The SDK at PreUpdatePodSandboxResources (pod-level resize): what a handler sees, what it may change,
what goes into the answer and what is written to the pod's cgroup."""

from __future__ import annotations

import pathlib

from krproxy.hookserver import (
    CgroupFile,
    ContainerContext,
    HookServer,
    PodContext,
    Resources,
    ServeOptions,
    Stage,
)
from krproxy.hookserver._service import registered_stages
from krproxy.hookserver.testing import FakeNode, container_request, pod_request
from krproxy.proto.runtime import v1alpha1 as pb

RESIZE = Stage.PRE_UPDATE_POD_SANDBOX_RESOURCES
REQUESTED = pb.LinuxContainerResources(
    cpu_period=100_000, cpu_quota=400_000, cpu_shares=4096, cpuset_mems="0"
)
OVERHEAD = pb.LinuxContainerResources(cpu_shares=25, memory_limit_in_bytes=64 << 20)


def resize_request() -> pb.PodSandboxHookRequest:
    request = pod_request("web", qos="BE")
    request.resources = REQUESTED
    request.overhead = OVERHEAD
    return request


def app_on(tmp_path: pathlib.Path) -> tuple[HookServer, FakeNode]:
    node = FakeNode(tmp_path).create()
    node.add_cgroup("/kubepods/besteffort/poduid-web")
    return HookServer(executor=node.executor()), node


class TestResizeStage:
    def test_handler_sees_the_requested_resources_and_overhead(self, tmp_path: pathlib.Path) -> None:
        app, _ = app_on(tmp_path)
        seen: list[tuple[Resources | None, Resources | None]] = []

        @app.hook(RESIZE)
        def look(ctx: PodContext) -> None:
            seen.append((ctx.request.resources, ctx.request.overhead))

        app.handle_pod(RESIZE, resize_request())

        assert [(Resources.from_proto(REQUESTED), Resources.from_proto(OVERHEAD))] == seen

    def test_other_pod_stages_see_no_resources(self, tmp_path: pathlib.Path) -> None:
        app, _ = app_on(tmp_path)
        seen: list[Resources | None] = []

        @app.hook(Stage.PRE_RUN_POD_SANDBOX)
        def look(ctx: PodContext) -> None:
            seen.append(ctx.request.resources)

        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("web"))

        assert [None] == seen

    def test_cri_changes_go_into_the_answer_not_the_cgroup(self, tmp_path: pathlib.Path) -> None:
        """A capped CFS quota is answered (echoing the rest of the request's resources, which the proxy's
        merge overwrites cpusets with); a group identity is written to the pod cgroup as at other stages."""
        app, node = app_on(tmp_path)

        @app.hook(RESIZE)
        def cap(ctx: PodContext) -> None:
            ctx.response.resources.cfs_quota = 200_000
            ctx.response.resources.cpu_bvt = -1

        answer = app.handle_pod(RESIZE, resize_request())

        expected = pb.LinuxContainerResources.FromString(bytes(REQUESTED))
        expected.cpu_quota = 200_000
        assert expected == answer.resources
        pod_cgroup = "/kubepods/besteffort/poduid-web"
        assert ("-1", "max 100000") == (
            node.read(pod_cgroup, CgroupFile.CPU_BVT),
            node.read(pod_cgroup, CgroupFile.CFS_QUOTA),
        )

    def test_resized_pod_is_remembered_with_its_resources(self, tmp_path: pathlib.Path) -> None:
        """Re-applies (policy change, tickers) see the pod as last resized."""
        app, _ = app_on(tmp_path)
        app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod_request("web", qos="BE"))

        app.handle_pod(RESIZE, resize_request())

        [target] = app.pods.targets()
        assert Resources.from_proto(REQUESTED) == target.pod.resources

    def test_registered_only_with_a_handler(self, tmp_path: pathlib.Path) -> None:
        """The registration file lists the point only when a function runs there, so a server written
        before it existed registers exactly as before."""
        app, _ = app_on(tmp_path)
        options = ServeOptions(socket="/run/s.sock", hook_dir=str(tmp_path))

        @app.hook(Stage.PRE_RUN_POD_SANDBOX)
        def run(ctx: PodContext) -> None:
            pass

        assert RESIZE not in registered_stages(app, options)

        @app.hook(RESIZE)
        def resize(ctx: PodContext) -> None:
            pass

        assert RESIZE in registered_stages(app, options)

    def test_deferred_resize_keeps_cri_changes_out_of_the_cgroup(self, tmp_path: pathlib.Path) -> None:
        """Settings of a resize whose pod cgroup is not there yet are written once it is: the group
        identity, as when the cgroup was there at the call, but not the capped quota, which went into the
        answer (kubelet writes the pod's quota)."""
        node = FakeNode(tmp_path).create()
        app = HookServer(executor=node.executor())

        @app.hook(RESIZE)
        def cap(ctx: PodContext) -> None:
            ctx.response.resources.cfs_quota = 200_000
            ctx.response.resources.cpu_bvt = -1

        answer = app.handle_pod(RESIZE, resize_request())
        pod_cgroup = "/kubepods/besteffort/poduid-web"
        node.add_cgroup(pod_cgroup)
        app.retry_pending()

        assert answer.resources is not None and 200_000 == answer.resources.cpu_quota
        assert ("-1", "max 100000") == (
            node.read(pod_cgroup, CgroupFile.CPU_BVT),
            node.read(pod_cgroup, CgroupFile.CFS_QUOTA),
        )

    def test_container_stages_see_the_pod_resources(self, tmp_path: pathlib.Path) -> None:
        """After a resize the proxy sends container hooks the pod's resources (pod_resources): a container
        handler finds them on its pod, as pod handlers do."""
        app, _ = app_on(tmp_path)
        seen: list[Resources | None] = []

        @app.hook(Stage.PRE_UPDATE_CONTAINER_RESOURCES)
        def look(ctx: ContainerContext) -> None:
            seen.append(ctx.request.pod.resources)

        resized = container_request(resize_request(), "app", id="c1")
        never = container_request(pod_request("web", qos="BE"), "app", id="c1")
        app.handle_container(Stage.PRE_UPDATE_CONTAINER_RESOURCES, resized)
        app.handle_container(Stage.PRE_UPDATE_CONTAINER_RESOURCES, never)

        assert [Resources.from_proto(REQUESTED), None] == seen
