"""The served SDK's upb codec (``_wire``) gives what the betterproto2 path gives.

The served hook server decodes requests and encodes answers with upb; :meth:`HookServer.handle_pod`
and :func:`container_response` stay betterproto2. For any request and any changes the plugins make,
the records plugins see and the answers the proxy gets must be the same either way.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from krproxy.hookserver import (
    ContainerContext,
    ContainerInfo,
    PodContext,
    PodInfo,
    _wire,
    container_response,
    pod_response,
)
from krproxy.proto.runtime import v1alpha1 as pb
from tests.unit.hook_messages import container_requests, maps, pod_requests, texts

optional_ints = st.none() | st.integers(min_value=-(2**40), max_value=2**40)
changed_resources = st.fixed_dictionaries(
    {
        "cpuset": st.none() | texts,
        "cfs_quota": optional_ints,
        "cpu_shares": optional_ints,
        "memory_limit": optional_ints,
        "cpu_bvt": st.none() | st.integers(-1, 2),
    }
)


def _set(target: Any, values: dict[str, Any]) -> None:
    for name, value in values.items():
        setattr(target, name, value)


def _items(info: PodInfo | ContainerInfo) -> list[Any]:
    """The maps of a record as ordered item lists (attrs equality does not look at order)."""
    if isinstance(info, PodInfo):
        return [list(info.labels.items()), list(info.annotations.items())]
    return [*_items(info.pod), list(info.annotations.items()), list(info.envs.items())]


def _assert_same_record(expected: PodInfo | ContainerInfo, info: PodInfo | ContainerInfo) -> None:
    """``info`` equals ``expected``, and its maps hold their items in the same order."""
    assert expected == info
    assert _items(expected) == _items(info)


class TestDecode:
    @given(pod_requests)
    def test_pod_record(self, req: pb.PodSandboxHookRequest) -> None:
        """The record of a pod request is what :meth:`PodInfo.from_proto` makes, maps in wire order."""
        _assert_same_record(PodInfo.from_proto(req), _wire.pod_info(bytes(req.SerializeToString()))[1])

    @given(container_requests)
    def test_container_record(self, req: pb.ContainerResourceHookRequest) -> None:
        """The record of a container request is what :meth:`ContainerInfo.from_proto` makes, maps in wire order."""
        expected = ContainerInfo.from_proto(req)
        _assert_same_record(expected, _wire.container_info(bytes(req.SerializeToString()))[1])

    def test_later_map_key_wins_in_its_first_place(self) -> None:
        """A key sent twice takes the later value and keeps its first place, as betterproto2 decodes it."""
        wire = b"".join(
            b"\x1a" + bytes([len(e)]) + e  # field 3 (labels), an entry: key 1, value 2
            for e in (b"\n\x01a\x12\x011", b"\n\x01b\x12\x012", b"\n\x01a\x12\x013")
        )
        _, info = _wire.pod_info(wire)
        assert [("a", "3"), ("b", "2")] == list(info.labels.items())
        assert list(PodInfo.from_proto(pb.PodSandboxHookRequest.FromString(wire)).labels.items()) == list(
            info.labels.items()
        )

    @pytest.mark.parametrize("decode", [_wire.pod_info, _wire.container_info])
    def test_garbage_is_a_decode_error(self, decode: Any) -> None:
        with pytest.raises(_wire.DecodeError):
            decode(b"\x0a\xff\x01")  # field 1 announces 255 bytes, 1 follows


class TestEncode:
    @given(pod_requests, maps, maps, st.none() | texts, changed_resources)
    def test_pod_answer(
        self,
        req: pb.PodSandboxHookRequest,
        labels: dict[str, str],
        annotations: dict[str, str],
        cgroup_parent: str | None,
        resources: dict[str, Any],
    ) -> None:
        """Whatever plugins change, the answer decodes to :func:`pod_response`'s."""
        upb_req, info = _wire.pod_info(bytes(req.SerializeToString()))
        ctx = PodContext(info)
        ctx.response.labels.update(labels)
        ctx.response.annotations.update(annotations)
        ctx.response.cgroup_parent = cgroup_parent
        _set(ctx.response.resources, resources)
        assert pod_response(req, ctx) == pb.PodSandboxHookResponse.FromString(_wire.pod_reply(upb_req, ctx))

    @given(container_requests, maps, maps, changed_resources)
    def test_container_answer(
        self,
        req: pb.ContainerResourceHookRequest,
        annotations: dict[str, str],
        envs: dict[str, str],
        resources: dict[str, Any],
    ) -> None:
        """Whatever plugins change, the answer decodes to :func:`container_response`'s."""
        upb_req, info = _wire.container_info(bytes(req.SerializeToString()))
        ctx = ContainerContext(info)
        ctx.response.annotations.update(annotations)
        ctx.response.add_envs.update(envs)
        _set(ctx.response.resources, resources)
        expected = container_response(req, ctx)
        got = pb.ContainerResourceHookResponse.FromString(_wire.container_reply(upb_req, ctx))
        assert expected == got
        assert list(expected.container_envs.items()) == list(got.container_envs.items())

    def test_resources_absent_unless_sent_or_changed(self) -> None:
        """No resources in the request and no CRI-expressible change: none in the answer (an empty
        one would read as "set" to the proxy's merge); one change: the field is there."""
        upb_req, info = _wire.container_info(b"")
        ctx = ContainerContext(info)
        ctx.response.resources.cpu_bvt = -1  # written by the executor, not answered
        assert pb.ContainerResourceHookResponse() == pb.ContainerResourceHookResponse.FromString(
            _wire.container_reply(upb_req, ctx)
        )
        ctx.response.resources.cfs_quota = 0
        got = pb.ContainerResourceHookResponse.FromString(_wire.container_reply(upb_req, ctx))
        assert pb.LinuxContainerResources() == got.container_resources


class TestNoneInMaps:
    """A None a plugin puts in an answer's map (``add_envs["X"] = os.environ.get("Y")``) fails the call,
    as betterproto2's encoding did, instead of reaching the container as an empty value."""

    @pytest.mark.parametrize("where", ["annotations", "add_envs"])
    @pytest.mark.parametrize(("key", "value"), [("X", None), (None, "1")])
    def test_container_answer(self, where: str, key: Any, value: Any) -> None:
        upb_req, info = _wire.container_info(b"")
        ctx = ContainerContext(info)
        getattr(ctx.response, where)[key] = value
        with pytest.raises(TypeError, match="None"):
            _wire.container_reply(upb_req, ctx)

    @pytest.mark.parametrize("where", ["labels", "annotations"])
    def test_pod_answer(self, where: str) -> None:
        req = pb.PodSandboxHookRequest(labels={"a": "1"}, annotations={"a": "1"})
        upb_req, info = _wire.pod_info(bytes(req.SerializeToString()))
        ctx = PodContext(info)
        getattr(ctx.response, where)["a"] = None
        with pytest.raises(TypeError, match="None"):
            _wire.pod_reply(upb_req, ctx)


class TestReadWhenUsed:
    """A record's maps are read from the request when something uses them, and the answer never
    reads them: a plugin that looks at one field does not pay for the request's every entry."""

    def _request(self) -> bytes:
        req = pb.ContainerResourceHookRequest(
            pod_meta=pb.PodSandboxMetadata(name="web"),
            pod_labels={"app": "web", "tier": "front"},
            pod_annotations={"a": "1"},
            container_annotations={"c": "2"},
            container_envs={"PATH": "/bin", "HOME": "/root"},
        )
        return bytes(req.SerializeToString())

    def test_no_map_is_read_for_a_plugin_that_reads_none(self, monkeypatch: pytest.MonkeyPatch) -> None:
        read: list[Any] = []
        real = _wire.entries

        def entries(field: Any) -> dict[str, str]:
            read.append(field)
            return real(field)

        monkeypatch.setattr(_wire, "entries", entries)
        upb_req, info = _wire.container_info(self._request())
        ctx = ContainerContext(info)
        ctx.response.add_envs["NAME"] = info.pod.meta.name
        answer = pb.ContainerResourceHookResponse.FromString(_wire.container_reply(upb_req, ctx))
        assert [] == read
        assert [("PATH", "/bin"), ("HOME", "/root"), ("NAME", "web")] == list(answer.container_envs.items())
        assert "web" == info.pod.labels["app"]  # now, and once
        assert 1 == len(read)

    def test_a_read_map_is_the_mappingproxy_it_replaces(self) -> None:
        _, info = _wire.container_info(self._request())
        labels, proxy = info.pod.labels, MappingProxyType({"app": "web", "tier": "front"})
        assert labels == proxy and proxy == labels and labels == dict(proxy)
        assert labels != {"app": "web"}
        assert repr(proxy) == repr(labels)
        assert ["app", "tier"] == list(labels) and ["tier", "app"] == list(reversed(labels))
        assert dict(proxy) == labels.copy() and labels.copy() is not labels.copy()
        assert {"app": "web", "tier": "front", "x": "1"} == labels | {"x": "1"} == {"x": "1"} | labels
        assert "tier" in labels and "x" not in labels and labels.get("x") is None and 2 == len(labels)
        assert (proxy.keys(), proxy.items()) == (labels.keys(), labels.items())
        assert list(proxy.values()) == list(labels.values())
        with pytest.raises(TypeError):
            labels["x"] = "1"  # type: ignore[index]

    def test_a_changed_key_follows_the_requests_and_decodes_there(self) -> None:
        """The answer echoes the request's entries as they came, then the changes: a key a plugin
        changed is written twice, and decodes to the plugin's value in the request's place, as the
        map ``{**request, **changes}`` that :func:`container_response` answers."""
        upb_req, info = _wire.container_info(self._request())
        ctx = ContainerContext(info)
        ctx.response.add_envs.update({"PATH": "/usr/bin", "X": "1"})
        raw = _wire.container_reply(upb_req, ctx)
        entries = [
            (e.key, e.value) for e in _wire.ContainerResourceHookResponse.FromString(raw).container_envs
        ]
        assert [("PATH", "/bin"), ("HOME", "/root"), ("PATH", "/usr/bin"), ("X", "1")] == entries
        expected = container_response(pb.ContainerResourceHookRequest.FromString(self._request()), ctx)
        got = pb.ContainerResourceHookResponse.FromString(raw)
        assert expected == got
        assert [("PATH", "/usr/bin"), ("HOME", "/root"), ("X", "1")] == list(got.container_envs.items())
