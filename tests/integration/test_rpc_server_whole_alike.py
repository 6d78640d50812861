"""krproxy.rpc.Server and whole requests, compared: each request sent whole (its DATA read
with its HEADERS, the fast path) and with its DATA padded (the served call's path) gets the same
answer; odd headers, bodies, jobs, limits and resets alike, nothing left behind."""

from __future__ import annotations

from typing import Any

import h2.settings
import outcome
import pytest
import trio

from krproxy.h2 import frames as f
from krproxy.rpc import Server, UnaryJob
from tests.integration.h2_client import framed, grpc_request, request
from tests.integration.test_rpc_server_whole import credit_kept, left_behind
from tests.integration.test_rpc_unary_job import AT_ONCE, LATER, LIVENESS_LIMIT, Jobs
from tests.integration.test_rpc_unary_job_edges import h2_client

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


@pytest.mark.parametrize("path", [WRONG_TYPE, RAW, ASYNC])
async def test_a_job_s_wrong_result(nursery: trio.Nursery, sock: str, path: str) -> None:
    """A job answering a str, not bytes (as a unary handler's send_message of a str), or a start
    returning bytes or a coroutine (an async start): its call's error (UNKNOWN), the same whole
    and padded, and the connection serves on."""
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
