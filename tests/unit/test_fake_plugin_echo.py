"""The fake plugin's wire-level echo (krproxy.fakes.plugin.server.echo_bytes): it must answer exactly what the decoded
echo (echo_container / echo_pod) answers, for any request; and give up (None) on requests only a decode can
judge."""

from __future__ import annotations

import betterproto2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from krproxy.fakes.plugin.server import echo_bytes, echo_container, echo_pod
from krproxy.hooks.points import HookPoint
from krproxy.proto.runtime import v1alpha1 as hookapi
from tests.fuzz import examples
from tests.unit.hook_messages import container_requests, pod_requests

FUZZ = settings(max_examples=examples(200), deadline=None)


def _wire_echo(hook: HookPoint, request: betterproto2.Message) -> bytes:
    """The wire echo of ``request`` at ``hook`` (it must give one)."""
    answer = echo_bytes(hook, bytes(request.SerializeToString()))
    assert answer is not None
    return answer


class TestEchoBytes:
    @FUZZ
    @given(container_requests, st.sampled_from([p for p in HookPoint if not p.is_pod_level]))
    def test_container_echo_decodes_as_the_decoded_echo(
        self, request: hookapi.ContainerResourceHookRequest, hook: HookPoint
    ) -> None:
        """For any container hook request, the wire echo decodes to echo_container(request)."""
        answer = hookapi.ContainerResourceHookResponse.FromString(_wire_echo(hook, request))
        assert echo_container(request) == answer

    @FUZZ
    @given(pod_requests, st.sampled_from([p for p in HookPoint if p.is_pod_level]))
    def test_pod_echo_decodes_as_the_decoded_echo(
        self, request: hookapi.PodSandboxHookRequest, hook: HookPoint
    ) -> None:
        """For any pod hook request, the wire echo decodes to echo_pod(request)."""
        assert echo_pod(request) == hookapi.PodSandboxHookResponse.FromString(_wire_echo(hook, request))

    def test_repeated_fields_resolve_alike(self) -> None:
        """A field sent twice (a later string wins, a map key seen again takes the later value) gives the
        same answer as decoding first."""
        first = hookapi.ContainerResourceHookRequest(
            pod_cgroup_parent="/a", container_envs={"K": "1", "J": "0"}
        )
        second = hookapi.ContainerResourceHookRequest(pod_cgroup_parent="/b", container_envs={"K": "2"})
        raw = bytes(first.SerializeToString()) + bytes(second.SerializeToString())

        answer = echo_bytes(HookPoint.PRE_CREATE_CONTAINER, raw)

        assert answer is not None
        expected = echo_container(hookapi.ContainerResourceHookRequest.FromString(raw))
        assert expected == hookapi.ContainerResourceHookResponse.FromString(answer)
        assert "/b" == expected.pod_cgroup_parent

    @pytest.mark.parametrize(
        "raw",
        [
            b"\x42\x05ab",  # pod_cgroup_parent cut short
            b"\x40\x05",  # pod_cgroup_parent sent as a varint
            b"\x0b\x0c",  # a group
            b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # a varint of 11 bytes
            b"\x08",  # a key without its value
        ],
    )
    def test_gives_up_on_what_only_a_decode_can_judge(self, raw: bytes) -> None:
        """Truncated or oddly typed fields: None, and the fake decodes the request the slow way."""
        assert None is echo_bytes(HookPoint.PRE_CREATE_CONTAINER, raw)
