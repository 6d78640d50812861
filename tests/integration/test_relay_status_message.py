"""Tests of 3195fff (status messages krproxy writes, cut at 4 KiB): what a peer reads of them.

A message is any Python text: a handler's exception may carry a lone surrogate (a file name
decoded with ``surrogateescape``, a bug of the plugin's), which UTF-8 cannot encode."""

from __future__ import annotations

import functools
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio

from krproxy.grpcstatus import GRPCError, Status
from krproxy.relay import Relay, Route, connect_unix
from krproxy.relay.grpc import MAX_STATUS_MESSAGE
from krproxy.rpc import Server, unary
from tests.integration.h2_client import grpc_request, request
from tests.integration.support import grpcio_channels, serve_relay
from tests.integration.test_relay_raw_peers import Answer, serving

PLAIN = [(b":status", b"200"), (b"content-type", b"application/grpc")]

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
async def test_a_non_utf8_message_still_answers_server_lives_on(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], grpc.Channel], raised: Exception
) -> None:
    """A message utf8 cannot encode still answers and the server lives on."""

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


async def test_a_long_message_is_cut_at_the_limit_for_any_peer(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], grpc.Channel]
) -> None:
    """A long message reaches grpcio and a raw peer cut at the limit."""
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


async def test_a_runtimes_own_long_message_is_relayed_untouched(
    nursery: trio.Nursery, short_tmp: Path, grpcio: Callable[[str], grpc.Channel]
) -> None:
    """docs/hooks.md: only the messages krproxy writes itself are cut. A runtime's 5.9 KiB status message
    (percent-encoded as the runtime sent it, '%' and non-ASCII included) reaches grpcio whole. (Under
    grpcio's soft limit of 8 KiB: between it and the hard limit of 16 KiB grpcio refuses a random share
    of header blocks, RESOURCE_EXHAUSTED "metadata size exceeds soft limit".)"""
    text = " ".join(["runtime says: ünïcödé 100%"] * 120)
    assert MAX_STATUS_MESSAGE < len(status_quote(text)) < 8192
    upstream = str(short_tmp / "upstream.sock")
    relay = Relay()
    await nursery.start(relay.run)
    relay.configure(Route(relay.transport, "runtime", connect_unix(upstream)), None, {}, [])
    trailers = [(b"grpc-status", b"9"), (b"grpc-message", status_quote(text))]
    with serving(upstream, lambda path, body: Answer(headers=None, trailers=[*PLAIN, *trailers])):
        listen = await serve_relay(nursery, relay, str(short_tmp / "relay.sock"))
        with pytest.raises(grpc.RpcError) as caught:
            await _call(grpcio(listen), "/runtime.v1.RuntimeService/Version")
    assert grpc.StatusCode.FAILED_PRECONDITION == caught.value.code()
    assert text == caught.value.details()


def status_quote(text: str) -> bytes:
    """*text* as grpc-go writes a ``grpc-message``: every byte outside 0x20-0x7e, and '%', as %XX."""
    return "".join(
        c if " " <= c <= "~" and c != "%" else urllib.parse.quote(c, safe="") for c in text
    ).encode()
