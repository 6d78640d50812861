"""Conversions between CRI/hook-protocol messages and hook records (krproxy.hooks.convert)."""

from __future__ import annotations

import typing

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from krproxy.hooks import encode
from krproxy.hooks.convert import (
    answer_from_hook,
    container_answer,
    container_from_wire_create,
    envs_from_cri,
    pod_answer,
    pod_from_run_request,
    resources_from_cri,
    resources_from_hook,
    update_request_resources,
    wrong_types,
)
from krproxy.hooks.merge import prepare_update
from krproxy.hooks.model import (
    RESOURCE_SCALARS,
    RESOURCE_STRINGS,
    ContainerAnswer,
    ContainerInfo,
    PodAnswer,
    PodInfo,
    Resources,
)
from krproxy.hooks.rewrite import CreateContainerRequest
from krproxy.hooks.writeback import resources_to_cri, resources_to_hook
from krproxy.proto.runtime import v1, v1alpha1
from tests.records import FULL_RESOURCES, WEB_POD


def pod_hook_request(pod: PodInfo) -> v1alpha1.PodSandboxHookRequest:
    """The PodSandboxHookRequest a hook server receives for *pod* (the encoder's bytes, decoded)."""
    return v1alpha1.PodSandboxHookRequest.FromString(encode.pod_request(pod))


def container_hook_request(info: ContainerInfo) -> v1alpha1.ContainerResourceHookRequest:
    """The ContainerResourceHookRequest a hook server receives for *info* (the encoder's bytes, decoded)."""
    return v1alpha1.ContainerResourceHookRequest.FromString(encode.container_request(info))


RESOURCES = FULL_RESOURCES

RUN = v1.RunPodSandboxRequest(
    config=v1.PodSandboxConfig(
        metadata=v1.PodSandboxMetadata(name="web", uid="u1", namespace="default", attempt=2),
        labels={"app": "web"},
        annotations={"a": "1"},
        linux=v1.LinuxPodSandboxConfig(
            cgroup_parent="/kubepods/podu1", resources=resources_to_cri(Resources(cpu_shares=2))
        ),
    ),
    runtime_handler="runc",
)

POD = attrs.evolve(WEB_POD, attempt=2)

CREATE = v1.CreateContainerRequest(
    pod_sandbox_id="sb1",
    config=v1.ContainerConfig(
        metadata=v1.ContainerMetadata(name="app", attempt=1),
        annotations={"c": "1"},
        envs=[
            v1.KeyValue(key="A", value=b"1"),
            v1.KeyValue(key="B", value=b"2"),
            v1.KeyValue(key="A", value=b"3"),
        ],
        linux=v1.LinuxContainerConfig(resources=resources_to_cri(RESOURCES)),
    ),
    sandbox_config=v1.PodSandboxConfig(linux=v1.LinuxPodSandboxConfig(cgroup_parent="/kubepods/podu1")),
)

CONTAINER = ContainerInfo(
    pod_sandbox_id="sb1",
    pod=POD,
    name="app",
    attempt=1,
    annotations={"c": "1"},
    resources=RESOURCES,
    envs={"A": "3", "B": "2"},
    pod_cgroup_parent="/kubepods/podu1",
)


def hook_pod_meta() -> v1alpha1.PodSandboxMetadata:
    return v1alpha1.PodSandboxMetadata(name="web", uid="u1", namespace="default", attempt=2)


def expected_container_request(
    container_id: str, resources: Resources
) -> v1alpha1.ContainerResourceHookRequest:
    return v1alpha1.ContainerResourceHookRequest(
        pod_meta=hook_pod_meta(),
        container_meta=v1alpha1.ContainerMetadata(name="app", attempt=1, id=container_id),
        container_annotations={"c": "1"},
        container_resources=resources_to_hook(resources),
        pod_resources=None,
        pod_annotations={"a": "1"},
        pod_labels={"app": "web"},
        pod_cgroup_parent="/kubepods/podu1",
        container_envs={"A": "3", "B": "2"},
    )


def from_create(request: v1.CreateContainerRequest, pod: PodInfo) -> ContainerInfo:
    """The record the request path reads from *request*'s bytes (decoded with upb, as kubelet's arrive)."""
    return container_from_wire_create(
        CreateContainerRequest.FromString(bytes(request.SerializeToString())), pod
    )


class TestFromCriRequests:
    def test_pod_from_run_request(self) -> None:
        """RunPodSandbox gives meta, handler, labels, annotations, cgroup parent; never resources."""
        assert POD == pod_from_run_request(RUN)

    def test_container_from_create_request(self) -> None:
        """CreateContainer gives meta, annotations, resources, envs (later wins) and the sandbox's cgroup
        parent, with the stored pod."""
        assert CONTAINER == from_create(CREATE, POD)

    def test_missing_linux_gives_zero_resources(self) -> None:
        """Container resources are always present, zero when the request has none."""
        request = v1.CreateContainerRequest(pod_sandbox_id="sb1", config=v1.ContainerConfig())

        assert Resources() == from_create(request, POD).resources

    def test_env_order_first_seen(self) -> None:
        """Env names keep their first position while the later value wins."""
        envs = [v1.KeyValue(key=k, value=v) for k, v in [("Z", b"1"), ("A", b"2"), ("Z", b"3")]]

        assert [("Z", "3"), ("A", "2")] == list(envs_from_cri(envs).items())


class TestHookRequests:
    """The hook request each hook point sends (hook-semantics.md 2.3)."""

    def test_pre_run_pod_sandbox(self) -> None:
        """PreRunPodSandbox: pod meta, handler, labels, annotations, cgroup parent; no resources/overhead."""
        expected = v1alpha1.PodSandboxHookRequest(
            pod_meta=hook_pod_meta(),
            runtime_handler="runc",
            labels={"app": "web"},
            annotations={"a": "1"},
            cgroup_parent="/kubepods/podu1",
        )

        assert expected == pod_hook_request(pod_from_run_request(RUN))

    def test_post_stop_pod_sandbox(self) -> None:
        """PostStopPodSandbox sends the stored pod record."""
        assert pod_hook_request(POD) == pod_hook_request(pod_from_run_request(RUN))

    def test_pre_create_container(self) -> None:
        """PreCreateContainer: container fields from the request, pod fields from the store, empty id."""
        actual = container_hook_request(from_create(CREATE, POD))

        assert expected_container_request("", RESOURCES) == actual

    @pytest.mark.parametrize("hook", ["PreStartContainer", "PostStartContainer", "PostStopContainer"])
    def test_stored_container(self, hook: str) -> None:
        """Start/Stop hooks send the stored record, which carries the runtime's container id."""
        stored = _with_id(from_create(CREATE, POD), "c1")

        assert expected_container_request("c1", RESOURCES) == container_hook_request(stored)

    def test_pre_update_container_resources(self) -> None:
        """PreUpdateContainerResources sends the stored record with the request's resources merged in."""
        stored = _with_id(from_create(CREATE, POD), "c1")
        request = v1.UpdateContainerResourcesRequest(
            container_id="c1", linux=v1.LinuxContainerResources(cpu_shares=4, oom_score_adj=5)
        )

        actual = container_hook_request(prepare_update(stored, update_request_resources(request)))

        expected_resources = attrs.evolve(RESOURCES, cpu_shares=4)
        assert expected_container_request("c1", expected_resources) == actual

    def test_unknown_resources_absent(self) -> None:
        """A recovered container without known resources sends no container_resources."""
        request = container_hook_request(ContainerInfo(pod=POD, name="app"))

        assert request.container_resources is None

    def test_undecodable_env_value(self) -> None:
        """An env value that is not UTF-8 is sent with U+FFFD and the request serializes."""
        info = from_create(
            v1.CreateContainerRequest(
                config=v1.ContainerConfig(envs=[v1.KeyValue(key="X", value=b"a\xffb")])
            ),
            POD,
        )

        request = container_hook_request(info)

        assert {"X": "a\ufffdb"} == request.container_envs
        assert request == v1alpha1.ContainerResourceHookRequest.FromString(request.SerializeToString())


def _with_id(info: ContainerInfo, container_id: str) -> ContainerInfo:
    return attrs.evolve(info, id=container_id)


resources_strategy = st.builds(
    Resources,
    cpu_period=st.integers(-(2**63), 2**63 - 1),
    cpu_quota=st.integers(-(2**63), 2**63 - 1),
    cpu_shares=st.integers(0, 2**62),
    memory_limit_in_bytes=st.integers(0, 2**62),
    oom_score_adj=st.integers(-1000, 1000),
    cpuset_cpus=st.text(max_size=8),
    cpuset_mems=st.text(max_size=8),
    hugepage_limits=st.lists(st.tuples(st.text(max_size=4), st.integers(0, 2**64 - 1)), max_size=3),
    unified=st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3),
    memory_swap_limit_in_bytes=st.integers(0, 2**62),
)


class TestResources:
    @given(resources_strategy)
    def test_round_trip(self, resources: Resources) -> None:
        """Resources survive domain → CRI → wire → domain and domain → hook → wire → domain."""
        cri = v1.LinuxContainerResources.FromString(resources_to_cri(resources).SerializeToString())
        hook = v1alpha1.LinuxContainerResources.FromString(resources_to_hook(resources).SerializeToString())

        assert (resources, resources) == (resources_from_cri(cri), resources_from_hook(hook))

    def test_absent(self) -> None:
        """Absent CRI resources are zero; absent hook resources stay absent."""
        assert (Resources(), None) == (resources_from_cri(None), resources_from_hook(None))

    def test_the_string_scalars_are_the_str_fields(self) -> None:
        """RESOURCE_STRINGS, which the JSON and Docker readers and the answer type check go by, names
        exactly the scalars the record holds as str, in RESOURCE_SCALARS' order."""
        hints = typing.get_type_hints(Resources)
        assert tuple(name for name in RESOURCE_SCALARS if hints[name] is str) == RESOURCE_STRINGS


class TestAnswers:
    def test_every_field_of_a_container_answer(self) -> None:
        """Each field of the hook protocol's container answer lands in its field of the record."""
        answer = v1alpha1.ContainerResourceHookResponse(
            container_annotations={"a": "1"},
            container_resources=resources_to_hook(RESOURCES),
            pod_cgroup_parent="/kubepods/p",
            container_envs={"E": "2"},
        )

        expected = ContainerAnswer(
            annotations={"a": "1"}, resources=RESOURCES, pod_cgroup_parent="/kubepods/p", envs={"E": "2"}
        )
        assert (expected, expected) == (container_answer(answer), answer_from_hook(answer))

    def test_every_field_of_a_pod_answer(self) -> None:
        """Each field of the hook protocol's pod answer lands in its field of the record."""
        answer = v1alpha1.PodSandboxHookResponse(
            labels={"l": "1"},
            annotations={"a": "2"},
            cgroup_parent="/kubepods/p",
            resources=resources_to_hook(RESOURCES),
        )

        expected = PodAnswer(
            labels={"l": "1"}, annotations={"a": "2"}, cgroup_parent="/kubepods/p", resources=RESOURCES
        )
        assert (expected, expected) == (pod_answer(answer), answer_from_hook(answer))

    def test_resources_keep_their_presence(self) -> None:
        """An answer without resources has none (changes nothing); one with empty resources has zero ones."""
        absent = v1alpha1.ContainerResourceHookResponse.FromString(b"")
        empty = v1alpha1.ContainerResourceHookResponse.FromString(b"\x12\x00")

        assert (None, Resources()) == (container_answer(absent).resources, container_answer(empty).resources)
        assert (PodAnswer(), ContainerAnswer()) == (
            pod_answer(v1alpha1.PodSandboxHookResponse()),
            container_answer(absent),
        )


class TestWrongTypes:
    @pytest.mark.parametrize(
        ("raw", "expected"),
        [
            (b"\x18\x05", ["pod_cgroup_parent"]),  # a varint for the string
            (b"\x10\x05", ["container_resources"]),  # a varint for the message
            (b"\x0a\x02\x08\x01", ["container_annotations"]),  # a map entry with an int key
            (b"\x12\x02\x30\x05", ["container_resources.cpuset_cpus"]),
            (b"\x12\x02\x0a\x00", ["container_resources.cpu_period"]),  # a string for an int
            (b"\x22\x02\x08\x01", ["container_envs"]),
        ],
    )
    def test_loosely_decoded_container_answers(self, raw: bytes, expected: list[str]) -> None:
        """betterproto2 decodes these despite their wire types; each wrong field is named."""
        answer = v1alpha1.ContainerResourceHookResponse.FromString(raw)

        assert expected == wrong_types(answer)

    def test_loosely_decoded_pod_answer(self) -> None:
        """The pod answer's fields are checked alike."""
        answer = v1alpha1.PodSandboxHookResponse.FromString(b"\x18\x05\x20\x01")

        assert ["resources", "cgroup_parent"] == wrong_types(answer)

    def test_well_typed_answers_pass(self) -> None:
        """Every field set with its own type: nothing to report, for both answer types and unknown ones."""
        container = v1alpha1.ContainerResourceHookResponse(
            container_annotations={"a": "b"},
            container_resources=v1alpha1.LinuxContainerResources(
                cpu_quota=-1,
                cpuset_cpus="0",
                unified={"k": "v"},
                hugepage_limits=[v1alpha1.HugepageLimit("2MB", 1)],
            ),
            pod_cgroup_parent="/kubepods",
            container_envs={"E": "1"},
        )
        pod = v1alpha1.PodSandboxHookResponse(
            labels={"l": "v"}, cgroup_parent="/kubepods", resources=v1alpha1.LinuxContainerResources()
        )

        assert ([], [], []) == (wrong_types(container), wrong_types(pod), wrong_types(object()))
