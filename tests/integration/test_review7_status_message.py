"""Review of 3195fff (status messages krproxy writes, cut at 4 KiB): what a peer reads of them.

A message is any Python text: a handler's exception may carry a lone surrogate (a file name
decoded with ``surrogateescape``, a bug of the plugin's), which UTF-8 cannot encode."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import trio

from krproxy.grpcstatus import GRPCError, Status
from krproxy.relay._grpc import MAX_STATUS_MESSAGE
from krproxy.rpc import Server, unary
from tests.integration.h2_client import grpc_request, request
from tests.integration.support import grpcio_channels

LIVENESS_LIMIT = 30.0  # seconds: a bound on what must happen, not a speed claim


@pytest.fixture
def grpcio() -> Iterator[Callable[[str], grpc.Channel]]:
    with grpcio_channels() as open_channel:
        yield open_channel


async def _call(channel: grpc.Channel, path: str, message: bytes = b"x") -> Any:
    method = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
    return await trio.to_thread.run_sync(functools.partial(method.with_call, message, timeout=LIVENESS_LIMIT))


async def _echo(message: bytes) -> bytes:
    return message


@pytest.mark.parametrize(
    "raised",
    [
        GRPCError(Status.FAILED_PRECONDITION, "no cgroup at /sys/fs/cgroup/\udcff"),
        OSError(2, "No such file or directory", "/run/plugin-\udcfe.sock"),
    ],
    ids=["grpc-error", "other-exception"],
)
async def test_a_message_utf8_cannot_encode_still_answers_and_the_server_lives_on(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], grpc.Channel], raised: Exception
) -> None:
    async def refuse(message: bytes) -> bytes:
        raise raised

    await nursery.start(Server({"/t.S/Refuse": unary(refuse), "/t.S/Echo": unary(_echo)}).serve, sock)
    channel = grpcio(sock)
    with pytest.raises(grpc.RpcError) as caught:
        await _call(channel, "/t.S/Refuse")
    expected = (
        grpc.StatusCode.FAILED_PRECONDITION if isinstance(raised, GRPCError) else grpc.StatusCode.UNKNOWN
    )
    assert expected == caught.value.code()
    assert "\\udcf" in caught.value.details()  # the character UTF-8 cannot encode, escaped
    assert "/sys/fs/cgroup/" in caught.value.details() or "/run/plugin-" in caught.value.details()
    reply, _ = await _call(channel, "/t.S/Echo", b"still here")
    assert b"still here" == reply


async def test_a_long_message_reaches_grpcio_and_a_raw_peer_cut_at_the_limit(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], grpc.Channel]
) -> None:
    text = "ünïcödé %" * 5000

    async def refuse(message: bytes) -> bytes:
        raise GRPCError(Status.INVALID_ARGUMENT, text)

    await nursery.start(Server({"/t.S/Refuse": unary(refuse)}).serve, sock)
    with pytest.raises(grpc.RpcError) as caught:
        await _call(grpcio(sock), "/t.S/Refuse")
    assert grpc.StatusCode.INVALID_ARGUMENT == caught.value.code()
    details = caught.value.details()
    assert details.endswith(" more characters cut by krproxy)")
    kept = details[: details.index(" ... (")]
    assert text.startswith(kept) and kept
    cut = int(details.rsplit("(", 1)[1].split()[0])
    assert len(text) == len(kept) + cut
    answer = await request(sock, grpc_request("/t.S/Refuse"), b"")
    (value,) = [v for n, v in answer.headers if n == "grpc-message"]
    assert len(value.encode()) <= MAX_STATUS_MESSAGE
