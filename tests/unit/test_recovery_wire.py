"""Recovery's upb path (krproxy.hooks.wire + convert.*_from_wire_*) gives exactly what the betterproto2 path
(convert.pod_from_status & co.) gives for the same bytes, map order included."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from krproxy.hooks import convert, wire
from krproxy.hooks.model import ContainerInfo, PodInfo
from krproxy.proto.runtime import v1

POD = PodInfo(name="web", uid="u1", namespace="default", cgroup_parent="/kubepods/podu1")

text = st.text(max_size=6)
string_maps = st.dictionaries(text, text, max_size=4)
int64 = st.integers(-(2**63), 2**63 - 1)
metadata = st.builds(
    v1.PodSandboxMetadata, name=text, uid=text, namespace=text, attempt=st.integers(0, 2**32 - 1)
)
container_metadata = st.builds(v1.ContainerMetadata, name=text, attempt=st.integers(0, 2**32 - 1))
linux_resources = st.builds(
    v1.LinuxContainerResources,
    cpu_period=int64,
    cpu_quota=int64,
    cpu_shares=int64,
    memory_limit_in_bytes=int64,
    oom_score_adj=int64,
    cpuset_cpus=text,
    cpuset_mems=text,
    hugepage_limits=st.lists(
        st.builds(v1.HugepageLimit, page_size=text, limit=st.integers(0, 2**64 - 1)), max_size=2
    ),
    unified=string_maps,
    memory_swap_limit_in_bytes=int64,
)
#: A verbose ``info`` map as containerd writes it (or something else under "info", or nothing).
verbose_document = st.fixed_dictionaries(
    {},
    optional={
        "config": st.fixed_dictionaries(
            {},
            optional={
                "linux": st.fixed_dictionaries(
                    {},
                    optional={
                        "cgroup_parent": text,
                        "resources": st.fixed_dictionaries(
                            {}, optional={"cpu_shares": int64, "memory_swap_limit_in_bytes": int64}
                        ),
                    },
                ),
                "envs": st.lists(st.fixed_dictionaries({"key": text, "value": text}), max_size=3),
            },
        ),
        "runtimeSpec": st.fixed_dictionaries(
            {}, optional={"linux": st.fixed_dictionaries({"cgroupsPath": st.sampled_from(["a:b:c", "/p/x"])})}
        ),
    },
)
infos = st.one_of(
    st.just({}),
    verbose_document.map(lambda d: {"info": json.dumps(d)}),
    st.dictionaries(text, text, max_size=2),
)


def _keep_order(record: PodInfo | ContainerInfo) -> tuple[Any, ...]:
    """The record's maps as item lists: equal records may still differ in map order."""
    maps = ("labels", "annotations", "envs")
    return tuple(list(getattr(record, name).items()) for name in maps if hasattr(record, name))


@given(
    st.builds(
        v1.PodSandbox,
        id=text,
        metadata=st.none() | metadata,
        labels=string_maps,
        annotations=string_maps,
        runtime_handler=text,
    )
)
def test_pod_from_sandbox(sandbox: v1.PodSandbox) -> None:
    data = bytes(v1.ListPodSandboxResponse(items=[sandbox]))
    [old] = v1.ListPodSandboxResponse.FromString(data).items
    [new] = wire.ListPodSandboxResponse.FromString(data).items

    expected, actual = convert.pod_from_sandbox(old), convert.pod_from_wire_sandbox(new)

    assert (expected, _keep_order(expected)) == (actual, _keep_order(actual))


@given(
    st.builds(
        v1.PodSandboxStatus,
        id=st.sampled_from(["", "c", "sb1"]),
        metadata=st.none() | metadata,
        labels=string_maps,
        annotations=string_maps,
        runtime_handler=text,
    ),
    infos,
)
def test_pod_from_status(status: v1.PodSandboxStatus, info: dict[str, str]) -> None:
    data = bytes(v1.PodSandboxStatusResponse(status=status, info=info))
    old = v1.PodSandboxStatusResponse.FromString(data)
    new = wire.PodSandboxStatusResponse.FromString(data)

    assert old.status is not None
    expected = convert.pod_from_status(old.status, old.info)
    actual = convert.pod_from_wire_status(new.status, wire.entries(new.info))

    assert (expected, _keep_order(expected)) == (actual, _keep_order(actual))


@given(
    st.builds(
        v1.Container,
        id=text,
        pod_sandbox_id=text,
        metadata=st.none() | container_metadata,
        labels=string_maps,
        annotations=string_maps,
    )
)
def test_container_from_list(container: v1.Container) -> None:
    data = bytes(v1.ListContainersResponse(containers=[container]))
    [old] = v1.ListContainersResponse.FromString(data).containers
    [new] = wire.ListContainersResponse.FromString(data).containers

    expected, actual = convert.container_from_list(old, POD), convert.container_from_wire_list(new, POD)

    assert (expected, _keep_order(expected)) == (actual, _keep_order(actual))


@given(
    st.builds(
        v1.ContainerStatus,
        id=text,
        metadata=st.none() | container_metadata,
        annotations=string_maps,
        # Absent, present without linux, present with (possibly all-default) linux resources.
        resources=st.none() | st.builds(v1.ContainerResources, linux=st.none() | linux_resources),
    ),
    infos,
)
def test_container_from_status(status: v1.ContainerStatus, info: dict[str, str]) -> None:
    data = bytes(v1.ContainerStatusResponse(status=status, info=info))
    old = v1.ContainerStatusResponse.FromString(data)
    new = wire.ContainerStatusResponse.FromString(data)

    assert old.status is not None
    expected = convert.container_from_status(old.status, "sb1", POD, old.info)
    actual = convert.container_from_wire_status(new.status, "sb1", POD, wire.entries(new.info))

    assert (expected, _keep_order(expected)) == (actual, _keep_order(actual))


def test_duplicate_map_keys_decode_as_betterproto2_does() -> None:
    """A key sent twice takes the later value and keeps its first place, in both decoders."""
    status = wire.message_class("PodSandboxStatus")()
    for key, value in [("a", "1"), ("b", "2"), ("a", "3")]:
        entry = status.labels.add()
        entry.key, entry.value = key, value
    data = status.SerializeToString()

    old = v1.PodSandboxStatus.FromString(data)
    new = wire.message_class("PodSandboxStatus").FromString(data)

    assert [("a", "3"), ("b", "2")] == list(old.labels.items()) == list(wire.entries(new.labels).items())


def test_absent_status_is_told_from_empty() -> None:
    """An answer without ``status`` (recovery falls back to the list item) differs from an empty one."""
    absent = wire.ContainerStatusResponse.FromString(bytes(v1.ContainerStatusResponse()))
    empty = wire.ContainerStatusResponse.FromString(
        bytes(v1.ContainerStatusResponse(status=v1.ContainerStatus()))
    )

    assert (False, True) == (absent.HasField("status"), empty.HasField("status"))


def test_classes_live_beside_the_upstream_schema() -> None:
    """Our private descriptor pool does not clash with cri_api, which registers runtime.v1 in the default
    pool under the same message names (the tests' CRI client imports it)."""
    from cri_api.v1 import api_pb2

    upstream = api_pb2.ContainerStatusRequest(container_id="c1", verbose=True).SerializeToString()

    assert "c1" == wire.ContainerStatusRequest.FromString(upstream).container_id
