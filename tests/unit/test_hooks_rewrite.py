"""krproxy.hooks.rewrite: the request path decodes kubelet's CreateContainer with upb, reads the record from it
(convert.container_from_wire_create) and writes a merged record into it. The record must be the one
tests/oracles.py's container_from_create_request reads from the betterproto2 decode, and the bytes those
its apply_create's betterproto2 message encodes to (the reference of the merge rules), unknown fields and
all. Explicit cases, then hypothesis (budget: tests/fuzz/__init__.py)."""

from __future__ import annotations

import attrs
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from krproxy.hooks.convert import (
    container_answer,
    container_from_wire_create,
    pod_from_run_request,
    pod_from_wire_config,
)
from krproxy.hooks.merge import merge_container_info
from krproxy.hooks.model import ContainerInfo, PodInfo
from krproxy.hooks.restore import RestorePodRequest
from krproxy.hooks.rewrite import CreateContainerRequest, create_request, write_pod_config
from krproxy.hooks.writeback import apply_run_pod
from krproxy.proto.runtime import v1, v1alpha1
from tests.fuzz import INT64, examples, linux_resources
from tests.oracles import apply_create, container_from_create_request

UNKNOWN = b"\xa8\x06\x01"  # field 101, varint 1


def with_unknown(message: v1.LinuxContainerResources) -> v1.LinuxContainerResources:
    return v1.LinuxContainerResources.FromString(bytes(message.SerializeToString()) + UNKNOWN)


def merged_record(wire: bytes, answer: v1alpha1.ContainerResourceHookResponse) -> ContainerInfo:
    request = v1.CreateContainerRequest.FromString(wire)
    return merge_container_info(
        container_from_create_request(request, PodInfo()), container_answer(answer)
    ).value


def expected(wire: bytes, info: ContainerInfo) -> bytes:
    return bytes(apply_create(v1.CreateContainerRequest.FromString(wire), info).SerializeToString())


REQUESTS = {
    "empty": v1.CreateContainerRequest(),
    "empty values and keys, repeated env": v1.CreateContainerRequest(
        pod_sandbox_id="x",
        config=v1.ContainerConfig(
            annotations={"a": "", "": "b"},
            labels={"l": "", "": ""},
            envs=[
                v1.KeyValue(key="A", value=b""),
                v1.KeyValue(key="", value=b"x"),
                v1.KeyValue(key="A", value=b"2"),
            ],
        ),
        sandbox_config=v1.PodSandboxConfig(
            labels={"k": "v"}, linux=v1.LinuxPodSandboxConfig(cgroup_parent="/p")
        ),
    ),
    "resources with unknown fields": v1.CreateContainerRequest(
        config=v1.ContainerConfig(
            linux=v1.LinuxContainerConfig(
                resources=with_unknown(
                    v1.LinuxContainerResources(
                        cpu_shares=2,
                        unified={"a": "", "b": "c"},
                        hugepage_limits=[v1.HugepageLimit(page_size="2M", limit=0)],
                    )
                )
            )
        )
    ),
}
ANSWERS = {
    "nothing": v1alpha1.ContainerResourceHookResponse(),
    "everything": v1alpha1.ContainerResourceHookResponse(
        container_annotations={"z": "", "a": "1"},
        container_envs={"B": "", "A": "é"},
        pod_cgroup_parent="/q",
        container_resources=v1alpha1.LinuxContainerResources(cpu_quota=-1, unified={"x": ""}),
    ),
}


@pytest.mark.parametrize("unknown", [b"", UNKNOWN], ids=["", "unknown field"])
@pytest.mark.parametrize("answer", ANSWERS.values(), ids=ANSWERS.keys())
@pytest.mark.parametrize("request_", REQUESTS.values(), ids=REQUESTS.keys())
def test_same_bytes_as_apply_create(
    request_: v1.CreateContainerRequest, answer: v1alpha1.ContainerResourceHookResponse, unknown: bytes
) -> None:
    wire = bytes(request_.SerializeToString()) + unknown
    info = merged_record(wire, answer)

    assert expected(wire, info) == create_request(CreateContainerRequest.FromString(wire), info)


def test_unknown_resources_leave_linux_alone() -> None:
    """A record with unknown resources (recovered) writes no ``config.linux``; an empty config is still sent."""
    wire = bytes(v1.CreateContainerRequest(pod_sandbox_id="x").SerializeToString())
    info = ContainerInfo(resources=None, annotations={"a": "1"})

    written = v1.CreateContainerRequest.FromString(
        create_request(CreateContainerRequest.FromString(wire), info)
    )

    assert written.config is not None and written.config.linux is None
    assert {"a": "1"} == written.config.annotations


@pytest.mark.parametrize(
    "info", [ContainerInfo(resources=None), ContainerInfo(resources=None, envs={"A": "1"})]
)
def test_a_record_without_resources_as_apply_create(info: ContainerInfo) -> None:
    """Nothing but (maybe) envs to write and no config sent: a config is sent all the same, as apply_create does."""
    wire = bytes(v1.CreateContainerRequest(pod_sandbox_id="x").SerializeToString())

    assert expected(wire, info) == create_request(CreateContainerRequest.FromString(wire), info)


POD_CONFIGS = {
    "absent": None,
    "empty": v1.PodSandboxConfig(),
    "maps, a parent and more": v1.PodSandboxConfig(
        metadata=v1.PodSandboxMetadata(name="p", uid="u"),
        labels={"k": "v", "": ""},
        annotations={"a": ""},
        hostname="h",
        linux=v1.LinuxPodSandboxConfig(cgroup_parent="/p", sysctls={"s": "1"}),
    ),
}
MERGED_PODS = {
    "unchanged parent": PodInfo(labels={"k": "v2", "n": ""}, annotations={"b": "1"}),
    "new parent": PodInfo(labels={}, annotations={"a": "x"}, cgroup_parent="/q"),
}


@pytest.mark.parametrize("pod", MERGED_PODS.values(), ids=MERGED_PODS.keys())
@pytest.mark.parametrize("config", POD_CONFIGS.values(), ids=POD_CONFIGS.keys())
def test_pod_config_same_bytes_as_apply_run_pod(config: v1.PodSandboxConfig | None, pod: PodInfo) -> None:
    """RestorePod's merged pod written into its upb config: the bytes of writeback.apply_run_pod's config."""
    reference = apply_run_pod(v1.RunPodSandboxRequest(config=config), pod).config
    assert reference is not None
    upb = RestorePodRequest()
    if config is not None:
        upb.config.CopyFrom(upb.config.FromString(bytes(config.SerializeToString())))
    write_pod_config(upb.config, pod)

    assert bytes(reference.SerializeToString()) == upb.config.SerializeToString()


def test_undecodable_bytes_raise() -> None:
    with pytest.raises(DecodeError):
        CreateContainerRequest.FromString(b"\x12\x05ab")


def same_records(wire: bytes) -> None:
    """The upb-decoded request gives the records the betterproto2-decoded one gives."""
    reference = v1.CreateContainerRequest.FromString(wire)
    upb = CreateContainerRequest.FromString(wire)
    pod = pod_from_run_request(v1.RunPodSandboxRequest(config=reference.sandbox_config))
    assert pod == pod_from_wire_config(upb.sandbox_config)
    assert container_from_create_request(reference, pod) == container_from_wire_create(upb, pod)


@pytest.mark.parametrize("unknown", [b"", UNKNOWN], ids=["", "unknown field"])
@pytest.mark.parametrize("request_", REQUESTS.values(), ids=REQUESTS.keys())
def test_same_records_as_betterproto2(request_: v1.CreateContainerRequest, unknown: bytes) -> None:
    same_records(bytes(request_.SerializeToString()) + unknown)


def test_repeated_map_keys_read_as_betterproto2_reads_them() -> None:
    """A key sent twice: the later value, in the first place (wire.entries)."""
    entry = v1.ContainerConfig(annotations={"a": "1", "b": "2"}).SerializeToString()
    again = v1.ContainerConfig(annotations={"a": "3"}).SerializeToString()
    config = bytes(entry) + bytes(again)
    same_records(b"\x12" + bytes([len(config)]) + config)


names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=6)
string_maps = st.dictionaries(names, names, max_size=3)
hugepages = st.lists(
    st.builds(v1.HugepageLimit, page_size=names, limit=st.integers(0, (1 << 64) - 1)), max_size=2
)
cri_resources = linux_resources(
    v1.LinuxContainerResources, names, unified=string_maps, hugepage_limits=hugepages
)


def build_request(
    config: tuple[dict[str, str], dict[str, str], list[tuple[str, str]]] | None,
    sandbox: tuple[dict[str, str], str | None] | None,
    resources: v1.LinuxContainerResources | None,
    unknown: bytes,
) -> bytes:
    """A CreateContainer as kubelet's bytes: any part absent or empty, with unknown fields in the resources
    (when there are resources) and at the end (when *unknown*)."""
    container = None
    if config is not None:
        labels, annotations, envs = config
        container = v1.ContainerConfig(
            metadata=v1.ContainerMetadata(name="app"),
            labels=labels,
            annotations=annotations,
            envs=[v1.KeyValue(key=k, value=v.encode()) for k, v in envs],
            linux=None if resources is None else v1.LinuxContainerConfig(resources=with_unknown(resources)),
        )
    sandbox_config = None
    if sandbox is not None:
        sandbox_labels, parent = sandbox
        linux = None if parent is None else v1.LinuxPodSandboxConfig(cgroup_parent=parent)
        sandbox_config = v1.PodSandboxConfig(labels=sandbox_labels, linux=linux)
    request = v1.CreateContainerRequest(pod_sandbox_id="pod", config=container, sandbox_config=sandbox_config)
    return bytes(request.SerializeToString()) + unknown


requests = st.builds(
    build_request,
    st.none() | st.tuples(string_maps, string_maps, st.lists(st.tuples(names, names), max_size=4)),
    st.none() | st.tuples(string_maps, st.none() | names),
    st.none() | cri_resources,
    st.sampled_from([b"", UNKNOWN]),
)
answers = st.builds(
    v1alpha1.ContainerResourceHookResponse,
    container_annotations=string_maps,
    container_resources=st.none()
    | linux_resources(
        v1alpha1.LinuxContainerResources, names, unified=string_maps, memory_swap_limit_in_bytes=INT64
    ),
    pod_cgroup_parent=names,
    container_envs=string_maps,
)


@settings(max_examples=examples(150), deadline=None)
@given(requests, answers)
def test_fuzz_same_bytes_as_apply_create(wire: bytes, answer: v1alpha1.ContainerResourceHookResponse) -> None:
    same_records(wire)
    info = merged_record(wire, answer)

    assert expected(wire, info) == create_request(CreateContainerRequest.FromString(wire), info)


def test_a_field_of_the_wrong_wire_type_is_kept_unknown() -> None:
    """``config`` sent as a varint: read as no config (as containerd's Go decoder reads it), kept as an unknown
    field and forwarded after the merge (betterproto2 read an int there, which the request path refused)."""
    wire = b"\x0a\x01p\x10\x01"  # pod_sandbox_id "p"; field 2 (config, a message) as varint 1
    message = CreateContainerRequest.FromString(wire)
    info = container_from_wire_create(message, PodInfo())
    assert ("p", "") == (info.pod_sandbox_id, info.name)

    written = create_request(message, attrs.evolve(info, annotations={"a": "1"}))

    assert written.endswith(b"\x10\x01")
    assert {"a": "1"} == v1.CreateContainerRequest.FromString(written[: -len(b"\x10\x01")]).config.annotations
