"""Fuzzing the merge rules with plugin answers (hypothesis): well-typed random answers, and random bytes as a
plugin may send them.

Invariants (Koordinator's rules, krproxy/hooks/merge.py): a merge never raises; annotations and labels are
added or overwritten, never lost; a container answer with resources always overwrites the cpusets (even
with ""). For raw bytes, the dispatcher's gate: whatever decodes with every field of its declared type
(:func:`krproxy.hooks.convert.wrong_types`) is read into an answer record, checked
(:func:`krproxy.hooks.validate.check_answer`) and, if it passes, merged, none of which raises. Budget: tests/fuzz/__init__.py.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from krproxy.hooks.convert import (
    answer_from_hook,
    pod_from_run_request,
    wrong_types,
)
from krproxy.hooks.merge import merge_container_info
from krproxy.hooks.model import ContainerAnswer, ContainerInfo, PodInfo
from krproxy.hooks.validate import check_answer
from krproxy.hooks.writeback import merge_pod
from krproxy.proto.runtime import v1, v1alpha1
from tests.fuzz import INT64, examples, linux_resources
from tests.oracles import container_from_create_request, merge_create_container

FUZZ = settings(max_examples=examples(150), deadline=None)

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
string_maps = st.dictionaries(names, names, max_size=4)
int64 = INT64
cpusets = st.sampled_from(["", "0", "0-3", "1,3", "0-3,8-11"]) | names

hook_resources = linux_resources(
    v1alpha1.LinuxContainerResources, cpusets, unified=string_maps, memory_swap_limit_in_bytes=int64
)
container_answers = st.builds(
    v1alpha1.ContainerResourceHookResponse,
    container_annotations=string_maps,
    container_resources=st.none() | hook_resources,
    pod_cgroup_parent=names,
    container_envs=string_maps,
)
pod_answers = st.builds(
    v1alpha1.PodSandboxHookResponse,
    labels=string_maps,
    annotations=string_maps,
    cgroup_parent=names,
    resources=st.none() | hook_resources,
)
cri_resources = linux_resources(v1.LinuxContainerResources, cpusets)
create_requests = st.builds(
    lambda annotations, envs, resources: v1.CreateContainerRequest(
        pod_sandbox_id="pod",
        config=v1.ContainerConfig(
            metadata=v1.ContainerMetadata(name="app"),
            annotations=annotations,
            envs=[v1.KeyValue(key=k, value=v.encode()) for k, v in envs.items()],
            linux=v1.LinuxContainerConfig(resources=resources),
        ),
        sandbox_config=v1.PodSandboxConfig(linux=v1.LinuxPodSandboxConfig(cgroup_parent="/kubepods/pod")),
    ),
    string_maps,
    string_maps,
    cri_resources,
)
run_requests = st.builds(
    lambda labels, annotations: v1.RunPodSandboxRequest(
        config=v1.PodSandboxConfig(
            metadata=v1.PodSandboxMetadata(name="web", uid="u", namespace="ns"),
            labels=labels,
            annotations=annotations,
            linux=v1.LinuxPodSandboxConfig(cgroup_parent="/kubepods/pod"),
        )
    ),
    string_maps,
    string_maps,
)


class TestFuzzContainerMerge:
    @FUZZ
    @given(create_requests, container_answers)
    def test_annotations_kept_and_cpusets_overwritten(
        self, request: v1.CreateContainerRequest, answer: v1alpha1.ContainerResourceHookResponse
    ) -> None:
        """Any well-typed answer merges; the request's annotations survive unless the answer overwrote them,
        and answered resources set the cpusets, even to ""."""
        merged = merge_create_container(request, answer).value

        assert request.config is not None and merged.config is not None
        expected = {**request.config.annotations, **answer.container_annotations}
        assert expected == merged.config.annotations
        resources = merged.config.linux.resources  # type: ignore[union-attr]
        assert resources is not None
        if answer.container_resources is not None:
            assert answer.container_resources.cpuset_cpus == resources.cpuset_cpus
            assert answer.container_resources.cpuset_mems == resources.cpuset_mems
        else:
            assert request.config.linux.resources == resources  # type: ignore[union-attr]

    @FUZZ
    @given(run_requests, pod_answers)
    def test_pod_labels_and_annotations_never_lost(
        self, request: v1.RunPodSandboxRequest, answer: v1alpha1.PodSandboxHookResponse
    ) -> None:
        """Any well-typed pod answer merges; labels and annotations are added or overwritten, never lost."""
        merged = merge_pod(request, answer).value

        assert request.config is not None and merged.config is not None
        assert {**request.config.labels, **answer.labels} == merged.config.labels
        assert {**request.config.annotations, **answer.annotations} == merged.config.annotations


class TestFuzzRawAnswers:
    @FUZZ
    @given(create_requests, st.binary(max_size=256))
    def test_random_bytes_never_break_a_merge_past_validation(
        self, request: v1.CreateContainerRequest, data: bytes
    ) -> None:
        """Bytes from a plugin: they fail to decode, or have fields of the wrong type, or validation rejects
        them, or they merge without raising."""
        record = container_from_create_request(request, pod_from_run_request(v1.RunPodSandboxRequest()))
        for answer_type in (v1alpha1.ContainerResourceHookResponse, v1alpha1.PodSandboxHookResponse):
            try:
                answer = answer_type.FromString(data)
            except Exception:
                continue  # does not decode: a plugin failure
            _gate_and_merge(record, answer)

    @FUZZ
    @given(create_requests, pod_answers)
    def test_pod_answer_to_a_container_hook(
        self, request: v1.CreateContainerRequest, wrong: v1alpha1.PodSandboxHookResponse
    ) -> None:
        """A plugin answering a container hook with a pod answer (decoded as the container type): rejected by
        validation or merged without raising."""
        record = container_from_create_request(request, PodInfo())
        try:
            answer = v1alpha1.ContainerResourceHookResponse.FromString(bytes(wrong.SerializeToString()))
        except Exception:
            return
        _gate_and_merge(record, answer)


def _gate_and_merge(
    record: ContainerInfo, answer: v1alpha1.ContainerResourceHookResponse | v1alpha1.PodSandboxHookResponse
) -> None:
    """The dispatcher's steps for a decoded answer: type check, read, check, merge (raising in none)."""
    if wrong_types(answer):
        return  # a plugin failure
    read = answer_from_hook(answer)
    if not check_answer(record, read) and isinstance(read, ContainerAnswer):
        merge_container_info(record, read)
