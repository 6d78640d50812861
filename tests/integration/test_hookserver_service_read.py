"""Where the served SDK reads a blocking stage's request, over its socket: on the loop's thread below
``READ_ON_LOOP_BELOW`` bytes as decompressed, in the worker from there on; an empty message read as
the empty request; a reading that fails unexpectedly is that call's UNKNOWN, alike on either thread,
and the server answers the next call.

Each test bounds itself with ``fail_after``; the hook server is cancelled before the test returns.
"""

from __future__ import annotations

import gzip
import logging
import pathlib
import threading
from collections.abc import Callable
from typing import Any

import pytest
import trio

from krproxy import rpc
from krproxy.grpcstatus import GRPCError, Status
from krproxy.hookserver import ContainerContext, HookServer, ServeOptions, Stage, _service, _wire, serve
from krproxy.hookserver.testing import FakeNode, container_request, pod_request
from krproxy.proto.runtime import v1alpha1 as pb
from tests.integration.h2_client import grpc_request, request
from tests.integration.support import LIVENESS_LIMIT

STAGE = Stage.PRE_CREATE_CONTAINER


def _served(
    short_tmp: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[HookServer, ServeOptions, list[str]]:
    """An app with one blocking function at ``STAGE`` (it adds ``SEEN``: the container's name) whose
    readings record their thread's name, in order; a request for a container named ``explode`` fails
    to read with a RuntimeError once decoded."""
    reads: list[str] = []
    read = _wire.container_info

    def container_info(request: bytes) -> Any:
        reads.append(threading.current_thread().name)
        req, info = read(request)
        if info.name == "explode":
            raise RuntimeError("the reading blew up")
        return req, info

    monkeypatch.setattr(_wire, "container_info", container_info)
    app = HookServer(executor=FakeNode(short_tmp / "node").create().executor())

    @app.hook(STAGE, name="blocking")
    def blocking(ctx: ContainerContext) -> None:
        ctx.response.add_envs["SEEN"] = ctx.request.name

    options = ServeOptions(socket=str(short_tmp / "hs.sock"), hook_dir=str(short_tmp / "hookserver.d"))
    return app, options, reads


def _request(name: str, pad: int = 0) -> bytes:
    """A container request for ``name``, with an annotation of ``pad`` bytes."""
    req = container_request(pod_request("web"), name, annotations={"pad": "x" * pad} if pad else None)
    return bytes(req.SerializeToString())


def _gzipped(message: bytes) -> bytes:
    zipped = gzip.compress(message)
    return b"\x01" + len(zipped).to_bytes(4, "big") + zipped


def _envs(reply: bytes) -> dict[str, str]:
    return dict(pb.ContainerResourceHookResponse.FromString(reply).container_envs)


async def _serving(app: HookServer, options: ServeOptions, test: Callable[[], Any]) -> None:
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, options)
            await test()
            nursery.cancel_scope.cancel()


async def test_compressed_read_by_decompressed_size(
    short_tmp: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gzip request is read where its decompressed size says: a small one on the loop's thread, one
    of READ_ON_LOOP_BELOW bytes or more (a few hundred on the wire) in the worker; both answered."""
    app, options, reads = _served(short_tmp, monkeypatch)
    small, large = _request("small"), _request("large", pad=_service.READ_ON_LOOP_BELOW)
    assert len(_gzipped(large)) < 1024

    async def test() -> None:
        for message in (small, large):
            answer = await request(
                options.socket, grpc_request(STAGE.rpc_path, **{"grpc-encoding": "gzip"}), _gzipped(message)
            )
            assert 0 == answer.grpc_status, answer
            assert {"SEEN": pb.ContainerResourceHookRequest.FromString(message).container_meta.name} == _envs(
                answer.message
            )

    await _serving(app, options, test)
    assert [threading.main_thread().name, "krproxy-hookserver-app"] == reads


async def test_compressed_above_the_limit(short_tmp: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gzip request that decompresses above the server's largest request ends RESOURCE_EXHAUSTED
    unread, and the server answers the next call."""
    app, options, reads = _served(short_tmp, monkeypatch)
    huge = _request("huge", pad=rpc.server.MAX_REQUEST)

    async def test() -> None:
        answer = await request(
            options.socket, grpc_request(STAGE.rpc_path, **{"grpc-encoding": "gzip"}), _gzipped(huge)
        )
        assert Status.RESOURCE_EXHAUSTED == answer.grpc_status, answer
        assert "larger than max" in answer.grpc_message
        async with rpc.Channel(options.socket) as channel:
            assert {"SEEN": "next"} == _envs(await channel.unary(STAGE.rpc_path, _request("next"), timeout=5))

    await _serving(app, options, test)
    assert [threading.main_thread().name] == reads


async def test_empty_message(short_tmp: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty request message is the empty request (as grpc-go's server reads it): read on the
    loop's thread, the function runs on its empty record and the answer is the empty echo."""
    app, options, reads = _served(short_tmp, monkeypatch)

    async def test() -> None:
        async with rpc.Channel(options.socket) as channel:
            reply = await channel.unary(STAGE.rpc_path, b"", timeout=5)
        assert pb.ContainerResourceHookResponse(
            container_envs={"SEEN": ""}
        ) == pb.ContainerResourceHookResponse.FromString(reply)

    await _serving(app, options, test)
    assert [threading.main_thread().name] == reads


async def test_reading_fails_unexpectedly(
    short_tmp: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A reading that raises what no decode error is (a bug) ends that call UNKNOWN naming it, the same
    whether the request was read on the loop's thread or in the worker; it is logged, no function
    runs, and the server answers the next call."""
    app, options, reads = _served(short_tmp, monkeypatch)
    statuses: list[tuple[Status, str | None]] = []

    async def test() -> None:
        async with rpc.Channel(options.socket) as channel:
            for message in (_request("explode"), _request("explode", pad=_service.READ_ON_LOOP_BELOW)):
                with pytest.raises(GRPCError) as info:
                    await channel.unary(STAGE.rpc_path, message, timeout=5)
                statuses.append((info.value.status, info.value.message))
            assert {"SEEN": "next"} == _envs(await channel.unary(STAGE.rpc_path, _request("next"), timeout=5))

    with caplog.at_level(logging.ERROR):
        await _serving(app, options, test)
    assert [(Status.UNKNOWN, "RuntimeError: the reading blew up")] * 2 == statuses
    assert [threading.main_thread().name, "krproxy-hookserver-app", threading.main_thread().name] == reads
    failed = [r for r in caplog.records if r.getMessage() == f"handler of {STAGE.rpc_path} failed"]
    assert 2 == len(failed)  # (the worker's without its exception: test_rpc_unary_job.py's xfail)
    assert failed[0].exc_info is not None and RuntimeError is failed[0].exc_info[0]
