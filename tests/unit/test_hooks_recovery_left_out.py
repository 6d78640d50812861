"""recover() (krproxy.hooks.recovery) with one unusable record among good ones: every other pod and container
is recovered with its verbose info, the unusable pod and its containers are reported left out by id with the
reason, a pod whose annotation is not UTF-8 is recovered with U+FFFD; nothing raises."""

from __future__ import annotations

import json

import pytest

from krproxy import protowire
from krproxy.hooks import wire
from krproxy.hooks.recovery import recover

PodSandbox = wire.message_class("PodSandbox", writing=True)
Container = wire.message_class("Container", writing=True)
PodStatusAnswer = wire.message_class("PodSandboxStatusResponse", writing=True)
ContainerStatusAnswer = wire.message_class("ContainerStatusResponse", writing=True)


def field(number: int, payload: bytes) -> bytes:
    return protowire.varint(number << 3 | 2) + protowire.varint(len(payload)) + payload


def _pod(ident: str) -> bytes:
    message = PodSandbox(id=ident)
    message.metadata.name = ident
    return bytes(message.SerializeToString())


def _container(ident: str, pod: str) -> bytes:
    return bytes(Container(id=ident, pod_sandbox_id=pod).SerializeToString())


def _pod_status(ident: str) -> bytes:
    answer = PodStatusAnswer()
    answer.status.id = ident
    answer.status.metadata.name = ident
    info = {"config": {"linux": {"cgroup_parent": f"/kubepods/{ident}"}}}
    answer.info.add(key="info", value=json.dumps(info))
    return bytes(answer.SerializeToString())


def _container_status(ident: str) -> bytes:
    answer = ContainerStatusAnswer()
    answer.status.id = ident
    answer.info.add(key="info", value=json.dumps({"config": {"envs": [{"key": "E", "value": ident}]}}))
    return bytes(answer.SerializeToString())


#: What each kind of bad record is, as the middle pod "bad" of the list answer.
BAD = {
    "not UTF-8": _pod("bad") + field(6, field(1, b"k") + field(2, b"\xff\xfe")),
    "wrong wire type": _pod("bad") + b"\x30\x07",  # annotations (6) as a varint
    "oversized": _pod("bad") + field(6, field(1, b"k") + field(2, b"x" * (256 * 1024 + 1))),
    "truncated": _pod("bad")[:-1],
}


@pytest.mark.parametrize("kind", list(BAD))
async def test_one_bad_pod_leaves_the_others_recovered(kind: str) -> None:
    """The good pods and containers are recovered with their verbose info; the bad pod is left out (with
    its container, for the same reason) unless only its strings are not UTF-8, when it is kept, repaired."""
    answers = {
        wire.LIST_POD_SANDBOX: field(1, _pod("p1")) + field(1, BAD[kind]) + field(1, _pod("p3")),
        wire.LIST_CONTAINERS: b"".join(
            field(1, _container(c, p)) for c, p in (("c1", "p1"), ("c2", "bad"), ("c3", "p3"))
        ),
    }

    async def call(path: str, request: bytes) -> bytes:
        if path in answers:
            return answers[path]
        if path == wire.POD_SANDBOX_STATUS:
            return _pod_status(wire.PodSandboxStatusRequest.FromString(request).pod_sandbox_id)
        return _container_status(wire.ContainerStatusRequest.FromString(request).container_id)

    recovered = await recover(call)
    assert "/kubepods/p1" == recovered.pods["p1"].cgroup_parent
    assert {"E": "c3"} == dict(recovered.containers["c3"].envs)
    assert 0 == recovered.orphans
    if kind == "not UTF-8":
        assert {"p1", "bad", "p3"} == set(recovered.pods)
        assert {"c1", "c2", "c3"} == set(recovered.containers)
        assert [("pod", "bad")] == [(r.kind, r.id) for r in recovered.repaired]
        assert {} == recovered.left_out
        return
    assert {"p1", "p3"} == set(recovered.pods)
    assert {"c1", "c3"} == set(recovered.containers)
    assert {"bad", "c2"} == set(recovered.left_out)
    assert "its pod bad was left out" == recovered.left_out["c2"].reason
    assert "pod" == recovered.left_out["bad"].kind
