"""Recovery's upb path (krproxy.hooks.wire + convert.*_from_wire_*) recovers, for any answer a runtime may
send, exactly the fields of the messages it was encoded from, map order included (as betterproto2 decodes
them: a key sent twice keeps its first place with the later value). The verbose info's own rules (cgroup
parent, requested resources, envs) are table-tested in test_hooks_convert_recovery.py."""

from __future__ import annotations

import json
from typing import Any

import attrs
from hypothesis import given
from hypothesis import strategies as st

from krproxy.hooks import convert, wire
from krproxy.hooks.model import ContainerInfo, PodInfo
from krproxy.proto.runtime import v1
from tests import fuzz

POD = PodInfo(name="web", uid="u1", namespace="default", cgroup_parent="/kubepods/podu1")

text = st.text(max_size=6)
string_maps = st.dictionaries(text, text, max_size=4)
int64 = st.integers(-(2**63), 2**63 - 1)
metadata = st.builds(
    v1.PodSandboxMetadata, name=text, uid=text, namespace=text, attempt=st.integers(0, 2**32 - 1)
)
container_metadata = st.builds(v1.ContainerMetadata, name=text, attempt=st.integers(0, 2**32 - 1))
linux_resources = fuzz.linux_resources(
    v1.LinuxContainerResources,
    text,
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


def _pod(
    meta: v1.PodSandboxMetadata | None, item: v1.PodSandbox | v1.PodSandboxStatus, cgroup_parent: str
) -> PodInfo:
    """The record the fields of a ListPodSandbox item or a PodSandboxStatus make: the one the betterproto2
    path makes of a RunPodSandbox request that carries them."""
    config = v1.PodSandboxConfig(
        metadata=meta,
        labels=item.labels,
        annotations=item.annotations,
        linux=v1.LinuxPodSandboxConfig(cgroup_parent=cgroup_parent),
    )
    return convert.pod_from_run_request(
        v1.RunPodSandboxRequest(config=config, runtime_handler=item.runtime_handler)
    )


def _container(
    meta: v1.ContainerMetadata | None, container_id: str, annotations: dict[str, str]
) -> ContainerInfo:
    meta = meta or v1.ContainerMetadata()
    return ContainerInfo(
        pod_sandbox_id="sb1",
        pod=POD,
        name=meta.name,
        attempt=meta.attempt,
        id=container_id,
        annotations=annotations,
        resources=None,
        pod_cgroup_parent=POD.cgroup_parent,
    )


#: The fields a ListPodSandbox item and a PodSandboxStatus share (but the id).
sandbox_fields = {
    "metadata": st.none() | metadata,
    "labels": string_maps,
    "annotations": string_maps,
    "runtime_handler": text,
}


@given(st.builds(v1.PodSandbox, id=text, **sandbox_fields))
def test_pod_from_sandbox(sandbox: v1.PodSandbox) -> None:
    """A ListPodSandbox item: its metadata, labels, annotations and handler; no cgroup parent."""
    data = bytes(v1.ListPodSandboxResponse(items=[sandbox]))
    [item] = wire.ListPodSandboxResponse.FromString(data).items

    expected, actual = _pod(sandbox.metadata, sandbox, ""), convert.pod_from_wire_sandbox(item)

    assert (expected, _keep_order(expected)) == (actual, _keep_order(actual))


@given(st.builds(v1.PodSandboxStatus, id=st.sampled_from(["", "c", "sb1"]), **sandbox_fields), infos)
def test_pod_from_status(status: v1.PodSandboxStatus, info: dict[str, str]) -> None:
    """A PodSandboxStatus: its fields, and the cgroup parent its verbose info names."""
    data = bytes(v1.PodSandboxStatusResponse(status=status, info=info))
    answer = wire.PodSandboxStatusResponse.FromString(data)

    expected = _pod(status.metadata, status, convert.cgroup_parent_from_verbose(info, status.id))
    actual = convert.pod_from_wire_status(answer.status, wire.entries(answer.info))

    assert (expected, _keep_order(expected)) == (actual, _keep_order(actual))


@given(
    st.builds(
        v1.Container,
        id=text,
        pod_sandbox_id=st.just("sb1"),
        metadata=st.none() | container_metadata,
        labels=string_maps,
        annotations=string_maps,
    )
)
def test_container_from_list(container: v1.Container) -> None:
    """A ListContainers item: its metadata, id and annotations; resources unknown, no envs."""
    data = bytes(v1.ListContainersResponse(containers=[container]))
    [item] = wire.ListContainersResponse.FromString(data).containers

    expected = _container(container.metadata, container.id, container.annotations)
    actual = convert.container_from_wire_list(item, POD)

    assert (expected, _keep_order(expected)) == (actual, _keep_order(actual))


@given(
    st.builds(
        v1.ContainerStatus,
        id=text,
        metadata=st.none() | container_metadata,
        annotations=string_maps,
        # Absent, present without linux, present with (possibly all-default) linux resources.
        resources=st.none() | st.builds(v1.ContainerResources, linux=st.none() | linux_resources),
    )
)
def test_container_from_status(status: v1.ContainerStatus) -> None:
    """A ContainerStatus without verbose info: its fields, and the resources it reports (any values,
    hugepages and unified map included) with swap 0, since no requested swap is known."""
    data = bytes(v1.ContainerStatusResponse(status=status))
    answer = wire.ContainerStatusResponse.FromString(data)

    reported = status.resources.linux if status.resources is not None else None
    resources = None
    if reported is not None:
        resources = attrs.evolve(convert.resources_from_cri(reported), memory_swap_limit_in_bytes=0)
    expected = attrs.evolve(_container(status.metadata, status.id, status.annotations), resources=resources)
    actual = convert.container_from_wire_status(answer.status, "sb1", POD, wire.entries(answer.info))

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
