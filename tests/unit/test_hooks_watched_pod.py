"""A watched RunPodSandbox reads its pod with upb when upb dropped nothing, else as the interceptor
does (hooks/watched.py's _pod_of_run_request): either way the record the interceptor would read."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from krproxy.hooks import watched
from krproxy.hooks._reading import decode
from krproxy.hooks.convert import pod_from_run_request
from krproxy.proto.runtime import v1 as cri

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=8)
string_maps = st.dictionaries(names, names, max_size=4)
requests = st.builds(
    cri.RunPodSandboxRequest,
    config=st.none()
    | st.builds(
        cri.PodSandboxConfig,
        metadata=st.none()
        | st.builds(
            cri.PodSandboxMetadata, name=names, uid=names, namespace=names, attempt=st.integers(0, 2**32 - 1)
        ),
        hostname=names,
        labels=string_maps,
        annotations=string_maps,
        linux=st.none() | st.builds(cri.LinuxPodSandboxConfig, cgroup_parent=names),
    ),
    runtime_handler=names,
)


def _interceptors(data: bytes) -> Any:
    return pod_from_run_request(decode(cri.RunPodSandboxRequest, data, "RunPodSandboxRequest"))


def _watched_reading(data: bytes) -> tuple[Any, int]:
    """The watch's pod of *data*, and how many times it had betterproto2 decode the request."""
    calls = 0

    def counted(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        return decode(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(watched, "decode", counted)
        return watched._pod_of_run_request(data), calls


@given(requests)
def test_upb_reads_the_interceptors_pod_without_betterproto2(
    request: cri.RunPodSandboxRequest,
) -> None:
    """Upb reads the pod the interceptor reads without betterproto2."""
    data = bytes(request.SerializeToString())
    pod, decoded = _watched_reading(data)
    assert _interceptors(data) == pod
    assert 0 == decoded


@pytest.mark.parametrize(
    "extra",
    [
        b"\xa2\x06\x03new",  # field 100, length-delimited: a newer kubelet's field
        b"\x1a\x05other",  # runtime_handler (3) sent twice: the last wins
        b"\x0a\x00",  # an empty config after the first: betterproto2 keeps it alone (Go merges)
    ],
    ids=["unknown field", "field twice", "config twice"],
)
def test_what_upb_reads_otherwise_is_read_as_the_interceptor(extra: bytes) -> None:
    """What upb would read otherwise is read as the interceptor reads it."""
    request = cri.RunPodSandboxRequest(
        config=cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="web", uid="u", namespace="ns")),
        runtime_handler="runc",
    )
    data = bytes(request.SerializeToString()) + extra
    pod, decoded = _watched_reading(data)
    assert _interceptors(data) == pod
    assert 1 == decoded


def test_a_wrong_wire_type_config_is_read_as_the_interceptor() -> None:
    """upb keeps the varint config as an unknown field (no pod at all), as Go does; so does the
    interceptor since review8 (betterproto2 held the int, which it could not read): the watch reads
    the same empty pod, through the interceptor's reading."""
    data = b"\x08\x01"  # config (1) as the varint 1
    pod, decoded = _watched_reading(data)
    assert _interceptors(data) == pod == pod_from_run_request(cri.RunPodSandboxRequest())
    assert 1 == decoded
