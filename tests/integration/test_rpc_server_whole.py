"""krproxy.rpc.Server and whole requests: a UnaryJob's request whose one message comes in the
DATA frame read with its HEADERS is answered at once without a served call; every other request
takes the served call's path, with the same answers, and the connection's state ends the same."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import h2.exceptions
import h2.settings
import outcome
import pytest
import trio

from krproxy import calls
from krproxy.h2 import frames as f
from krproxy.h2.connection import CONNECTION_WINDOW
from krproxy.relay.served import Served
from krproxy.rpc import Server, UnaryJob
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


SYNC_DONE = "/t.S/SyncDone"
WRONG_TYPE = "/t.S/WrongType"
BIG = "/t.S/Big"
RAW = "/t.S/Raw"
ASYNC = "/t.S/Async"


def _sync_done(request: bytes, done: Any) -> None:
    done(outcome.Value(request.upper()))  # answered through done() before start returns


def _wrong_type(request: bytes, done: Any) -> outcome.Outcome[bytes]:
    return outcome.Value(request.decode())  # type: ignore[arg-type]  # a str, not bytes


async def _async_start(request: bytes, done: Any) -> outcome.Outcome[bytes]:
    return outcome.Value(request)  # (an async start: its call returns a coroutine)


async def both_ways(sock: str, fields: list[tuple[str, str]], body: bytes) -> tuple[Any, Any]:
    """The answers to one request sent whole (its DATA read with its HEADERS) and with its
    DATA padded (which the core never reads whole: the served call's path), settings aside."""
    whole = await request(sock, fields, body)
    padded = await request(sock, fields, body, padding=4)
    whole.settings = padded.settings = {}
    return whole, padded


async def serve_jobs(nursery: trio.Nursery, sock: str, jobs: Jobs) -> Server:
    server = Server(
        {
            AT_ONCE: jobs.at_once,
            LATER: jobs.later,
            SYNC_DONE: UnaryJob(_sync_done),
            WRONG_TYPE: UnaryJob(_wrong_type),
            BIG: UnaryJob(lambda request, done: outcome.Value(request * 5000)),
            RAW: UnaryJob(lambda request, done: request),  # type: ignore[arg-type,return-value]
            ASYNC: UnaryJob(_async_start),  # type: ignore[arg-type]
        }
    )
    await nursery.start(server.serve, sock)
    return server


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"grpc-timeout": "0n"},
        {"grpc-timeout": "1n"},
        {"grpc-timeout": "abc"},
        {"grpc-timeout": "99999999H"},
        {"grpc-encoding": "gzip"},
        {"grpc-encoding": "br"},
        {"content-length": "8"},
    ],
)
async def test_headers_answered_alike(nursery: trio.Nursery, sock: str, extra: dict[str, str]) -> None:
    """The same request with odd headers (grpc-timeout zero, tiny, malformed, huge; an
    encoding; content-length): the same answer whole and padded."""
    await serve_jobs(nursery, sock, Jobs())
    with trio.fail_after(LIVENESS_LIMIT):
        whole, padded = await both_ways(sock, grpc_request(AT_ONCE, **extra), framed(b"abc"))
    assert padded == whole


@pytest.mark.parametrize(
    "body",
    [
        framed(b""),
        framed(b"abc") + framed(b"def"),
        framed(b"abc")[:-1],
        b"\x00\x00\x00\x00\x02abc",
        b"\x01" + framed(b"abc")[1:],
        b"",
        b"\x00\x00",
    ],
)
async def test_bodies_answered_alike(nursery: trio.Nursery, sock: str, body: bytes) -> None:
    """Odd bodies (empty message, two messages, a prefix longer or shorter than the DATA, the
    compressed flag without an encoding, no bytes, a cut prefix): the same answer both ways."""
    await serve_jobs(nursery, sock, Jobs())
    with trio.fail_after(LIVENESS_LIMIT):
        whole, padded = await both_ways(sock, grpc_request(AT_ONCE), body)
    assert padded == whole


async def test_done_within_start(nursery: trio.Nursery, sock: str) -> None:
    """A job calling done() before its start returns (None): answered whole as padded."""
    server = await serve_jobs(nursery, sock, Jobs())
    with trio.fail_after(LIVENESS_LIMIT):
        whole, padded = await both_ways(sock, grpc_request(SYNC_DONE), framed(b"abc"))
    assert (b"ABC", 0) == (padded.message, padded.grpc_status)
    assert padded == whole
    assert 0 == server.transport.in_flight


async def test_a_wrong_answer_type(nursery: trio.Nursery, sock: str) -> None:
    """A job answering a str, not bytes: its call's error (UNKNOWN, as a unary handler's
    send_message of a str), the same whole and padded, and the connection serves on."""
    await serve_jobs(nursery, sock, Jobs())
    with trio.fail_after(LIVENESS_LIMIT):
        whole, padded = await both_ways(sock, grpc_request(WRONG_TYPE), framed(b"abc"))
        assert (2, False) == (padded.grpc_status, padded.connection_closed)
        assert padded == whole
        assert b"cba" == (await request(sock, grpc_request(AT_ONCE), framed(b"abc"))).message


async def test_a_late_answer_past_its_deadline(nursery: trio.Nursery, sock: str) -> None:
    """A job answering later, the caller's deadline short: DEADLINE_EXCEEDED both ways, the
    late answer dropped, nothing in flight."""
    jobs = Jobs()
    server = await serve_jobs(nursery, sock, jobs)
    with trio.fail_after(LIVENESS_LIMIT):
        whole, padded = await both_ways(sock, grpc_request(LATER, timeout=0.05), framed(b"x"))
        assert (4, 4) == (whole.grpc_status, padded.grpc_status)
        assert padded == whole
        for _, done in jobs.waiting:
            done(outcome.Value(b"late"))
        assert 0 == server.transport.in_flight
        assert b"cba" == (await request(sock, grpc_request(AT_ONCE), framed(b"abc"))).message


async def outcomes(conn: Any, stream: trio.SocketStream, ids: set[int]) -> dict[int, Any]:
    """Each of ``ids``' end as the h2 client reads it: ("reset", code) or ("ended", grpc-status)."""
    ended: dict[int, Any] = {}
    status: dict[int, str] = {}
    while not ids <= ended.keys():
        data = await stream.receive_some(65536)
        assert data, ended
        for event in conn.receive_data(data):
            name = type(event).__name__
            if name == "TrailersReceived" or name == "ResponseReceived":
                for key, value in event.headers:
                    if key == "grpc-status":
                        status[event.stream_id] = value
            elif name == "DataReceived":
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif name == "StreamEnded":
                ended[event.stream_id] = ("ended", status.get(event.stream_id))
            elif name == "StreamReset":
                ended[event.stream_id] = ("reset", int(event.error_code))
        await stream.send_all(conn.data_to_send())
    return ended


@pytest.mark.parametrize("padding", [None, 4])
async def test_the_stream_limit_alike(nursery: trio.Nursery, sock: str, padding: int | None) -> None:
    """max_streams=1, in one read: a request answered at once, one answered later, one beyond
    the limit, then the late one reset by its caller: the same ends whole and padded, every
    byte credited back, nothing left in flight or held."""
    jobs = Jobs()
    server = Server({AT_ONCE: jobs.at_once, LATER: jobs.later}, max_streams=1)
    await nursery.start(server.serve, sock)
    stream = await trio.open_unix_socket(sock)
    async with stream:
        with trio.fail_after(LIVENESS_LIMIT):
            conn = h2_client()
            for stream_id, path in ((1, AT_ONCE), (3, LATER), (5, AT_ONCE)):
                conn.send_headers(stream_id, grpc_request(path, timeout=5.0))
                conn.send_data(stream_id, framed(b"x" * 100), end_stream=True, pad_length=padding)
            await stream.send_all(conn.data_to_send())
            assert {1: ("ended", "0"), 5: ("reset", 7)} == await outcomes(conn, stream, {1, 5})
            await jobs.wait_for(1)
            conn.reset_stream(3, 8)  # CANCEL
            conn.send_headers(7, grpc_request(AT_ONCE, timeout=5.0))
            conn.send_data(7, framed(b"abc"), end_stream=True, pad_length=padding)
            await stream.send_all(conn.data_to_send())
            assert {7: ("ended", "0")} == await outcomes(conn, stream, {7})
            jobs.waiting[0][1](outcome.Value(b"too late"))
            await server.transport.wait_idle()
            assert [] == left_behind(server)
            assert [] == credit_kept(server)
            assert 0 == sum(ep.collected for ep in server.transport._clients)


@pytest.mark.parametrize("padding", [None, 4])
async def test_many_in_one_read_then_goaway(nursery: trio.Nursery, sock: str, padding: int | None) -> None:
    """Fifty requests answered at once and the caller's GOAWAY in one read: fifty answers,
    every byte credited back, nothing left behind, whole and padded."""
    jobs = Jobs()
    server = await jobs.serve(nursery, sock)
    stream = await trio.open_unix_socket(sock)
    async with stream:
        with trio.fail_after(LIVENESS_LIMIT):
            conn = h2_client()
            ids = set(range(1, 101, 2))
            for stream_id in sorted(ids):
                conn.send_headers(stream_id, grpc_request(AT_ONCE))
                conn.send_data(stream_id, framed(b"%d" % stream_id), end_stream=True, pad_length=padding)
            goaway = f.goaway(0, f.NO_ERROR, b"")  # (raw: h2 reads nothing after its own)
            await stream.send_all(conn.data_to_send() + goaway)  # (one write: read in one step)
            ends = await outcomes(conn, stream, ids)
            assert {stream_id: ("ended", "0") for stream_id in ids} == ends
            await server.transport.wait_idle()
            assert [] == left_behind(server)
            assert [] == credit_kept(server)


@pytest.mark.parametrize("padding", [None, 4])
async def test_a_reset_in_the_same_read(nursery: trio.Nursery, sock: str, padding: int | None) -> None:
    """Requests answered at once and later, each followed by its caller's RST_STREAM in the
    same read: the late job's answer dropped, the connection serves on, nothing left behind,
    every byte credited back, whole and padded."""
    jobs = Jobs()
    server = await jobs.serve(nursery, sock)
    stream = await trio.open_unix_socket(sock)
    async with stream:
        with trio.fail_after(LIVENESS_LIMIT):
            conn = h2_client()
            wire = b""
            for stream_id, path in ((1, AT_ONCE), (3, LATER)):
                conn.send_headers(stream_id, grpc_request(path, timeout=5.0))
                conn.send_data(stream_id, framed(b"x" * 100), end_stream=True, pad_length=padding)
                wire += conn.data_to_send() + f.rst_stream(stream_id, f.CANCEL)
            await stream.send_all(wire)  # (raw resets: h2 sends none on a stream it ended)
            await jobs.wait_for(1)
            jobs.waiting[0][1](outcome.Value(b"too late"))
            await server.transport.wait_idle()
            conn.send_headers(5, grpc_request(AT_ONCE, timeout=5.0))
            conn.send_data(5, framed(b"abc"), end_stream=True, pad_length=padding)
            await stream.send_all(conn.data_to_send())
            ends = await outcomes(conn, stream, {5})
            assert ("ended", "0") == ends[5]
            assert [] == left_behind(server)
            assert [] == credit_kept(server)
            assert 0 == server.transport.in_flight


@pytest.mark.parametrize(
    ("settings", "path"),
    [
        ({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 3}, AT_ONCE),
        ({h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 40}, AT_ONCE),
        ({}, BIG),
    ],
)
async def test_an_answer_too_large_to_go_at_once(
    nursery: trio.Nursery, sock: str, settings: dict[int, int], path: str
) -> None:
    """The caller's stream window under the answer, its header list limit under the answer's
    headers, an answer over a frame: the same frames' content whole and padded, nothing left."""
    server = await serve_jobs(nursery, sock, Jobs())
    answers = []
    for padding in (None, 4):
        stream = await trio.open_unix_socket(sock)
        async with stream:
            with trio.fail_after(LIVENESS_LIMIT):
                conn = h2_client()
                conn.update_settings(settings)
                conn.send_headers(1, grpc_request(path))
                conn.send_data(1, framed(b"abcd"), end_stream=True, pad_length=padding)
                await stream.send_all(conn.data_to_send())
                seen: list[Any] = []
                while not any(type(e).__name__ in ("StreamEnded", "StreamReset") for e in seen):
                    for event in conn.receive_data(await stream.receive_some(65536)):
                        seen.append(event)
                        if type(event).__name__ == "DataReceived":
                            conn.acknowledge_received_data(event.flow_controlled_length, 1)
                    await stream.send_all(conn.data_to_send())
                answers.append(
                    [
                        (type(e).__name__, getattr(e, "headers", None), getattr(e, "error_code", None))
                        for e in seen
                        if type(e).__name__ in ("ResponseReceived", "TrailersReceived", "StreamReset")
                    ]
                    + [b"".join(getattr(e, "data", b"") for e in seen if type(e).__name__ == "DataReceived")]
                )
                await server.transport.wait_idle()
                assert [] == left_behind(server)
    assert answers[1] == answers[0]


@pytest.mark.parametrize(
    "path", ["/t.S/AtOnce?x=1", "//t.S/AtOnce", "/t.S/AtOnc%65", "/t.S/atonce", "t.S/AtOnce"]
)
async def test_odd_paths_answered_alike(nursery: trio.Nursery, sock: str, path: str) -> None:
    """:path spelled oddly (a query, a double slash, percent-encoded, another case, no slash):
    the same answer whole and padded."""
    await serve_jobs(nursery, sock, Jobs())
    with trio.fail_after(LIVENESS_LIMIT):
        whole, padded = await both_ways(sock, grpc_request(path), framed(b"abc"))
    assert padded == whole


@pytest.mark.parametrize("path", [RAW, ASYNC])
async def test_a_start_returning_no_outcome(nursery: trio.Nursery, sock: str, path: str) -> None:
    """A job's start returning bytes, or a coroutine (an async start): its call's error
    (UNKNOWN), the same whole and padded, and the connection serves on."""
    await serve_jobs(nursery, sock, Jobs())
    with trio.fail_after(LIVENESS_LIMIT):
        whole, padded = await both_ways(sock, grpc_request(path), framed(b"abc"))
        assert (2, False) == (padded.grpc_status, padded.connection_closed)
        assert padded == whole
        assert b"cba" == (await request(sock, grpc_request(AT_ONCE), framed(b"abc"))).message


@pytest.mark.parametrize("written", ["0n", "1n", "1u", "10m"])
async def test_a_late_answer_past_a_tiny_deadline(nursery: trio.Nursery, sock: str, written: str) -> None:
    """grpc-timeout zero or tiny, the job answering later: DEADLINE_EXCEEDED whole as padded."""
    jobs = Jobs()
    server = await serve_jobs(nursery, sock, jobs)
    with trio.fail_after(LIVENESS_LIMIT):
        whole, padded = await both_ways(sock, grpc_request(LATER, **{"grpc-timeout": written}), framed(b"x"))
        assert 4 == padded.grpc_status
        assert padded == whole
        assert 0 == server.transport.in_flight
