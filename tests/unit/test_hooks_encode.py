"""The hook requests krproxy.hooks.encode writes straight from records (encode.pod_request,
encode.container_request) must decode to exactly the messages built field by field with betterproto2
(the builders below, this test's reference), for any record."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from krproxy.hooks import encode
from krproxy.hooks.model import ContainerInfo, PodInfo, Resources
from krproxy.hooks.writeback import resources_to_hook
from krproxy.proto.runtime import v1alpha1 as hookapi
from tests.fuzz import INT64, examples, linux_resources

FUZZ = settings(max_examples=examples(300), deadline=None)

texts = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=10)
string_maps = st.dictionaries(texts, texts, max_size=3)
uint32 = st.integers(0, (1 << 32) - 1)
resources = linux_resources(
    Resources,
    texts,
    hugepage_limits=st.lists(st.tuples(texts, st.integers(0, (1 << 64) - 1)), max_size=2),
    unified=string_maps,
    memory_swap_limit_in_bytes=INT64,
)
pods = st.builds(
    PodInfo,
    **dict.fromkeys(("name", "uid", "namespace", "runtime_handler", "cgroup_parent"), texts),
    **dict.fromkeys(("labels", "annotations"), string_maps),
    **dict.fromkeys(("resources", "overhead"), st.none() | resources),
    attempt=uint32,
)
#: Env values as CRI delivers them: bytes decoded with surrogateescape, so not always valid UTF-8.
env_values = texts | st.binary(max_size=6).map(lambda b: b.decode("utf-8", "surrogateescape"))
containers = st.builds(
    ContainerInfo,
    **dict.fromkeys(("pod_sandbox_id", "name", "id", "pod_cgroup_parent"), texts),
    pod=pods,
    attempt=uint32,
    annotations=string_maps,
    resources=st.none() | resources,
    envs=st.dictionaries(texts, env_values, max_size=3),
)


def _hook_safe(value: str) -> str:
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _pod_meta(pod: PodInfo) -> hookapi.PodSandboxMetadata:
    return hookapi.PodSandboxMetadata(
        name=pod.name, uid=pod.uid, namespace=pod.namespace, attempt=pod.attempt
    )


def pod_hook_request(pod: PodInfo) -> hookapi.PodSandboxHookRequest:
    """The request of PreRunPodSandbox and PostStopPodSandbox hooks for *pod*, field by field."""
    return hookapi.PodSandboxHookRequest(
        pod_meta=_pod_meta(pod),
        runtime_handler=pod.runtime_handler,
        labels=dict(pod.labels),
        annotations=dict(pod.annotations),
        cgroup_parent=pod.cgroup_parent,
        overhead=resources_to_hook(pod.overhead) if pod.overhead is not None else None,
        resources=resources_to_hook(pod.resources) if pod.resources is not None else None,
    )


def container_hook_request(container: ContainerInfo) -> hookapi.ContainerResourceHookRequest:
    """The request of the container hooks for *container*, field by field."""
    pod = container.pod
    return hookapi.ContainerResourceHookRequest(
        pod_meta=_pod_meta(pod),
        container_meta=hookapi.ContainerMetadata(
            name=container.name, attempt=container.attempt, id=container.id
        ),
        container_annotations=dict(container.annotations),
        container_resources=(
            resources_to_hook(container.resources) if container.resources is not None else None
        ),
        pod_resources=resources_to_hook(pod.resources) if pod.resources is not None else None,
        pod_annotations=dict(pod.annotations),
        pod_labels=dict(pod.labels),
        pod_cgroup_parent=container.pod_cgroup_parent,
        container_envs={k: _hook_safe(v) for k, v in container.envs.items()},
    )


class TestSerializedHookRequests:
    @FUZZ
    @given(pods)
    def test_pod_request(self, pod: PodInfo) -> None:
        """encode.pod_request(pod) decodes to pod_hook_request(pod)."""
        decoded = hookapi.PodSandboxHookRequest.FromString(encode.pod_request(pod))

        assert pod_hook_request(pod) == decoded

    @FUZZ
    @given(containers)
    def test_container_request(self, container: ContainerInfo) -> None:
        """encode.container_request(container) decodes to container_hook_request(container)."""
        decoded = hookapi.ContainerResourceHookRequest.FromString(encode.container_request(container))

        assert container_hook_request(container) == decoded

    def test_empty_records_keep_their_sub_messages(self) -> None:
        """pod_meta and container_meta are sent even when empty, as the builders set them."""
        decoded = hookapi.ContainerResourceHookRequest.FromString(encode.container_request(ContainerInfo()))

        assert hookapi.PodSandboxMetadata() == decoded.pod_meta
        assert hookapi.ContainerMetadata() == decoded.container_meta
        assert None is decoded.container_resources


class TestLengths:
    """Lengths of one varint byte (below 128) are written inline, longer ones by protowire.varint: each
    side of that bound, for a map entry, its key, its value, a string and a message."""

    @pytest.mark.parametrize(
        ("key", "value"),
        [
            ("k" * 61, "v" * 62),  # the entry 127 bytes
            ("k" * 62, "v" * 62),  # 128
            ("", "v" * 125),  # 127, no key
            ("k" * 126, ""),  # 128, no value
            ("k" * 127, "v" * 128),
            ("k", "v" * 300),
        ],
        ids=["127", "128", "127-no-key", "128-no-value", "long-both", "long-value"],
    )
    def test_map_entries(self, key: str, value: str) -> None:
        """Entries of any size decode as the builders' maps, env values' too."""
        container = ContainerInfo(
            name="n" * 200, annotations={key: value}, envs={key: value}, pod=PodInfo(labels={key: value})
        )
        decoded = hookapi.ContainerResourceHookRequest.FromString(encode.container_request(container))

        assert container_hook_request(container) == decoded

    def test_only_env_values_are_made_utf8(self) -> None:
        """A value that is not UTF-8 is sent with U+FFFD in an env; in another map it is refused, as before."""
        value = b"\xff".decode("utf-8", "surrogateescape")
        decoded = hookapi.ContainerResourceHookRequest.FromString(
            encode.container_request(ContainerInfo(envs={"E": value}))
        )

        assert {"E": "\ufffd"} == decoded.container_envs
        with pytest.raises(UnicodeEncodeError):
            encode.container_request(ContainerInfo(annotations={"a": value}))


class TestIntegersBeyondTheWire:
    """Docker's JSON carries integers of any size: one that no 64-bit protobuf integer holds is refused with
    the reason (a failed hook call, by the server's policy), not sent wrapped modulo 2^64 (2^64 + 2048 read
    as 2048), nor as the overlong varint betterproto2 wrote (which Go's decoder, koordlet's, refuses)."""

    def test_the_64_bit_bounds_are_sent(self) -> None:
        pod = PodInfo(resources=Resources(cpu_shares=-(1 << 63), hugepage_limits=(("2MB", (1 << 64) - 1),)))
        decoded = hookapi.PodSandboxHookRequest.FromString(encode.pod_request(pod))

        assert pod_hook_request(pod) == decoded

    @FUZZ
    @given(st.integers(1 << 64, 1 << 80) | st.integers(-(1 << 80), -(1 << 63) - 1))
    def test_beyond_them_is_refused(self, value: int) -> None:
        for resources in (Resources(cpu_shares=value), Resources(hugepage_limits=(("2MB", value),))):
            with pytest.raises(ValueError, match=f"{value} does not fit"):
                encode.container_request(ContainerInfo(resources=resources))
        with pytest.raises(ValueError, match=f"{value} does not fit"):
            encode.pod_request(PodInfo(attempt=value))
