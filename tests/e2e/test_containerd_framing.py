"""gRPC framing and header spellings of a StartContainer, through krproxy and straight to real containerd.

Measured on 1.6.20, 1.7.24 and 2.1.9 (2026-12-07): containerd refuses a payload flag other than 0 and 1
(INTERNAL "grpc: received unexpected payload format N"), a content-type that is not ``application/grpc``
or ``application/grpc+...``/``;...`` (1.6 resets the stream, 1.7 and 2.1 answer INVALID_ARGUMENT), and
from 1.7 a ``:method`` other than POST; 1.6 has no gzip decompressor (UNIMPLEMENTED), 1.7 and 2.1 read
gzip, and a gzip message of two members as one (Go's multistream reader); a second message of a unary
call is ignored; ``te``, ``:authority`` and padded DATA frames change nothing. krproxy refuses the
payload flags as 2.1 does, accepts some of what containerd refuses (a content-type, a ``:method``,
gzip in front of 1.6), and reads a gzip message of two members whole, as 1.7 and 2.1 do; it
decompresses and re-frames the message it read and forwards that: whichever spelling came, the
container containerd starts is the one whose PreStartContainer hook ran. That is what the first test
holds, per spelling.
"""

from __future__ import annotations

import functools
import gzip
from collections.abc import Callable
from typing import Any

import trio
from cri_api.v1 import api_pb2 as pb

from tests.e2e.support import TIMEOUT, Containerd, Cri, Plugin, Proxy, container_config, pod_config
from tests.e2e.test_containerd_hooks import cleanup, create_container, run_pod
from tests.integration.h2_client import grpc_request, request

PATH = "/runtime.v1.RuntimeService/StartContainer"
Fields = list[tuple[str, str]]


def _frame(flag: int, body: bytes) -> bytes:
    return bytes([flag]) + len(body).to_bytes(4, "big") + body


def _fields(
    drop: tuple[str, ...] = (), set_: dict[str, str] | None = None, add: Fields | None = None
) -> Fields:
    fields = [(k, (set_ or {}).get(k, v)) for k, v in grpc_request(PATH, timeout=TIMEOUT) if k not in drop]
    return fields + (add or [])


def spellings(container_id: str) -> dict[str, tuple[Fields, bytes, int | None]]:
    """Each spelling: the header fields, the DATA (framed), the padding of each DATA frame."""
    real = pb.StartContainerRequest(container_id=container_id).SerializeToString()
    unknown = pb.StartContainerRequest(container_id="no-such-container").SerializeToString()
    gz = [("grpc-encoding", "gzip")]
    return {
        "flag 2": (_fields(), _frame(2, real), None),
        "flag 0x80": (_fields(), _frame(0x80, real), None),
        "flag 3, gzip": (_fields(add=gz), _frame(3, gzip.compress(real)), None),
        "flag 1, gzip": (_fields(add=gz), _frame(1, gzip.compress(real)), None),
        "flag 1, GZIP": (_fields(add=[("grpc-encoding", "GZIP")]), _frame(1, gzip.compress(real)), None),
        "flag 1, no grpc-encoding": (_fields(), _frame(1, gzip.compress(real)), None),
        "flag 0, grpc-encoding gzip": (_fields(add=gz), _frame(0, real), None),
        "gzip of two members": (
            _fields(add=gz),
            _frame(1, gzip.compress(unknown) + gzip.compress(real)),
            None,
        ),
        "two messages, the unknown id first": (_fields(), _frame(0, unknown) + _frame(0, real), None),
        "two messages, the real id first": (_fields(), _frame(0, real) + _frame(0, unknown), None),
        "padded DATA frames": (_fields(), _frame(0, real), 7),
        "application/grpc+proto": (
            _fields(set_={"content-type": "application/grpc+proto"}),
            _frame(0, real),
            None,
        ),
        "application/grpc+json": (
            _fields(set_={"content-type": "application/grpc+json"}),
            _frame(0, real),
            None,
        ),
        "application/grpc;charset=utf-8": (
            _fields(set_={"content-type": "application/grpc;charset=utf-8"}),
            _frame(0, real),
            None,
        ),
        "APPLICATION/GRPC": (_fields(set_={"content-type": "APPLICATION/GRPC"}), _frame(0, real), None),
        "application/json": (_fields(set_={"content-type": "application/json"}), _frame(0, real), None),
        "no content-type": (_fields(drop=("content-type",)), _frame(0, real), None),
        "no te": (_fields(drop=("te",)), _frame(0, real), None),
        ":method GET": (_fields(set_={":method": "GET"}), _frame(0, real), None),
        "no :authority": (_fields(drop=(":authority",)), _frame(0, real), None),
    }


def _send(socket: str, fields: Fields, body: bytes, padding: int | None) -> Any:
    async def go() -> Any:
        with trio.fail_after(TIMEOUT):
            return await request(socket, fields, body, padding=padding)

    answer = trio.run(go)
    return answer.grpc_status if answer.reset is None else f"RST_STREAM {answer.reset}"


def test_every_spelling_started_through_krproxy_ran_the_hook(
    containerd: Containerd, via_proxy: Cri, direct: Cri, proxy: Proxy, plugins: Callable[..., Plugin]
) -> None:
    """For each spelling, a container of its own: through krproxy, a container that started had its
    PreStartContainer hook run once, and the spellings krproxy carries out are the same in front of every
    version (a gzip message of two members read whole, as 1.7 and 2.1 read it); straight to containerd,
    the spellings it carries out are the ones the module's docstring says."""
    plugin = plugins("observer", hooks=["PreStartContainer"])
    unhooked, direct_started, proxy_started = [], [], []
    with cleanup(direct) as pods:
        pod = pod_config(containerd.cgroup_parent, "framing")
        pod_id = run_pod(via_proxy, pod, pods)
        names = list(spellings(""))
        for n, name in enumerate(names):
            for way, socket in (("direct", containerd.socket), ("krproxy", proxy.socket)):
                config = container_config(containerd.busybox, f"c{n}-{way}")
                cid = create_container(via_proxy, pod_id, pod, config)
                before = len(plugin.requests("PreStartContainer"))
                _send(socket, *spellings(cid)[name])
                status = direct.runtime.ContainerStatus(
                    pb.ContainerStatusRequest(container_id=cid), timeout=TIMEOUT
                )
                started = status.status.state == pb.CONTAINER_RUNNING
                hooked = len(plugin.requests("PreStartContainer")) - before
                if way == "krproxy" and started and hooked != 1:
                    unhooked.append(name)
                if way == "direct" and started:
                    direct_started.append(name)
                if way == "krproxy" and started:
                    proxy_started.append(name)
    assert [] == unhooked
    # krproxy's own reading, the same in front of each version (it forwards what it read, re-framed)
    refused = {"flag 2", "flag 0x80", "flag 3, gzip", "flag 1, GZIP", "flag 1, no grpc-encoding"}
    assert sorted(set(names) - refused - {"two messages, the unknown id first"}) == sorted(proxy_started)
    version = direct.runtime.Version(pb.VersionRequest(), timeout=TIMEOUT).runtime_version.lstrip("v")
    carried = {
        "two messages, the real id first",
        "padded DATA frames",
        "application/grpc+proto",
        "application/grpc+json",
        "application/grpc;charset=utf-8",
        "no te",
        "no :authority",
    }
    if version.startswith("1.6."):
        carried.add(":method GET")
    else:
        carried |= {"flag 1, gzip", "flag 0, grpc-encoding gzip", "gzip of two members"}
    assert sorted(carried) == sorted(direct_started)


def test_a_payload_flag_containerd_refuses_is_refused_as_it_refuses_it(
    containerd: Containerd, via_proxy: Cri, direct: Cri, proxy: Proxy, plugins: Callable[..., Plugin]
) -> None:
    """A message whose flag byte is neither 0 nor 1 (2, 0x80, or 3 with gzip): containerd answers INTERNAL
    "grpc: received unexpected payload format N" (1.6: UNIMPLEMENTED for 3 with gzip, which it cannot
    decompress) and starts nothing; so does krproxy, as 2.1 does, before any hook (it read the flag's low
    bit alone, ran the hook and forwarded the message re-framed)."""
    plugin = plugins("observer", hooks=["PreStartContainer"])
    answers = {}
    with cleanup(direct) as pods:
        pod = pod_config(containerd.cgroup_parent, "flags")
        pod_id = run_pod(via_proxy, pod, pods)
        for n, name in enumerate(("flag 2", "flag 0x80", "flag 3, gzip")):
            for way, socket in (("direct", containerd.socket), ("krproxy", proxy.socket)):
                cid = create_container(
                    via_proxy, pod_id, pod, container_config(containerd.busybox, f"f{n}-{way}")
                )
                fields, body, _ = spellings(cid)[name]
                answer = trio.run(functools.partial(_answer, socket, fields, body))
                status = direct.runtime.ContainerStatus(
                    pb.ContainerStatusRequest(container_id=cid), timeout=TIMEOUT
                )
                answers[name, way] = (answer.grpc_status, answer.grpc_message, status.status.state)
    flags = {"flag 2": 2, "flag 0x80": 128, "flag 3, gzip": 3}
    want = {
        (name, way): (13, f"grpc: received unexpected payload format {flag}", pb.CONTAINER_CREATED)
        for name, flag in flags.items()
        for way in ("direct", "krproxy")
    }
    version = direct.runtime.Version(pb.VersionRequest(), timeout=TIMEOUT).runtime_version.lstrip("v")
    if version.startswith("1.6."):  # its grpc-go looks for a decompressor first
        want["flag 3, gzip", "direct"] = (
            12,
            'grpc: Decompressor is not installed for grpc-encoding "gzip"',
            0,
        )
    assert want == answers
    assert [] == plugin.hooks_called()


async def _answer(socket: str, fields: Fields, body: bytes) -> Any:
    with trio.fail_after(TIMEOUT):
        return await request(socket, fields, body)
