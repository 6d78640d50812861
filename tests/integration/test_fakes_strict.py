"""The fakes refuse what grpc-go (containerd, koordlet) refuses, on the wire (docs/testing.md).

Requests are sent with a raw HTTP/2 client (:mod:`tests.integration.h2_client`), since gRPC
libraries will not send a 9-digit ``grpc-timeout`` or leave out ``:method``. Each refusal is also
shown not to happen for the same request made valid, so no test passes on a fake that refuses
everything.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2, api_pb2_grpc
from h2.errors import ErrorCodes
from h2.settings import SettingCodes

from krproxy.fakes.containerd import FakeContainerd, RuntimeState, run_fake_containerd
from krproxy.fakes.plugin import FakePlugin, run_fake_plugin
from krproxy.fakes.strict import MAX_MESSAGE, MAX_PLUGIN_REQUEST, GrpcGo
from krproxy.hooks.points import HookPoint
from krproxy.proto.runtime import v1 as cri
from krproxy.proto.runtime import v1alpha1 as hookapi
from tests.conftest import CriClient
from tests.integration.h2_client import framed, grpc_request, request
from tests.integration.support import LIVENESS_LIMIT, in_thread, raw_unary

VERSION = "/runtime.v1.RuntimeService/Version"
HOOK = HookPoint.PRE_CREATE_CONTAINER
HOOK_REQUEST = bytes(
    hookapi.ContainerResourceHookRequest(container_annotations={"a": "b"}).SerializeToString()
)


async def _fake_containerd(nursery: trio.Nursery, sockdir: str, **options: Any) -> tuple[FakeContainerd, str]:
    path = os.path.join(sockdir, "strict-containerd.sock")
    fake = await nursery.start(run_fake_containerd, path, FakeContainerd(**options))
    return fake, path


async def _fake_plugin(nursery: trio.Nursery, sockdir: str, grpc_go: GrpcGo) -> tuple[FakePlugin, str]:
    path = os.path.join(sockdir, "strict-plugin.sock")
    plugin = await nursery.start(run_fake_plugin, path, FakePlugin(grpc_go=grpc_go))
    return plugin, path


async def _peer(
    kind: str, nursery: trio.Nursery, sockdir: str, grpc_go: GrpcGo
) -> tuple[Any, str, str, bytes]:
    """A fake of ``kind`` with the given strictness, the path to call on it and a valid request."""
    if kind == "containerd":
        fake, path = await _fake_containerd(nursery, sockdir, grpc_go=grpc_go)
        return fake, path, VERSION, b""
    plugin, path = await _fake_plugin(nursery, sockdir, grpc_go)
    return plugin, path, HOOK.rpc_path, HOOK_REQUEST


PEERS = ["containerd", "plugin"]


@pytest.mark.parametrize("kind", PEERS)
@pytest.mark.parametrize("value", ["123456789u", "119999808u", "12S", "1.5S", "5"])
async def test_a_malformed_grpc_timeout_resets_as_containerd_1_6(
    nursery: trio.Nursery, sockdir: str, kind: str, value: str
) -> None:
    """A malformed grpc timeout resets the stream as containerd 1 6."""
    peer, path, rpc, message = await _peer(kind, nursery, sockdir, GrpcGo.V1_6)
    if value == "12S":  # the valid control: the same request is answered
        answer = await request(path, grpc_request(rpc, **{"grpc-timeout": value}), framed(message))
        assert (None, 0) == (answer.reset, answer.grpc_status), answer
        assert [] == peer.rejected
        return
    answer = await request(path, grpc_request(rpc, **{"grpc-timeout": value}), framed(message))
    assert ErrorCodes.PROTOCOL_ERROR == answer.reset, answer
    assert ([], False) == (answer.headers, answer.connection_closed)  # only the stream, no answer
    assert [value] == [dict(headers)["grpc-timeout"] for headers, _ in peer.rejected]
    # The connection is fine: the next request on a new one is served, and nothing reached the handler.
    assert 0 == (await request(path, grpc_request(rpc, 2.0), framed(message))).grpc_status


@pytest.mark.parametrize("kind", PEERS)
async def test_a_request_without_method_gets_an_answer_not_silence(
    nursery: trio.Nursery, sockdir: str, kind: str
) -> None:
    """grpclib, which served the fake containerd before, logged a KeyError and never answered: the
    caller waited for its deadline."""
    _, path, rpc, message = await _peer(kind, nursery, sockdir, GrpcGo.V1_6)
    fields = [field for field in grpc_request(rpc, 2.0) if field[0] != ":method"]
    with trio.fail_after(LIVENESS_LIMIT):
        answer = await request(path, fields, framed(message))
    assert ErrorCodes.PROTOCOL_ERROR == answer.reset, answer


@pytest.mark.parametrize("kind", PEERS)
@pytest.mark.parametrize(
    ("fields", "status", "message"),
    [
        (
            grpc_request(VERSION, **{"grpc-timeout": "123456789u"}),
            "400",
            'malformed grpc-timeout: transport: timeout string is too long: "123456789u"',
        ),
        (
            [field for field in grpc_request(VERSION, 2.0) if field[0] != ":method"],
            "405",
            'Received a HEADERS frame with :method "" which should be POST',
        ),
    ],
)
async def test_grpc_go_2_aborts_early_with_internal(
    nursery: trio.Nursery,
    sockdir: str,
    kind: str,
    fields: list[tuple[str, str]],
    status: str,
    message: str,
) -> None:
    """containerd 2.x's grpc-go: HTTP 400 (405 for the method), INTERNAL and the reason, trailers-only."""
    _, path, rpc, body = await _peer(kind, nursery, sockdir, GrpcGo.V2)
    fields = [(name, rpc if name == ":path" else value) for name, value in fields]
    answer = await request(path, fields, framed(body))
    assert (status, 13, message) == (dict(answer.headers)[":status"], answer.grpc_status, answer.grpc_message)
    assert ("application/grpc", b"", []) == (
        dict(answer.headers)["content-type"],
        answer.data,
        answer.trailers,
    )


@pytest.mark.parametrize("kind", PEERS)
@pytest.mark.parametrize("grpc_go", [GrpcGo.V1_6, GrpcGo.V2])
@pytest.mark.parametrize(
    ("field", "refused"),
    [
        (("x-id", "a\x00b"), True),
        (("x-id", "a\r\nx-injected: 1"), True),
        (("x-id", "a\x01"), True),
        (("x-Id", "1"), True),
        (("x(id)", "1"), True),
        (("x-id", " a\tb "), False),  # RFC 9113 §8.2.1 forbids the outer whitespace; grpc-go lets it through
        (("x-id", "caf\u00e9"), False),  # octets above 0x7f (obs-text): grpclib's connection died on them
    ],
    ids=["nul", "crlf", "control", "uppercase-name", "separator-in-name", "outer-whitespace", "obs-text"],
)
async def test_a_field_grpc_go_refuses_resets_the_stream(
    nursery: trio.Nursery,
    sockdir: str,
    kind: str,
    grpc_go: GrpcGo,
    field: tuple[str, str],
    refused: bool,
) -> None:
    """golang.org/x/net/http2 refuses a control character but HTAB in a value, and a regular name
    of other than lowercase token characters, as a stream error before grpc-go's operateHeaders
    sees the request: RST_STREAM PROTOCOL_ERROR, 1.6 and 2.x alike, the connection going on."""
    peer, path, rpc, message = await _peer(kind, nursery, sockdir, grpc_go)
    answer = await request(path, [*grpc_request(rpc, 2.0), field], framed(message))
    if not refused:
        assert (None, 0) == (answer.reset, answer.grpc_status), answer
        assert [] == peer.rejected
        return
    assert (ErrorCodes.PROTOCOL_ERROR, [], False) == (answer.reset, answer.headers, answer.connection_closed)
    assert [field] == [next(f for f in headers if f[0] == field[0]) for headers, _ in peer.rejected]
    assert [None] == [rejection.http_status for _, rejection in peer.rejected]


@pytest.mark.parametrize(("advertised", "expected"), [(None, None), (7, 7)])
async def test_no_max_concurrent_streams_unless_asked_for(
    nursery: trio.Nursery, sockdir: str, advertised: int | None, expected: int | None
) -> None:
    """containerd advertises no SETTINGS_MAX_CONCURRENT_STREAMS (h2, under grpclib, said 100)."""
    _, path = await _fake_containerd(nursery, sockdir, max_concurrent_streams=advertised)
    answer = await request(path, grpc_request(VERSION, 2.0), framed(b""))
    assert 0 == answer.grpc_status
    assert expected == answer.settings.get(SettingCodes.MAX_CONCURRENT_STREAMS)
    # The server's flow-control window is still announced (in the same preface).
    assert SettingCodes.INITIAL_WINDOW_SIZE in answer.settings


async def test_the_fake_plugin_advertises_no_max_concurrent_streams(
    nursery: trio.Nursery, sockdir: str
) -> None:
    """koordlet's grpc-go advertises none either."""
    _, path = await _fake_plugin(nursery, sockdir, GrpcGo.V1_6)
    answer = await request(path, grpc_request(HOOK.rpc_path, 2.0), framed(HOOK_REQUEST))
    assert 0 == answer.grpc_status
    assert SettingCodes.MAX_CONCURRENT_STREAMS not in answer.settings
    assert SettingCodes.INITIAL_WINDOW_SIZE in answer.settings  # the settings frame was read


def _version_request(size: int) -> bytes:
    """A VersionRequest (field 1: a string) of exactly ``size`` bytes on the wire."""
    for header in range(2, 7):
        body = size - header
        length = bytearray()
        value = body
        while True:
            byte, value = value & 0x7F, value >> 7
            length.append(byte | (0x80 if value else 0))
            if not value:
                break
        if 1 + len(length) == header:
            return b"\x0a" + bytes(length) + b"v" * body
    raise AssertionError(size)


@pytest.mark.parametrize(("size", "refused"), [(MAX_PLUGIN_REQUEST, False), (MAX_PLUGIN_REQUEST + 1, True)])
async def test_the_fake_plugin_refuses_a_request_over_4_mib(
    nursery: trio.Nursery,
    sockdir: str,
    channel_to: Callable[[str], grpc.Channel],
    size: int,
    refused: bool,
) -> None:
    """koordlet keeps grpc-go's default receive limit of 4 MiB: RESOURCE_EXHAUSTED above it."""
    plugin, path = await _fake_plugin(nursery, sockdir, GrpcGo.V1_6)

    def hook_request(value: int) -> bytes:
        annotations = {"a": "v" * value}
        return bytes(
            hookapi.ContainerResourceHookRequest(container_annotations=annotations).SerializeToString()
        )

    message = hook_request(size - 16)
    message = hook_request(size - 16 + size - len(message))  # the length prefixes are as long for both
    assert size == len(message)
    call = raw_unary(channel_to(path), HOOK.rpc_path)
    if not refused:
        await in_thread(call, message, timeout=30)
        assert [HOOK] == plugin.hooks_called()
        return
    with pytest.raises(grpc.RpcError) as caught:
        await in_thread(call, message, timeout=30)
    assert grpc.StatusCode.RESOURCE_EXHAUSTED == caught.value.code()
    assert [] == plugin.calls  # refused before the hook server saw it


@pytest.mark.parametrize(("size", "refused"), [(MAX_MESSAGE, False), (MAX_MESSAGE + 1, True)])
async def test_a_request_over_16_mib_is_resource_exhausted(
    fake_containerd: tuple[FakeContainerd, str],
    channel_to: Callable[[str], grpc.Channel],
    size: int,
    refused: bool,
) -> None:
    fake, path = fake_containerd
    call = raw_unary(channel_to(path), VERSION)
    message = _version_request(size)
    assert size == len(message)
    if not refused:
        reply = api_pb2.VersionResponse.FromString(await in_thread(call, message, timeout=30))
        assert reply.runtime_name
        return
    with pytest.raises(grpc.RpcError) as caught:
        await in_thread(call, message, timeout=30)
    assert (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "grpc: received message larger than max (16777217 vs. 16777216)",
    ) == (
        caught.value.code(),
        caught.value.details(),
    )
    assert [] == fake.requests("Version")  # never reached the runtime


async def test_an_answer_over_16_mib_is_resource_exhausted(
    fake_containerd: tuple[FakeContainerd, str],
    cri_client: Callable[[str], CriClient],
    channel_to: Callable[[str], grpc.Channel],
) -> None:
    """Two containers with 9 MiB of labels each: ListContainers would be 18 MiB, as containerd refuses
    to send; each alone lists fine."""
    _, path = fake_containerd
    client = cri_client(path)
    pod = await client.call(
        client.runtime.RunPodSandbox,
        api_pb2.RunPodSandboxRequest(
            config=api_pb2.PodSandboxConfig(metadata=api_pb2.PodSandboxMetadata(name="p"))
        ),
    )
    ids = []
    for name in ("a", "b"):
        config = api_pb2.ContainerConfig(
            metadata=api_pb2.ContainerMetadata(name=name),
            image=api_pb2.ImageSpec(image="busybox"),
            labels={"big": "x" * (9 << 20)},
        )
        reply = await client.call(
            client.runtime.CreateContainer,
            api_pb2.CreateContainerRequest(pod_sandbox_id=pod.pod_sandbox_id, config=config),
        )
        ids.append(reply.container_id)
    one = api_pb2.ListContainersRequest(filter=api_pb2.ContainerFilter(id=ids[0]))
    stub = api_pb2_grpc.RuntimeServiceStub(channel_to(path))  # reads answers up to 64 MiB
    reply = await in_thread(stub.ListContainers, one, timeout=30)
    assert [ids[0]] == [c.id for c in reply.containers]
    with pytest.raises(grpc.RpcError) as caught:
        await in_thread(stub.ListContainers, api_pb2.ListContainersRequest(), timeout=30)
    assert grpc.StatusCode.RESOURCE_EXHAUSTED == caught.value.code()
    assert caught.value.details().startswith("grpc: trying to send message larger than max (")
    assert caught.value.details().endswith(" vs. 16777216)")


async def test_lists_come_in_no_fixed_order_but_a_seed_repeats_them(
    nursery: trio.Nursery, sockdir: str, cri_client: Callable[[str], CriClient]
) -> None:
    state = RuntimeState(order=random.Random(42))
    ids = state.seed(pods=12, containers_per_pod=1)
    _, path = await _fake_containerd(nursery, sockdir, state=state)
    client = cri_client(path)
    orders = []
    for _ in range(5):
        reply = await client.call(client.runtime.ListContainers, api_pb2.ListContainersRequest())
        orders.append(tuple(c.id for c in reply.containers))
    assert {frozenset(ids)} == {frozenset(order) for order in orders}  # the same containers each time
    assert len(set(orders)) > 1  # in another order (12! orders: five alike would be a broken shuffle)

    again = RuntimeState(order=random.Random(42))
    again.seed(pods=12, containers_per_pod=1)
    replay = [
        tuple(c.id for c in again.list_containers(cri.ListContainersRequest()).containers) for _ in range(5)
    ]
    assert orders == replay
