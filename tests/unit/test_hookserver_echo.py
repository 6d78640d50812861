"""The answer echoes the request: with no plugins the proxy's merge changes nothing.

The proxy overwrites cpuset and oom_score_adj with whatever we answer and replaces the
env set (hook-semantics 2.4), so the echo must be exact, field by field.
"""

from __future__ import annotations

import pathlib

from hypothesis import given

from krproxy.hookserver import (
    ContainerContext,
    ContainerInfo,
    HookServer,
    PodContext,
    PodInfo,
    QoSClass,
    Stage,
    container_response,
    pod_response,
)
from krproxy.hookserver.testing import FakeNode, container_request, pod_request
from krproxy.proto.runtime import v1alpha1 as pb
from tests.unit.hook_messages import container_requests, pod_requests


class TestEcho:
    @given(pod_requests)
    def test_pod_echo(self, req: pb.PodSandboxHookRequest) -> None:
        """No changes: labels, annotations, cgroup parent and resources come back as sent."""
        resp = pod_response(req, PodContext(PodInfo.from_proto(req)))
        assert (req.labels, req.annotations, req.cgroup_parent) == (
            resp.labels,
            resp.annotations,
            resp.cgroup_parent,
        )
        assert req.resources == resp.resources

    @given(container_requests)
    def test_container_echo(self, req: pb.ContainerResourceHookRequest) -> None:
        """No changes: annotations, resources (cpuset, oom_score_adj…), envs, cgroup parent come back."""
        resp = container_response(req, ContainerContext(ContainerInfo.from_proto(req)))
        assert req.container_annotations == resp.container_annotations
        assert req.container_resources == resp.container_resources
        assert req.container_envs == resp.container_envs
        assert req.pod_cgroup_parent == resp.pod_cgroup_parent

    def test_app_without_plugins_echoes_every_stage(self, tmp_path: pathlib.Path) -> None:
        """A HookServer with no plugins answers every stage with exactly the request's fields."""
        app = HookServer(executor=FakeNode(tmp_path).create().executor())
        res = pb.LinuxContainerResources(cpu_quota=5000, cpuset_cpus="1", oom_score_adj=-997)
        pod = pod_request("p", annotations={"a": "b"})
        ctr = container_request(pod, "c", id="c1", resources=res, envs={"E": "1"}, annotations={"x": "y"})
        for stage in (Stage.PRE_RUN_POD_SANDBOX, Stage.POST_STOP_POD_SANDBOX):
            got = app.handle_pod(stage, pod)
            expected = pb.PodSandboxHookResponse(
                labels=pod.labels, annotations=pod.annotations, cgroup_parent=pod.cgroup_parent
            )
            assert expected == got
        for stage in Stage:
            if not stage.is_pod_level:
                expected_c = pb.ContainerResourceHookResponse(
                    container_annotations={"x": "y"},
                    container_resources=res,
                    pod_cgroup_parent=pod.cgroup_parent,
                    container_envs={"E": "1"},
                )
                assert expected_c == app.handle_container(stage, ctr)


class TestChanges:
    def test_changes_merge_into_echo(self) -> None:
        """CRI-expressible changes land in the echoed resources; the rest of it is kept."""
        pod = pod_request("p", qos="BE")
        req = container_request(
            pod, "c", resources=pb.LinuxContainerResources(cpu_shares=2, oom_score_adj=1000), envs={"A": "1"}
        )
        ctx = ContainerContext(ContainerInfo.from_proto(req))
        assert QoSClass.BE == ctx.request.pod.qos_class
        ctx.response.resources.cpuset = "2-3"
        ctx.response.resources.cfs_quota = -1
        ctx.response.resources.cpu_bvt = -1  # not CRI-expressible: not in the response
        ctx.response.add_envs["B"] = "2"
        ctx.response.annotations["note"] = "x"
        resp = container_response(req, ctx)
        expected = pb.LinuxContainerResources(
            cpu_shares=2, oom_score_adj=1000, cpuset_cpus="2-3", cpu_quota=-1
        )
        assert expected == resp.container_resources
        assert {"A": "1", "B": "2"} == resp.container_envs
        assert {"note": "x"} == resp.container_annotations
        # The request is not mutated by the echo.
        assert "" == req.container_resources.cpuset_cpus  # type: ignore[union-attr]

    def test_pod_changes(self) -> None:
        """Labels/annotations are added, a non-empty cgroup parent replaces the old one."""
        req = pod_request("p", labels={"keep": "1"})
        ctx = PodContext(PodInfo.from_proto(req))
        ctx.response.labels["new"] = "2"
        ctx.response.cgroup_parent = "/elsewhere"
        resp = pod_response(req, ctx)
        assert {"keep": "1", "new": "2", "io.kubernetes.pod.name": "p"} == resp.labels
        assert "/elsewhere" == resp.cgroup_parent
        assert resp.resources is None
