"""The hook requests serialized straight from records (convert.pod_hook_request_bytes,
convert.container_hook_request_bytes) must decode to exactly the messages the betterproto2 builders make,
for any record."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from krproxy.hooks import convert
from krproxy.hooks.model import ContainerInfo, PodInfo, Resources
from krproxy.proto.runtime import v1alpha1 as hookapi
from tests.fuzz import examples

FUZZ = settings(max_examples=examples(300), deadline=None)

texts = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=10)
string_maps = st.dictionaries(texts, texts, max_size=3)
int64 = st.integers(-(1 << 63), (1 << 63) - 1)
resources = st.builds(
    Resources,
    cpu_period=int64,
    cpu_quota=int64,
    cpu_shares=int64,
    memory_limit_in_bytes=int64,
    oom_score_adj=int64,
    cpuset_cpus=texts,
    cpuset_mems=texts,
    hugepage_limits=st.lists(st.tuples(texts, st.integers(0, (1 << 64) - 1)), max_size=2),
    unified=string_maps,
    memory_swap_limit_in_bytes=int64,
)
pods = st.builds(
    PodInfo,
    name=texts,
    uid=texts,
    namespace=texts,
    attempt=st.integers(0, (1 << 32) - 1),
    runtime_handler=texts,
    labels=string_maps,
    annotations=string_maps,
    cgroup_parent=texts,
    resources=st.none() | resources,
    overhead=st.none() | resources,
)
#: Env values as CRI delivers them: bytes decoded with surrogateescape, so not always valid UTF-8.
env_values = texts | st.binary(max_size=6).map(lambda b: b.decode("utf-8", "surrogateescape"))
containers = st.builds(
    ContainerInfo,
    pod_sandbox_id=texts,
    pod=pods,
    name=texts,
    attempt=st.integers(0, (1 << 32) - 1),
    id=texts,
    annotations=string_maps,
    resources=st.none() | resources,
    envs=st.dictionaries(texts, env_values, max_size=3),
    pod_cgroup_parent=texts,
)


class TestSerializedHookRequests:
    @FUZZ
    @given(pods)
    def test_pod_request(self, pod: PodInfo) -> None:
        """pod_hook_request_bytes(pod) decodes to pod_hook_request(pod)."""
        decoded = hookapi.PodSandboxHookRequest.FromString(convert.pod_hook_request_bytes(pod))

        assert convert.pod_hook_request(pod) == decoded

    @FUZZ
    @given(containers)
    def test_container_request(self, container: ContainerInfo) -> None:
        """container_hook_request_bytes(container) decodes to container_hook_request(container)."""
        decoded = hookapi.ContainerResourceHookRequest.FromString(
            convert.container_hook_request_bytes(container)
        )

        assert convert.container_hook_request(container) == decoded

    def test_empty_records_keep_their_sub_messages(self) -> None:
        """pod_meta and container_meta are sent even when empty, as the builders set them."""
        decoded = hookapi.ContainerResourceHookRequest.FromString(
            convert.container_hook_request_bytes(ContainerInfo())
        )

        assert hookapi.PodSandboxMetadata() == decoded.pod_meta
        assert hookapi.ContainerMetadata() == decoded.container_meta
        assert None is decoded.container_resources
