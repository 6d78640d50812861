"""A container's cgroup is found as the node's runtime made it: containerd, CRI-O or Docker, with
the systemd or the cgroupfs driver; the runtime's own path (OCI ``linux.cgroupsPath``) when known."""

from __future__ import annotations

import json
import logging
import pathlib

import pytest

from krproxy.hookserver import (
    CgroupFile,
    ContainerContext,
    ContainerInfo,
    Executor,
    HookServer,
    Level,
    PodInfo,
    PodMeta,
    PodTarget,
    Stage,
    cgroups_path_dir,
    container_cgroup_candidates,
    pod_cgroup_dir,
    targets_from_cri,
)
from krproxy.hookserver.testing import FakeNode, container_request, logged_events, pod_request
from krproxy.proto.runtime import v1 as cri

SYSTEMD_POD = "kubepods-besteffort-pod1_2.slice"
CGROUPFS_POD = "/kubepods/besteffort/pod1"

#: (the pod's cgroup parent, the container's directory in it, the runtime and driver that make it)
LAYOUTS = [
    (SYSTEMD_POD, "cri-containerd-abc.scope", "containerd, systemd"),
    (SYSTEMD_POD, "crio-abc.scope", "CRI-O, systemd"),
    (SYSTEMD_POD, "docker-abc.scope", "Docker / cri-dockerd, systemd"),
    (CGROUPFS_POD, "abc", "containerd or Docker, cgroupfs"),
    (CGROUPFS_POD, "crio-abc", "CRI-O, cgroupfs"),
]


def _idle_app(node: FakeNode) -> HookServer:
    """A hook server whose one plugin sets cpu.idle=1 on every container (written by the SDK)."""
    app = HookServer(executor=node.executor())

    @app.hook(Stage.POST_START_CONTAINER)
    @app.reconciler(Level.CONTAINER)
    def idle(ctx: ContainerContext) -> None:
        ctx.response.resources.cpu_idle = 1

    return app


class TestLayouts:
    @pytest.mark.parametrize("version", [1, 2])
    @pytest.mark.parametrize(("parent", "leaf", "runtime"), LAYOUTS)
    def test_hook_writes_the_runtimes_container_cgroup(
        self, tmp_path: pathlib.Path, version: int, parent: str, leaf: str, runtime: str
    ) -> None:
        """Whatever runtime and driver made the container's cgroup, the SDK writes there."""
        node = FakeNode(tmp_path, cgroup_version=version).create()
        pod_dir = pod_cgroup_dir(parent)
        node.add_cgroup(pod_dir)
        node.add_cgroup(f"{pod_dir}/{leaf}")
        app = _idle_app(node)
        pod = pod_request("web", cgroup_parent=parent)
        app.handle_container(Stage.POST_START_CONTAINER, container_request(pod, "app", id="abc"))
        assert ("1", "0") == (
            node.read(f"{pod_dir}/{leaf}", CgroupFile.CPU_IDLE),
            node.read(pod_dir, CgroupFile.CPU_IDLE),
        ), runtime
        assert [] == [k for k in app.pending if k.startswith("container:")]

    @pytest.mark.parametrize("version", [1, 2])
    def test_missing_container_cgroup_names_every_path_tried(
        self, tmp_path: pathlib.Path, version: int, caplog: pytest.LogCaptureFixture
    ) -> None:
        """No cgroup in any known form yet: the settings wait, and the log says where it looked."""
        node = FakeNode(tmp_path, cgroup_version=version).create()
        node.add_cgroup(pod_cgroup_dir(SYSTEMD_POD))
        app = _idle_app(node)
        pod = pod_request("web", cgroup_parent=SYSTEMD_POD)
        with caplog.at_level(logging.INFO):
            app.handle_container(Stage.POST_START_CONTAINER, container_request(pod, "app", id="abc"))
        [deferred] = logged_events(caplog.records, "cgroup_write_deferred")
        for candidate in container_cgroup_candidates(SYSTEMD_POD, "abc"):
            assert candidate in deferred["reason"]
        assert "container:abc" in app.pending

    def test_nothing_to_write_looks_for_no_cgroup(
        self, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A container call whose plugins changed nothing the SDK writes answers without looking
        for the container's cgroup on the node (the usual call: a few stat calls saved); one that
        sets cpu.idle looks and writes."""
        node = FakeNode(tmp_path).create()
        pod_dir = pod_cgroup_dir(SYSTEMD_POD)
        node.add_cgroup(f"{pod_dir}/cri-containerd-abc.scope")
        app = _idle_app(node)
        looked: list[str] = []
        exists = Executor.cgroup_exists

        def counting(executor: Executor, cgroup_dir: str) -> bool:
            looked.append(cgroup_dir)
            return exists(executor, cgroup_dir)

        monkeypatch.setattr(Executor, "cgroup_exists", counting)
        req = container_request(pod_request("web", cgroup_parent=SYSTEMD_POD), "app", id="abc")
        app.handle_container(Stage.PRE_START_CONTAINER, req)  # no plugin at this stage
        assert [] == looked
        app.handle_container(Stage.POST_START_CONTAINER, req)
        assert f"{pod_dir}/cri-containerd-abc.scope" in looked
        assert "1" == node.read(f"{pod_dir}/cri-containerd-abc.scope", CgroupFile.CPU_IDLE)

    def test_candidates_per_driver(self) -> None:
        """A systemd pod slice tries the scopes first; a cgroupfs pod directory the plain forms."""
        slice_dir = pod_cgroup_dir(SYSTEMD_POD)
        assert (
            f"{slice_dir}/cri-containerd-abc.scope",
            f"{slice_dir}/crio-abc.scope",
            f"{slice_dir}/docker-abc.scope",
            f"{slice_dir}/abc",
            f"{slice_dir}/crio-abc",
        ) == container_cgroup_candidates(SYSTEMD_POD, "abc")
        assert ("kubepods/besteffort/pod1/abc", "kubepods/besteffort/pod1/crio-abc") == (
            container_cgroup_candidates(CGROUPFS_POD, "abc")[:2]
        )


class TestRuntimePath:
    def test_cgroups_path_forms(self) -> None:
        """OCI linux.cgroupsPath: systemd's slice:prefix:name is a scope in the slice; a path is a path."""
        assert (
            f"{pod_cgroup_dir(SYSTEMD_POD)}/crio-abc.scope",
            "kubepods/besteffort/pod1/abc",
            "",
        ) == (
            cgroups_path_dir(f"{SYSTEMD_POD}:crio:abc"),
            cgroups_path_dir("/kubepods/besteffort/pod1/abc"),
            cgroups_path_dir(""),
        )

    @pytest.mark.parametrize("version", [1, 2])
    def test_runtime_path_wins_over_guessing(self, tmp_path: pathlib.Path, version: int) -> None:
        """A container whose runtime put it somewhere no rule guesses (a custom parent) is written
        where the runtime says, not at a look-alike that happens to exist under the pod."""
        node = FakeNode(tmp_path, cgroup_version=version).create()
        node.add_cgroup(pod_cgroup_dir(CGROUPFS_POD))
        node.add_cgroup(f"{pod_cgroup_dir(CGROUPFS_POD)}/abc")
        node.add_cgroup("/custom/abc")
        app = _idle_app(node)
        pod = PodInfo(PodMeta("web", "default", "uid-web"), cgroup_parent=CGROUPFS_POD)
        container = ContainerInfo(pod, name="app", id="abc", cgroup_path="/custom/abc")
        app.reconcile([PodTarget(pod, (container,))])
        assert ("1", "0") == (
            node.read("/custom/abc", CgroupFile.CPU_IDLE),
            node.read(f"{pod_cgroup_dir(CGROUPFS_POD)}/abc", CgroupFile.CPU_IDLE),
        )

    def test_standalone_reads_the_path_from_verbose_status(self) -> None:
        """Standalone mode takes the container's cgroupsPath from its verbose ContainerStatus info."""
        sandbox = cri.PodSandbox(
            id="s1",
            metadata=cri.PodSandboxMetadata(name="p", uid="u1", namespace="ns"),
            state=cri.PodSandboxState.SANDBOX_READY,
        )
        container = cri.Container(
            id="c1",
            pod_sandbox_id="s1",
            metadata=cri.ContainerMetadata(name="a"),
            state=cri.ContainerState.CONTAINER_RUNNING,
        )
        spec = {"runtimeSpec": {"linux": {"cgroupsPath": f"{SYSTEMD_POD}:crio:c1"}}}
        (target,) = targets_from_cri(
            [sandbox],
            {},
            [container],
            {},
            find_cgroup_parent=lambda uid: SYSTEMD_POD,
            container_info={"c1": {"info": json.dumps(spec)}},
        )
        assert [f"{SYSTEMD_POD}:crio:c1"] == [c.cgroup_path for c in target.containers]
