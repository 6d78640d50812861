"""Koordinator's merge rules (krproxy.hooks.merge), table by table."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from krproxy.hooks.convert import update_request_resources
from krproxy.hooks.merge import (
    Change,
    merge_container_info,
    prepare_update,
    update_resource,
    update_resource_by_update_request,
)
from krproxy.hooks.model import ContainerAnswer, ContainerInfo, PodInfo, Resources
from krproxy.hooks.writeback import (
    apply_update,
    merge_pod,
    merge_update_container,
    resources_to_cri,
    resources_to_hook,
)
from krproxy.proto.runtime import v1, v1alpha1
from tests.oracles import container_from_create_request, merge_create_container
from tests.records import FULL_RESOURCES

#: What the merge tables start from: every field set (their expectations name its values).
BASE = attrs.evolve(FULL_RESOURCES, cpu_quota=200_000, cpu_shares=2048, unified={"memory.high": "100"})


def run_request() -> v1.RunPodSandboxRequest:
    return v1.RunPodSandboxRequest(
        config=v1.PodSandboxConfig(
            metadata=v1.PodSandboxMetadata(name="web", uid="u1", namespace="default", attempt=1),
            labels={"app": "web"},
            annotations={"a": "1", "b": "2"},
            linux=v1.LinuxPodSandboxConfig(cgroup_parent="/kubepods/burstable/podu1"),
        ),
        runtime_handler="runc",
    )


def create_request(envs: list[tuple[str, str]] | None = None) -> v1.CreateContainerRequest:
    return v1.CreateContainerRequest(
        pod_sandbox_id="sb1",
        config=v1.ContainerConfig(
            metadata=v1.ContainerMetadata(name="app", attempt=0),
            annotations={"c": "1"},
            envs=[
                v1.KeyValue(key=k, value=v.encode())
                for k, v in (envs if envs is not None else [("B", "1"), ("A", "2")])
            ],
            linux=v1.LinuxContainerConfig(resources=_cri(BASE)),
        ),
        sandbox_config=v1.PodSandboxConfig(linux=v1.LinuxPodSandboxConfig(cgroup_parent="/kubepods/podu1")),
    )


def _known(r: Resources | None) -> Resources:
    assert r is not None
    return r


def _cri(r: Resources | None) -> v1.LinuxContainerResources:
    return resources_to_cri(_known(r))


def envs_of(request: v1.CreateContainerRequest) -> list[tuple[str, str]]:
    assert request.config is not None
    return [(kv.key, kv.value.decode()) for kv in request.config.envs]


def resources_of(request: v1.CreateContainerRequest) -> v1.LinuxContainerResources:
    assert request.config is not None and request.config.linux is not None
    assert request.config.linux.resources is not None
    return request.config.linux.resources


class TestUpdateResource:
    @pytest.mark.parametrize(
        ("field", "answer", "expected"),
        [
            ("cpu_period", 0, 100000),
            ("cpu_period", -5, 100000),
            ("cpu_period", 50000, 50000),
            ("cpu_quota", 0, 200000),
            ("cpu_quota", -1, -1),
            ("cpu_quota", 300000, 300000),
            ("cpu_shares", 0, 2048),
            ("cpu_shares", 2, 2),
            ("memory_limit_in_bytes", 0, 1 << 30),
            ("memory_limit_in_bytes", 5, 5),
            ("memory_swap_limit_in_bytes", 0, 2 << 30),
            ("memory_swap_limit_in_bytes", 7, 7),
            ("oom_score_adj", 0, 0),
            ("oom_score_adj", 1000, 1000),
            ("oom_score_adj", -1000, -1000),
            ("oom_score_adj", 1001, -997),
            ("oom_score_adj", -1001, -997),
            ("cpuset_cpus", "", ""),
            ("cpuset_cpus", "4-7", "4-7"),
            ("cpuset_mems", "", ""),
            ("cpuset_mems", "1", "1"),
        ],
    )
    def test_field_rule(self, field: str, answer: Any, expected: Any) -> None:
        """Each field of the answer is taken or not according to Koordinator's updateResource."""
        merged = update_resource(BASE, Resources(**{field: answer}))

        assert expected == getattr(merged, field)

    def test_unified_merged_and_hugepages_kept(self) -> None:
        """unified is add/overwrite; hugepage_limits never come from the answer."""
        answer = Resources(unified={"memory.high": "200", "cpu.weight": "5"}, hugepage_limits=[("1GB", 1)])

        merged = update_resource(BASE, answer)

        assert {"memory.high": "200", "cpu.weight": "5"} == dict(merged.unified)
        assert (("2MB", 1 << 21),) == merged.hugepage_limits

    def test_no_answer_resources(self) -> None:
        """An answer without resources leaves them unchanged."""
        assert BASE == update_resource(BASE, None)


class TestUpdateResourceByUpdateRequest:
    @pytest.mark.parametrize(
        ("field", "request_value", "expected"),
        [
            ("cpu_period", 0, 100000),
            ("cpu_period", 1, 1),
            ("cpu_quota", 0, 200000),
            ("cpu_quota", -1, -1),
            ("cpu_shares", 0, 2048),
            ("cpu_shares", 3, 3),
            ("memory_limit_in_bytes", 0, 1 << 30),
            ("memory_limit_in_bytes", 9, 9),
            ("memory_swap_limit_in_bytes", 0, 2 << 30),
            ("memory_swap_limit_in_bytes", 9, 9),
            ("oom_score_adj", 0, -997),
            ("oom_score_adj", 500, -997),
            ("cpuset_cpus", "", "0-3"),
            ("cpuset_cpus", "8", "8"),
            ("cpuset_mems", "", "0"),
            ("cpuset_mems", "1", "1"),
        ],
    )
    def test_field_rule(self, field: str, request_value: Any, expected: Any) -> None:
        """The request's resources update the stored ones positive-only, cpusets if non-empty, never oom."""
        merged = update_resource_by_update_request(BASE, Resources(**{field: request_value}))

        assert expected == getattr(merged, field)


class TestMergePod:
    def test_labels_annotations_added_never_deleted(self) -> None:
        """Answer labels/annotations are added or overwrite; keys missing from the answer stay."""
        answer = v1alpha1.PodSandboxHookResponse(labels={"tier": "be"}, annotations={"b": "20", "z": "9"})

        merged = merge_pod(run_request(), answer)

        assert merged.value.config is not None
        assert {"app": "web", "tier": "be"} == merged.value.config.labels
        assert {"a": "1", "b": "20", "z": "9"} == merged.value.config.annotations

    @pytest.mark.parametrize(
        ("answer_parent", "expected"),
        [("", "/kubepods/burstable/podu1"), ("/kubepods/besteffort/podu1", "/kubepods/besteffort/podu1")],
    )
    def test_cgroup_parent(self, answer_parent: str, expected: str) -> None:
        """The cgroup parent is replaced only by a non-empty answer."""
        merged = merge_pod(run_request(), v1alpha1.PodSandboxHookResponse(cgroup_parent=answer_parent))

        assert merged.value.config is not None and merged.value.config.linux is not None
        assert expected == merged.value.config.linux.cgroup_parent

    def test_resources_ignored(self) -> None:
        """Answer resources are not written anywhere in CRI mode."""
        request = run_request()
        answer = v1alpha1.PodSandboxHookResponse(resources=resources_to_hook(Resources(cpu_shares=2)))

        merged = merge_pod(request, answer)

        assert request == merged.value
        assert () == merged.changes

    def test_changes_and_no_mutation(self) -> None:
        """The changes describe the decision and the input request is left alone."""
        request = run_request()
        before = request.SerializeToString()
        answer = v1alpha1.PodSandboxHookResponse(annotations={"b": "20"}, cgroup_parent="/x")

        merged = merge_pod(request, answer)

        assert (
            Change("annotations[b]", "2", "20"),
            Change("cgroup_parent", "/kubepods/burstable/podu1", "/x"),
        ) == merged.changes
        assert before == request.SerializeToString()


class TestMergeCreateContainer:
    def test_empty_container_resources_clears_cpusets_and_oom(self) -> None:
        """container_resources{} clears both cpusets and resets oom_score_adj to 0, keeps the rest."""
        answer = v1alpha1.ContainerResourceHookResponse(
            container_resources=v1alpha1.LinuxContainerResources()
        )

        merged = merge_create_container(create_request(), answer)

        expected = attrs.evolve(BASE, cpuset_cpus="", cpuset_mems="", oom_score_adj=0)
        assert _cri(expected) == resources_of(merged.value)

    def test_quota_minus_one_applied(self) -> None:
        """A quota of −1 (unlimited) from the plugin is applied."""
        answer = v1alpha1.ContainerResourceHookResponse(
            container_resources=resources_to_hook(attrs.evolve(BASE, cpu_quota=-1))
        )

        merged = merge_create_container(create_request(), answer)

        assert -1 == resources_of(merged.value).cpu_quota
        assert (Change("resources.cpu_quota", 200000, -1),) == merged.changes

    def test_no_container_resources_keeps_them(self) -> None:
        """An answer without container_resources leaves the request's resources unchanged."""
        merged = merge_create_container(create_request(), v1alpha1.ContainerResourceHookResponse())

        assert _cri(BASE) == resources_of(merged.value)

    def test_annotations_never_deleted(self) -> None:
        """Container annotations are add/overwrite."""
        answer = v1alpha1.ContainerResourceHookResponse(container_annotations={"d": "2"})

        merged = merge_create_container(create_request(), answer)

        assert merged.value.config is not None
        assert {"c": "1", "d": "2"} == merged.value.config.annotations

    @pytest.mark.parametrize(
        ("answer_parent", "expected"), [("", "/kubepods/podu1"), ("/kubepods/be/podu1", "/kubepods/be/podu1")]
    )
    def test_pod_cgroup_parent(self, answer_parent: str, expected: str) -> None:
        """A non-empty pod_cgroup_parent goes to sandbox_config.linux.cgroup_parent; an empty one changes
        nothing."""
        answer = v1alpha1.ContainerResourceHookResponse(pod_cgroup_parent=answer_parent)

        merged = merge_create_container(create_request(), answer)

        assert merged.value.sandbox_config is not None and merged.value.sandbox_config.linux is not None
        assert expected == merged.value.sandbox_config.linux.cgroup_parent

    @pytest.mark.parametrize(
        ("original", "answer", "expected"),
        [
            # No envs in the answer: rebuilt from the request, duplicates collapsed (later wins), order kept.
            ([("B", "1"), ("A", "2"), ("B", "3")], {}, [("B", "3"), ("A", "2")]),
            # Replacement: dropped names go, kept names keep position, new names follow sorted.
            (
                [("B", "1"), ("A", "2"), ("C", "0")],
                {"Z": "z", "A": "x", "M": "m"},
                [("A", "x"), ("M", "m"), ("Z", "z")],
            ),
            ([], {"Y": "1", "X": "2"}, [("X", "2"), ("Y", "1")]),
        ],
    )
    def test_envs(
        self, original: list[tuple[str, str]], answer: dict[str, str], expected: list[tuple[str, str]]
    ) -> None:
        """A non-empty env map replaces the env set; config.envs is always rebuilt in a deterministic order."""
        merged = merge_create_container(
            create_request(original), v1alpha1.ContainerResourceHookResponse(container_envs=answer)
        )

        assert expected == envs_of(merged.value)

    def test_unknown_fields_kept_and_input_untouched(self) -> None:
        """Unknown fields of the request survive the merge; the input is not modified."""
        wire = create_request().SerializeToString() + b"\xa8\x06\x01"  # field 101, varint 1
        request = v1.CreateContainerRequest.FromString(wire)
        answer = v1alpha1.ContainerResourceHookResponse(container_annotations={"d": "2"})

        merged = merge_create_container(request, answer)

        assert merged.value.SerializeToString().endswith(b"\xa8\x06\x01")
        assert wire == request.SerializeToString()


class TestMergeContainerInfo:
    def test_pre_start_updates_record_only(self) -> None:
        """A PreStartContainer answer yields the updated record and the changes."""
        info = ContainerInfo(name="app", id="c1", resources=BASE, envs={"A": "1"})
        answer = ContainerAnswer(
            annotations={"x": "y"}, resources=attrs.evolve(BASE, cpu_shares=4), envs={"A": "2"}
        )

        merged = merge_container_info(info, answer)

        expected = attrs.evolve(
            info, annotations={"x": "y"}, resources=attrs.evolve(BASE, cpu_shares=4), envs={"A": "2"}
        )
        assert expected == merged.value
        assert (
            Change("annotations[x]", None, "y"),
            Change("resources.cpu_shares", 2048, 4),
            Change("envs[A]", "1", "2"),
        ) == merged.changes

    def test_unknown_resources_stay_unknown(self) -> None:
        """Without stored resources the answer's resources are not merged (Koordinator: a == nil)."""
        info = ContainerInfo(name="app")
        answer = ContainerAnswer(resources=BASE)

        assert info == merge_container_info(info, answer).value


class TestMergeUpdateContainer:
    def stored(self) -> ContainerInfo:
        return container_from_create_request(create_request(), PodInfo(name="web"))

    def test_request_then_answer(self) -> None:
        """The request updates the stored resources (not oom), the answer is merged on top, linux replaced."""
        request = v1.UpdateContainerResourcesRequest(
            container_id="c1",
            linux=v1.LinuxContainerResources(cpu_shares=512, oom_score_adj=100, cpuset_cpus=""),
        )
        prepared = prepare_update(self.stored(), update_request_resources(request))
        answer = v1alpha1.ContainerResourceHookResponse(
            container_resources=resources_to_hook(attrs.evolve(_known(prepared.resources), cpu_quota=-1))
        )

        merged = merge_update_container(request, self.stored(), answer)

        assert merged.value.linux == _cri(attrs.evolve(BASE, cpu_shares=512, cpu_quota=-1))

    def test_annotations(self) -> None:
        """Annotations: the request's own, then stored ∪ answer on top."""
        request = v1.UpdateContainerResourcesRequest(container_id="c1", annotations={"c": "req", "r": "1"})
        answer = v1alpha1.ContainerResourceHookResponse(container_annotations={"n": "2"})

        merged = merge_update_container(request, self.stored(), answer)

        assert {"c": "1", "r": "1", "n": "2"} == merged.value.annotations

    def test_unknown_stored_resources_use_request(self) -> None:
        """Stored resources unknown (recovered): the request's resources are the base, oom included."""
        request = v1.UpdateContainerResourcesRequest(
            linux=v1.LinuxContainerResources(cpu_shares=5, oom_score_adj=3)
        )

        prepared = prepare_update(ContainerInfo(name="app"), update_request_resources(request))

        assert Resources(cpu_shares=5, oom_score_adj=3) == prepared.resources

    def test_unknown_everything_leaves_linux_alone(self) -> None:
        """No stored resources and none in the request: the request's linux stays absent."""
        request = v1.UpdateContainerResourcesRequest(container_id="c1")

        assert (
            apply_update(request, prepare_update(ContainerInfo(), update_request_resources(request))).linux
            is None
        )
