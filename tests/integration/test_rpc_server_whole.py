"""krproxy.rpc.Server and whole requests: a UnaryJob's request whose one message comes in the
DATA frame read with its HEADERS is answered at once without a served call; every other request
takes the served call's path, with the same answers, and the connection's state ends the same."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import h2.exceptions
import outcome
import pytest
import trio

from krproxy import calls
from krproxy.h2.connection import CONNECTION_WINDOW
from krproxy.relay.served import Served
from krproxy.rpc import Server
from tests.integration.h2_client import framed, grpc_request, request
from tests.integration.test_rpc_unary_job import AT_ONCE, LATER, LIVENESS_LIMIT, Jobs
from tests.integration.test_rpc_unary_job_edges import h2_client


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The path of each served call made, in order."""
    made: list[str] = []
    init = Served.__init__

    def counted(self: Served, transport: Any, path: str, *args: Any) -> None:
        made.append(path)
        init(self, transport, path, *args)

    monkeypatch.setattr(Served, "__init__", counted)
    return made


def left_behind(server: Server) -> list[Any]:
    """Streams and halves the server's connections still hold."""
    return [(ep.halves, ep.h2.streams) for ep in server.transport._clients if ep.halves or ep.h2.streams]


def credit_kept(server: Server) -> list[int]:
    """Connection credit of the server's connections neither given back nor due to be."""
    return [
        CONNECTION_WINDOW - ep.h2.inflow.recv_window - ep.h2.inflow.to_grant
        for ep in server.transport._clients
        if ep.h2.inflow.recv_window + ep.h2.inflow.to_grant != CONNECTION_WINDOW
    ]


async def test_answered_at_once(
    nursery: trio.Nursery, sock: str, served: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """HEADERS then the whole message in one DATA frame, answered at once: no served call, the
    answer and its status as before (a raising start logged with its traceback), nothing left
    in flight or held."""
    jobs = Jobs()
    server = await jobs.serve(nursery, sock)
    with trio.fail_after(LIVENESS_LIMIT):
        answer = await request(sock, grpc_request(AT_ONCE, timeout=5.0), framed(b"abc"))
        assert (b"cba", 0) == (answer.message, answer.grpc_status)
        failed = await request(sock, grpc_request(AT_ONCE, timeout=5.0), framed(b"grpc-error"))
        assert (9, "not now") == (failed.grpc_status, failed.grpc_message)
        raised = await request(sock, grpc_request(AT_ONCE), framed(b"raise"))
        assert 2 == raised.grpc_status and "raised by start" in raised.grpc_message
    (logged,) = [r for r in caplog.records if r.exc_info is not None]
    assert logged.exc_info is not None and KeyError is logged.exc_info[0]
    assert [AT_ONCE, AT_ONCE] == served  # the errors took the served call's path
    assert 0 == server.transport.in_flight
    assert [] == left_behind(server)


@contextlib.asynccontextmanager
async def connected(
    nursery: trio.Nursery, sock: str
) -> AsyncIterator[tuple[Jobs, Server, Any, trio.SocketStream]]:
    """The Jobs' server on ``sock``, and an h2 client's connection to it (within LIVENESS_LIMIT)."""
    jobs = Jobs()
    server = await jobs.serve(nursery, sock)
    stream = await trio.open_unix_socket(sock)
    async with stream:
        with trio.fail_after(LIVENESS_LIMIT):
            yield jobs, server, h2_client(), stream


async def test_one_connection_keeps_no_credit(nursery: trio.Nursery, sock: str, served: list[str]) -> None:
    """Calls answered at once and later on one connection: every stream released, every byte
    of their requests credited back to the connection."""
    async with connected(nursery, sock) as (jobs, server, conn, stream):
        for stream_id, path in ((1, AT_ONCE), (3, LATER), (5, AT_ONCE)):
            conn.send_headers(stream_id, grpc_request(path, timeout=5.0))
            conn.send_data(stream_id, framed(b"x" * 100), end_stream=True)
        await stream.send_all(conn.data_to_send())
        await jobs.wait_for(1)
        jobs.waiting[0][1](outcome.Value(b"later"))
        ended = 0
        while ended < 3:
            for event in conn.receive_data(await stream.receive_some(65536)):
                ended += type(event).__name__ == "StreamEnded"
            await stream.send_all(conn.data_to_send())
        await server.transport.wait_idle()
        assert [LATER] == served
        assert [] == left_behind(server)
        assert [] == credit_kept(server)


async def test_others_take_the_served_path(nursery: trio.Nursery, sock: str, served: list[str]) -> None:
    """A late answer, a message in two DATA frames, DATA sent after the HEADERS' read: served calls."""
    jobs = Jobs()
    server = await jobs.serve(nursery, sock)
    with trio.fail_after(LIVENESS_LIMIT):
        nursery.start_soon(request, sock, grpc_request(LATER, timeout=5.0), framed(b"x"))
        await jobs.wait_for(1)
        assert b"x" == jobs.waiting[0][0]
        assert [LATER] == served
        conn = h2_client()
        conn.send_headers(1, grpc_request(AT_ONCE, timeout=5.0))
        body = framed(b"abc")
        conn.send_data(1, body[:3])
        conn.send_data(1, body[3:], end_stream=True)
        stream = await trio.open_unix_socket(sock)
        async with stream:
            await stream.send_all(conn.data_to_send())
            while len(served) < 2:  # noqa: ASYNC110 - the served call made as the frames are read
                await trio.sleep(0.01)
            conn.send_headers(3, grpc_request(AT_ONCE, timeout=5.0))
            await stream.send_all(conn.data_to_send())
            while len(served) < 3:  # noqa: ASYNC110 - the HEADERS read alone
                await trio.sleep(0.01)
            conn.send_data(3, framed(b"def"), end_stream=True)
            await stream.send_all(conn.data_to_send())
            await server.transport.wait_idle()
    assert [LATER, AT_ONCE, AT_ONCE] == served


async def test_limits_and_observers_take_the_served_path(
    nursery: trio.Nursery, sock: str, served: list[str]
) -> None:
    """A message over max_request, a compressed one, and any call with observers: served calls,
    answered as before (RESOURCE_EXHAUSTED, UNIMPLEMENTED for compression, the record)."""
    jobs = Jobs()
    server = await jobs.serve(nursery, sock, max_request=10)
    records: list[calls.CallRecord] = []
    with trio.fail_after(LIVENESS_LIMIT):
        big = await request(sock, grpc_request(AT_ONCE), framed(b"x" * 11))
        assert 8 == big.grpc_status  # RESOURCE_EXHAUSTED
        compressed = await request(sock, grpc_request(AT_ONCE), b"\x01" + framed(b"abc")[1:])
        assert compressed.grpc_status not in (None, 0)
        server.transport.observers.append(records.append)
        answer = await request(sock, grpc_request(AT_ONCE), framed(b"abc"))
        assert b"cba" == answer.message
    assert [AT_ONCE, AT_ONCE, AT_ONCE] == served
    assert [AT_ONCE] == [record.path for record in records]


async def test_a_stream_error_on_its_data(nursery: trio.Nursery, sock: str, served: list[str]) -> None:
    """The core resets the stream at its one DATA frame (longer than its content-length): the
    served call is made and reset as before, nothing left behind, the next call answered."""
    jobs = Jobs()
    server = await jobs.serve(nursery, sock)
    with trio.fail_after(LIVENESS_LIMIT):
        fields = [*grpc_request(AT_ONCE, timeout=5.0), ("content-length", "3")]
        answer = await request(sock, fields, framed(b"abc"))
        assert (1, None) == (answer.reset, answer.grpc_status)  # PROTOCOL_ERROR
        await server.transport.wait_idle()
        assert b"cba" == (await request(sock, grpc_request(AT_ONCE, timeout=5.0), framed(b"abc"))).message
    assert [AT_ONCE] == served and 1 == len(jobs.tasks)  # the job started for the second only
    assert 0 == server.transport.in_flight
    assert [] == left_behind(server)


async def test_a_drain_after_calls_answered_at_once(
    nursery: trio.Nursery, sock: str, served: list[str]
) -> None:
    """A connection whose calls were all answered at once holds nothing: the server's drain
    ends at once, the connection closed after its GOAWAYs."""
    async with connected(nursery, sock) as (_, server, conn, stream):
        conn.send_headers(1, grpc_request(AT_ONCE))
        conn.send_data(1, framed(b"abc"), end_stream=True)
        await stream.send_all(conn.data_to_send())
        ended = False
        while not ended:
            for event in conn.receive_data(await stream.receive_some(65536)):
                ended = ended or type(event).__name__ == "StreamEnded"
        async with trio.open_nursery() as peer:

            async def read() -> None:
                while data := await stream.receive_some(65536):
                    try:
                        conn.receive_data(data)
                    except h2.exceptions.ProtocolError:  # (h2 takes no PING after a GOAWAY)
                        continue
                    await stream.send_all(conn.data_to_send())

            peer.start_soon(read)
            assert await server.drain(LIVENESS_LIMIT)
        assert not server.transport._clients
    assert [] == served
