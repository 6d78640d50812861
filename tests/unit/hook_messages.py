"""Hypothesis strategies for the hook protocol's requests (``runtime/v1alpha1``), shared by the tests
of the SDK's echo and wire decoding and of the fake plugin's wire echo (this module holds no tests).

Every field a request can carry is drawn, overhead and pod resources included; integers span their
wire type, and strings are valid UTF-8 (the protocol's strings are).
"""

from __future__ import annotations

from hypothesis import strategies as st

from krproxy.proto.runtime import v1alpha1 as pb

texts = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=8)
maps = st.dictionaries(texts, texts, max_size=3)
int64 = st.integers(-(1 << 63), (1 << 63) - 1)
uint32 = st.integers(0, (1 << 32) - 1)
resources = st.builds(
    pb.LinuxContainerResources,
    cpu_period=int64,
    cpu_quota=int64,
    cpu_shares=int64,
    memory_limit_in_bytes=int64,
    oom_score_adj=st.integers(-1000, 1000),
    cpuset_cpus=texts,
    cpuset_mems=texts,
    hugepage_limits=st.lists(
        st.builds(pb.HugepageLimit, page_size=texts, limit=st.integers(0, (1 << 64) - 1)), max_size=2
    ),
    unified=maps,
    memory_swap_limit_in_bytes=int64,
)
pod_meta = st.builds(pb.PodSandboxMetadata, name=texts, uid=texts, namespace=texts, attempt=uint32)
pod_requests = st.builds(
    pb.PodSandboxHookRequest,
    pod_meta=st.none() | pod_meta,
    runtime_handler=texts,
    labels=maps,
    annotations=maps,
    cgroup_parent=texts,
    overhead=st.none() | resources,
    resources=st.none() | resources,
)
container_requests = st.builds(
    pb.ContainerResourceHookRequest,
    pod_meta=st.none() | pod_meta,
    container_meta=st.none() | st.builds(pb.ContainerMetadata, name=texts, attempt=uint32, id=texts),
    container_annotations=maps,
    container_resources=st.none() | resources,
    pod_resources=st.none() | resources,
    pod_annotations=maps,
    pod_labels=maps,
    pod_cgroup_parent=texts,
    container_envs=maps,
)
