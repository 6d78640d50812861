"""NRI pods and containers to hook records, and hook results to NRI adjustments (krproxy.nri.convert).

The pods and containers are written as betterproto2 messages and decoded with upb (:mod:`krproxy.nri.wire`),
as krproxy decodes what the runtime sends.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from krproxy.hooks.model import ContainerInfo, PodInfo, Resources
from krproxy.nri import convert, wire
from krproxy.proto.nri.pkg.api import v1alpha1 as api
from tests.records import FULL_RESOURCES


def upb(message: Any) -> Any:
    """``message`` as krproxy reads it off the wire: serialized, then decoded with upb."""
    return wire.parse(type(message).__name__, bytes(message))


#: The fields an NRI pod and a hook record name alike, with the values the pod carries.
POD_FIELDS: dict[str, Any] = {
    "name": "web",
    "uid": "u1",
    "namespace": "prod",
    "labels": {"app": "web"},
    "annotations": {"a": "1"},
    "runtime_handler": "runc",
}
POD_MESSAGE = api.PodSandbox(
    id="p1", linux=api.LinuxPodSandbox(cgroup_parent="/kubepods/pod-u1"), **POD_FIELDS
)
CONTAINER_MESSAGE = api.Container(
    id="c1",
    pod_sandbox_id="p1",
    name="app",
    annotations={"h": "x"},
    env=["PATH=/bin", "MODE=a", "MODE=b", "EMPTY="],
    linux=api.LinuxContainer(
        resources=api.LinuxResources(
            cpu=api.LinuxCpu(
                shares=api.OptionalUInt64(value=1024),
                quota=api.OptionalInt64(value=-1),
                period=api.OptionalUInt64(value=100_000),
                cpus="0-3",
                mems="0",
            ),
            memory=api.LinuxMemory(
                limit=api.OptionalInt64(value=1 << 30), swap=api.OptionalInt64(value=2 << 30)
            ),
            unified={"memory.high": "max"},
            hugepage_limits=[api.HugepageLimit(page_size="2MB", limit=1 << 21)],
        ),
        oom_score_adj=api.OptionalInt(value=-997),
    ),
)
POD, CONTAINER = upb(POD_MESSAGE), upb(CONTAINER_MESSAGE)


class TestFromNri:
    def test_pod(self) -> None:
        """Name, uid, namespace, handler, labels, annotations and the cgroup parent are taken; no attempt."""
        assert PodInfo(cgroup_parent="/kubepods/pod-u1", **POD_FIELDS) == convert.pod_from_nri(POD)

    def test_container(self) -> None:
        """Resources (with oom_score_adj from beside them), env as a map (later duplicate wins) and the pod."""
        info = convert.container_from_nri(POD, CONTAINER)
        assert FULL_RESOURCES == info.resources
        assert {"PATH": "/bin", "MODE": "b", "EMPTY": ""} == info.envs
        assert ("c1", "p1", "app", "/kubepods/pod-u1") == (
            info.id,
            info.pod_sandbox_id,
            info.name,
            info.pod_cgroup_parent,
        )
        assert "web" == info.pod.name

    def test_fields_of_a_newer_nri(self) -> None:
        """A pod and container from a runtime with a newer NRI than 0.12.2 (fields beyond our schema in the
        pod, its linux part, the container, its linux part, resources, cpu and memory) read as without them."""
        newer = b"\xd8\xfa\x01\x07" + b"\xe2\xfa\x01\x05newer"  # field 4011 = 7, field 4012 = "newer"

        def marked(message: Any, *parts: str) -> Any:
            out = type(message).FromString(bytes(message) + newer)
            for path in parts:
                holder = out
                *outer, last = path.split(".")
                for name in outer:
                    holder = getattr(holder, name)
                part = getattr(holder, last)
                setattr(holder, last, type(part).FromString(bytes(part) + newer))
            return out

        pod = marked(POD_MESSAGE, "linux")
        container = marked(
            CONTAINER_MESSAGE, "linux", "linux.resources", "linux.resources.cpu", "linux.resources.memory"
        )
        assert bytes(pod).count(newer) == 2 and bytes(container).count(newer) == 5  # the fields are sent
        assert convert.pod_from_nri(POD) == convert.pod_from_nri(upb(pod))
        assert convert.container_from_nri(POD, CONTAINER) == convert.container_from_nri(
            upb(pod), upb(container)
        )

    def test_missing_parts(self) -> None:
        """A pod or container without its optional parts converts to empty records, never an error."""
        assert PodInfo() == convert.pod_from_nri(None)
        info = convert.container_from_nri(upb(api.PodSandbox()), upb(api.Container(id="c")))
        assert (Resources(), {}) == (info.resources, info.envs)


class TestPodCgroupParent:
    """A container hook is shown the cgroup parent containerd put the container under (its spec's
    cgroupsPath, NRI's ``cgroups_path``), which is the CreateContainer request's sandbox config's and may
    not be its pod's."""

    @staticmethod
    def shown(pod_parent: str, cgroups_path: str) -> str:
        pod = upb(api.PodSandbox(id="p1", linux=api.LinuxPodSandbox(cgroup_parent=pod_parent)))
        container = upb(api.Container(id="c1", linux=api.LinuxContainer(cgroups_path=cgroups_path)))
        return convert.container_from_nri(pod, container).pod_cgroup_parent

    @pytest.mark.parametrize(
        ("pod_parent", "cgroups_path", "shown"),
        [
            ("/kubepods/pod-u1", "/kubepods/pod-u1/c1", "/kubepods/pod-u1"),
            ("/kubepods/pod-u1/", "/kubepods/pod-u1/c1", "/kubepods/pod-u1/"),
            ("/kubepods/pod-u1", "/kubepods/elsewhere/c1", "/kubepods/elsewhere"),
            ("/kubepods.slice/kubepods-pod1.slice", "kubepods-pod1.slice:cri-containerd:c1", None),
            ("kubepods-pod1.slice", "kubepods-pod2.slice:cri-containerd:c1", "kubepods-pod2.slice"),
            ("/kubepods/pod-u1", "", None),
            ("/kubepods/pod-u1", "/kubepods/other/c2", None),
            ("", "c1", ""),
        ],
        ids=[
            "cgroupfs, the pod's",
            "cgroupfs, the pod's with a slash",
            "cgroupfs, elsewhere",
            "systemd, the pod's slice",
            "systemd, another slice",
            "no cgroups path",
            "another container's path",
            "no parent",
        ],
    )
    def test_shown(self, pod_parent: str, cgroups_path: str, shown: str | None) -> None:
        """The parent of the container's cgroups path when it names another cgroup than the pod's parent;
        the pod's parent (None here) when it names the same, or none."""
        assert (pod_parent if shown is None else shown) == self.shown(pod_parent, cgroups_path)


class TestAdjustment:
    def before(self) -> ContainerInfo:
        return convert.container_from_nri(POD, CONTAINER)

    def test_nothing_changed(self) -> None:
        """An echo becomes no adjustment at all (so no field is claimed from other NRI plugins)."""
        assert convert.Adjusted(None) == convert.adjustment(self.before(), self.before())

    def test_only_changed_fields(self) -> None:
        """Changed resources, env and annotations are set; removals carry NRI's '-' mark; nothing else."""
        before = self.before()
        assert before.resources is not None
        after = attrs.evolve(
            before,
            annotations={"h": "x", "new": "v"},
            envs={"PATH": "/bin", "MODE": "c", "ADDED": "1"},
            resources=attrs.evolve(before.resources, cpu_shares=2048, cpuset_cpus="1", oom_score_adj=0),
        )
        adjusted = convert.adjustment(before, after)
        assert () == adjusted.not_applied
        assert adjusted.adjust == api.ContainerAdjustment(
            annotations={"new": "v"},
            env=[
                api.KeyValue(key="MODE", value="c"),
                api.KeyValue(key="ADDED", value="1"),
                api.KeyValue(key="-EMPTY", value=""),
            ],
            linux=api.LinuxContainerAdjustment(
                resources=api.LinuxResources(
                    cpu=api.LinuxCpu(shares=api.OptionalUInt64(value=2048), cpus="1")
                ),
                oom_score_adj=api.OptionalInt(value=0),
            ),
        )

    def test_what_nri_cannot_do_is_named(self) -> None:
        """The pod cgroup parent, a cleared cpuset, a removed unified key and hugepages are listed, not sent."""
        before = self.before()
        assert before.resources is not None
        after = attrs.evolve(
            before,
            pod_cgroup_parent="/kubepods/pod-u1/x",
            resources=attrs.evolve(before.resources, cpuset_cpus="", unified={}, hugepage_limits=()),
        )
        adjusted = convert.adjustment(before, after)
        assert None is adjusted.adjust
        assert (
            "pod_cgroup_parent",
            "cpuset_cpus cleared",
            "unified[memory.high] removed",
            "hugepage_limits",
        ) == (adjusted.not_applied)

    def test_oom_score_adj_without_the_field(self) -> None:
        """With NRI 0.6.1 (no oom_score_adj in its adjustment) a changed value is named, not sent."""
        before = self.before()
        assert before.resources is not None
        after = attrs.evolve(before, resources=attrs.evolve(before.resources, oom_score_adj=0, cpu_shares=2))
        adjusted = convert.adjustment(before, after, oom_score_adj=False)
        assert ("oom_score_adj",) == adjusted.not_applied
        assert adjusted.adjust == api.ContainerAdjustment(
            linux=api.LinuxContainerAdjustment(
                resources=api.LinuxResources(cpu=api.LinuxCpu(shares=api.OptionalUInt64(value=2)))
            )
        )

    def test_names_read_as_removal_marks(self) -> None:
        """An env var or annotation whose name begins with '-' (NRI's removal mark: it would remove ``MODE``
        or ``h``, where proxy mode gives the container the name as written) is named, not sent."""
        before = self.before()
        after = attrs.evolve(
            before,
            annotations={**before.annotations, "-h": "v", "kept": "1"},
            envs={**before.envs, "-MODE": "1"},
        )
        adjusted = convert.adjustment(before, after)
        assert ("annotations[-h]", "env[-MODE]") == adjusted.not_applied
        assert api.ContainerAdjustment(annotations={"kept": "1"}) == adjusted.adjust
        assert {convert.REMOVAL_MARK} == {convert.why_not_applied(f) for f in adjusted.not_applied}

    def test_swap_is_named(self) -> None:
        """A swap limit of its own is named, not sent: NRI sets the swap limit to the memory limit."""
        before = self.before()
        assert before.resources is not None
        after = attrs.evolve(
            before, resources=attrs.evolve(before.resources, memory_swap_limit_in_bytes=3 << 30)
        )
        adjusted = convert.adjustment(before, after)
        assert (None, ("memory_swap_limit_in_bytes",)) == (adjusted.adjust, adjusted.not_applied)
        assert convert.SWAP == convert.why_not_applied("memory_swap_limit_in_bytes")

    def test_swap_equal_to_a_new_limit(self) -> None:
        """A swap equal to the memory limit sent with it is what NRI sets anyway: the limit is sent, nothing
        named."""
        before = self.before()
        assert before.resources is not None
        resources = attrs.evolve(
            before.resources, memory_limit_in_bytes=4 << 30, memory_swap_limit_in_bytes=4 << 30
        )
        adjusted = convert.adjustment(before, attrs.evolve(before, resources=resources))
        assert () == adjusted.not_applied
        assert adjusted.adjust == api.ContainerAdjustment(
            linux=api.LinuxContainerAdjustment(
                resources=api.LinuxResources(memory=api.LinuxMemory(limit=api.OptionalInt64(value=4 << 30)))
            )
        )

    @pytest.mark.parametrize(
        ("value", "restrict", "sent"),
        [(-998, True, False), (0, True, True), (-998, False, True)],
        ids=["lowered, restricted", "raised, restricted", "lowered, not restricted"],
    )
    def test_a_restricted_oom_score_adj(self, value: int, restrict: bool, sent: bool) -> None:
        """With containerd's restrict_oom_score_adj, an oom_score_adj below the one containerd chose (-997)
        is named ``oom_score_adj lowered``, not sent: containerd would have kept it at or above its own,
        NRI's adjustment would not. A higher one, or any without the setting, is sent."""
        before = self.before()
        assert before.resources is not None
        after = attrs.evolve(before, resources=attrs.evolve(before.resources, oom_score_adj=value))
        adjusted = convert.adjustment(before, after, restrict_oom_score_adj=restrict)
        if sent:
            assert () == adjusted.not_applied
            assert adjusted.adjust is not None and adjusted.adjust.linux is not None
            assert api.OptionalInt(value=value) == adjusted.adjust.linux.oom_score_adj
        else:
            assert (None, ("oom_score_adj lowered",)) == (adjusted.adjust, adjusted.not_applied)
            assert convert.OOM_RESTRICTED == convert.why_not_applied("oom_score_adj lowered")

    @pytest.mark.parametrize(
        ("value", "sent", "lowered"),
        [(-998, -998, False), (-999, -998, True), (-500, -500, False), (-997, None, False)],
        ids=["containerd's own", "below containerd's own", "between", "unchanged"],
    )
    def test_oom_score_adj_bounded_by_containerd_s_own(
        self, value: int, sent: int | None, lowered: bool
    ) -> None:
        """With restrict_oom_score_adj and containerd's own oom_score_adj known (-998, below the -997 it chose):
        a value at or above containerd's own is sent as proxy mode's containerd gives it, one below is sent
        as containerd's own and named ``oom_score_adj lowered``."""
        before = self.before()
        assert before.resources is not None
        after = attrs.evolve(before, resources=attrs.evolve(before.resources, oom_score_adj=value))
        adjusted = convert.adjustment(before, after, restrict_oom_score_adj=True, runtime_oom_score_adj=-998)
        linux = adjusted.adjust.linux if adjusted.adjust is not None else None
        got = linux.oom_score_adj.value if linux is not None and linux.oom_score_adj is not None else None
        assert (sent, lowered) == (got, "oom_score_adj lowered" in adjusted.not_applied)

    def test_other_fields_cannot(self) -> None:
        """Every other field not applied has the one reason: NRI cannot make it at this event."""
        assert convert.CANNOT == convert.why_not_applied("pod_cgroup_parent")
        assert convert.CANNOT == convert.why_not_applied("env[MODE]")


class TestResourcesUpdate:
    def test_memory_and_quota(self) -> None:
        """An update carries the changed fields only, with NRI's optional wrappers."""
        before = Resources(cpu_quota=100, memory_limit_in_bytes=1)
        resources, missing = convert.resources_update(
            before, attrs.evolve(before, cpu_quota=-1, memory_limit_in_bytes=5)
        )
        assert [] == missing
        assert (
            api.LinuxResources(
                cpu=api.LinuxCpu(quota=api.OptionalInt64(value=-1)),
                memory=api.LinuxMemory(limit=api.OptionalInt64(value=5)),
            )
            == resources
        )

    def test_swap_at_an_update(self) -> None:
        """An update's swap is named, not sent: containerd drops it (``LinuxResources.ToCRI``)."""
        before = Resources(memory_limit_in_bytes=1, memory_swap_limit_in_bytes=1)
        resources, missing = convert.resources_update(
            before, attrs.evolve(before, memory_swap_limit_in_bytes=9)
        )
        assert (None, ["memory_swap_limit_in_bytes"]) == (resources, missing)

    def test_every_scalar_it_writes_reads_back(self) -> None:
        """resources_update and resources_from_nri go by one table: every field set from nothing comes back
        from NRI's resources as it was (oom_score_adj and hugepages are not NRI resources, and a swap limit
        is not sent: left out)."""
        after = attrs.evolve(
            FULL_RESOURCES, oom_score_adj=0, hugepage_limits=(), memory_swap_limit_in_bytes=0
        )
        resources, missing = convert.resources_update(Resources(), after)
        assert [] == missing and resources is not None
        assert after == convert.resources_from_nri(upb(resources))

    def test_pod_changes(self) -> None:
        """Every pod field a hook changed is named (NRI applies none)."""
        before = convert.pod_from_nri(POD)
        after = attrs.evolve(before, labels={"app": "web", "x": "1"}, annotations={}, cgroup_parent="/other")
        assert ("annotations[a]", "cgroup_parent", "labels[x]") == convert.pod_changes(before, after)


@pytest.mark.parametrize(
    ("annotations", "wrong"),
    [
        ({convert.SANDBOX_NAME: "web", convert.SANDBOX_NAMESPACE: "prod"}, False),
        ({}, False),  # a config without metadata: empty names, no other pod
        ({convert.SANDBOX_NAME: "", convert.SANDBOX_NAMESPACE: ""}, False),
        ({convert.SANDBOX_NAME: "other", convert.SANDBOX_NAMESPACE: "prod"}, True),
        ({convert.SANDBOX_NAME: "web", convert.SANDBOX_NAMESPACE: "elsewhere"}, True),
        ({convert.SANDBOX_NAME: "web"}, True),
        ({convert.SANDBOX_NAME: "web", convert.SANDBOX_NAMESPACE: "prod", convert.SANDBOX_UID: "u1"}, False),
        ({convert.SANDBOX_NAME: "web", convert.SANDBOX_NAMESPACE: "prod", convert.SANDBOX_UID: "u2"}, True),
        ({convert.SANDBOX_NAME: "web", convert.SANDBOX_NAMESPACE: "prod", convert.SANDBOX_UID: ""}, True),
        ({convert.SANDBOX_UID: "u2"}, True),
    ],
)
def test_another_pod_named_in_the_spec(annotations: dict[str, str], wrong: bool) -> None:
    """A created container whose spec annotations name another pod than its sandbox (containerd writes
    them from the request's sandbox_config), or another uid, is found, with both pods named; the pod's own
    names, or none at all, are not."""
    info = ContainerInfo(
        pod=PodInfo(name="web", namespace="prod", uid="u1"), name="app", annotations=annotations
    )
    got = convert.another_pod_named(info)
    assert wrong == (got is not None), got
    if got is not None:
        assert "pod prod/web (uid 'u1') carries the sandbox_config of" in got
