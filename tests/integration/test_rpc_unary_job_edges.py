"""Tests of krproxy.rpc's UnaryJob (e28cc99, b0e25ce): a job answered twice, a request in many
DATA frames, a large answer sent late (past the caller's windows), the caller's connection lost
while a job is out, a job never answering when the server stops, and one answering after."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import outcome
import pytest
import trio

from krproxy.rpc import Server
from tests.integration.h2_client import framed, grpc_request, request
from tests.integration.test_rpc_unary_job import AT_ONCE, LATER, LIVENESS_LIMIT, Jobs, call


@pytest.fixture
def grpcio(sock: str) -> Iterator[Callable[[str], Any]]:
    channel = grpc.insecure_channel(
        "unix://" + sock,
        options=[("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)],
    )

    def method(path: str) -> Any:
        return channel.unary_unary(path, request_serializer=None, response_deserializer=None)

    yield method
    channel.close()


def h2_client() -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding="utf-8", validate_inbound_headers=False)
    )
    conn.initiate_connection()
    return conn


async def test_a_job_answering_twice_gives_its_first_answer_only(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], Any]
) -> None:
    """done() called again (with a value, then with an error) after the call ended: dropped, the
    connection and the server serve on, nothing left in flight."""
    jobs = Jobs()
    server = await jobs.serve(nursery, sock)
    with trio.fail_after(LIVENESS_LIMIT):
        future = grpcio(LATER).future(b"x", timeout=LIVENESS_LIMIT)
        await jobs.wait_for(1)
        done = jobs.waiting[0][1]
        done(outcome.Value(b"first"))
        done(outcome.Value(b"second"))
        done(outcome.Error(ValueError("third")))
        assert b"first" == await trio.to_thread.run_sync(future.result)
        await server.transport.wait_idle()
        assert b"cba" == (await call(grpcio(AT_ONCE), b"abc"))[0]  # the same connection
        assert 0 == server.transport.in_flight


async def test_a_request_in_many_data_frames_and_a_large_late_answer(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], Any]
) -> None:
    """A request sent one byte a DATA frame reaches the job whole; an answer of 3 MiB given late
    (far beyond the caller's 64 KiB stream window) is sent as the caller's window updates come."""
    jobs = Jobs()
    await jobs.serve(nursery, sock)
    with trio.fail_after(LIVENESS_LIMIT):
        message = bytes(range(256)) * 3
        conn = h2_client()
        conn.send_headers(1, grpc_request(LATER))
        stream = await trio.open_unix_socket(sock)
        async with stream:
            body = framed(message)
            for at in range(len(body)):
                conn.send_data(1, body[at : at + 1], end_stream=at == len(body) - 1)
            await stream.send_all(conn.data_to_send())
            await jobs.wait_for(1)
            assert message == jobs.waiting[0][0]
            big = bytes(range(251)) * (3 * 4096 + 7)
            jobs.waiting[0][1](outcome.Value(big))
            got = bytearray()
            trailers: list[Any] = []
            while not trailers:
                data = await stream.receive_some(65536)
                assert data, "the connection closed before the answer's trailers"
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.DataReceived):
                        got += event.data
                        conn.acknowledge_received_data(event.flow_controlled_length, 1)
                    elif isinstance(event, h2.events.TrailersReceived):
                        trailers.append(dict(event.headers))
                await stream.send_all(conn.data_to_send())
        assert framed(big) == bytes(got)
        assert "0" == trailers[0]["grpc-status"]
        # and grpcio's own way (its windows, its frames): a large request and a large late answer
        future = grpcio(LATER).future(b"y" * (2 << 20), timeout=LIVENESS_LIMIT)
        await jobs.wait_for(2)
        assert b"y" * (2 << 20) == jobs.waiting[1][0]
        jobs.waiting[1][1](outcome.Value(big))
        assert big == await trio.to_thread.run_sync(future.result)


async def test_the_callers_connection_lost_while_the_job_is_out(nursery: trio.Nursery, sock: str) -> None:
    """The caller closes its socket (no RST_STREAM, no GOAWAY) with the job out: the call is over
    at once, its slot free; the job's later answer is dropped and the server serves on."""
    jobs = Jobs()
    server = await jobs.serve(nursery, sock)
    with trio.fail_after(LIVENESS_LIMIT):
        conn = h2_client()
        conn.send_headers(1, grpc_request(LATER))
        conn.send_data(1, framed(b"gone"), end_stream=True)
        stream = await trio.open_unix_socket(sock)
        await stream.send_all(conn.data_to_send())
        await jobs.wait_for(1)
        assert 1 == server.transport.in_flight
        await stream.aclose()
        await server.transport.wait_idle()
        jobs.waiting[0][1](outcome.Value(b"to nobody"))
        jobs.waiting[0][1](outcome.Error(RuntimeError("to nobody either")))
        assert b"cba" == (await request(sock, grpc_request(AT_ONCE), framed(b"abc"))).message


async def test_a_server_stops_with_a_silent_job_and_a_late_one(
    sock: str, grpcio: Callable[[str], Any]
) -> None:
    """A job that never calls done() for a call without a deadline: drain gives up after its grace,
    serve's cancellation ends the server all the same (the caller sees UNAVAILABLE), and an
    answer given after that (to a job of the stopped server) raises nothing here."""
    jobs = Jobs()
    server = jobs.server()
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve, sock)
            future = grpcio(LATER).future(b"never")  # no deadline
            await jobs.wait_for(1)
            assert not await server.drain(grace=0.5)  # the job never answers
            nursery.cancel_scope.cancel()
        jobs.waiting[0][1](outcome.Value(b"after the end"))
        with pytest.raises(grpc.RpcError) as caught:
            await trio.to_thread.run_sync(future.result)
    assert grpc.StatusCode.UNAVAILABLE == caught.value.code()


def handler_tasks() -> list[str]:
    root = trio.lowlevel.current_root_task()
    assert root is not None
    found, todo = [], [root]
    while todo:
        task = todo.pop()
        found.append(task.name)
        todo += [child for nursery in task.child_nurseries for child in nursery.child_tasks]
    return [name for name in found if "Served.run" in name]


async def with_task_path(nursery: trio.Nursery, jobs: Jobs, sock: str) -> Server:
    """The job's server with an ``async def`` check_headers: each job runs from its call's task."""

    async def check(stream: Any) -> bool:
        return True

    return await jobs.serve(nursery, sock, check_headers=check)


async def test_from_a_task_a_job_answering_twice_gives_the_first(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], Any]
) -> None:
    """The same as the first test, the job run from its call's task (an async check_headers) and
    its answers handed back as AppWorker hands them, as run_sync_soon callbacks."""
    jobs = Jobs()
    server = await with_task_path(nursery, jobs, sock)
    token = trio.lowlevel.current_trio_token()
    with trio.fail_after(LIVENESS_LIMIT):
        future = grpcio(LATER).future(b"x", timeout=LIVENESS_LIMIT)
        await jobs.wait_for(1)
        done = jobs.waiting[0][1]
        token.run_sync_soon(done, outcome.Value(b"first"))
        token.run_sync_soon(done, outcome.Value(b"second"))
        assert b"first" == await trio.to_thread.run_sync(future.result)
        token.run_sync_soon(done, outcome.Error(ValueError("third")))
        await server.transport.wait_idle()
        for _ in range(3):
            assert b"cba" == (await call(grpcio(AT_ONCE), b"abc"))[0]
        assert [] == handler_tasks()


async def test_from_a_task_a_silent_job_leaves_no_task_behind(nursery: trio.Nursery, sock: str) -> None:
    """The job run from its call's task never answers: the caller's deadline ends the call
    DEADLINE_EXCEEDED, and the call's task with it (as the job's own call without a task): a
    task left waiting would hold the server's end (serve's cancellation) until the job answers."""
    jobs = Jobs()
    await with_task_path(nursery, jobs, sock)
    try:
        with trio.fail_after(LIVENESS_LIMIT):
            answer = await request(sock, grpc_request(LATER, timeout=0.5), framed(b"x"))
            assert 4 == answer.grpc_status  # DEADLINE_EXCEEDED
            while handler_tasks():  # noqa: ASYNC110 - bounded by fail_after
                await trio.sleep(0.05)
    finally:
        for _, done in jobs.waiting:  # (so that a failing test does not hang the server's end)
            done(outcome.Value(b"late"))
