"""krproxy.rpc's UnaryJob: a unary method answered without a task of its own, at once or later.

The rules of :mod:`krproxy.rpc.server` hold as for :func:`krproxy.rpc.unary` (status, errors,
deadline, reset, max request size); these tests hold each of them, and that a job still
waiting for its answer stalls neither other streams nor other connections."""

from __future__ import annotations

import functools
import gzip
import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import outcome
import pytest
import trio
import trio.testing

from krproxy.grpcstatus import GRPCError, Status
from krproxy.relay.served import Served
from krproxy.rpc import Server, Stream, UnaryJob
from tests.integration.h2_client import framed, grpc_request, request

LIVENESS_LIMIT = 30.0  # seconds: a bound on what must happen, not a speed claim
AT_ONCE = "/t.S/AtOnce"
LATER = "/t.S/Later"


class Jobs:
    """Two UnaryJobs: :attr:`at_once` answers the reversed request at once (or raises what
    the request names); :attr:`later` keeps each request's ``done`` until the test answers."""

    def __init__(self) -> None:
        self.tasks: list[str] = []  # the task each job was started in, by name
        self.waiting: list[tuple[bytes, Callable[[outcome.Outcome[bytes]], None]]] = []
        self.changed = trio.Event()
        self.at_once = UnaryJob(self._at_once)
        self.later = UnaryJob(self._later)

    def _at_once(self, request: bytes, done: Any) -> outcome.Outcome[bytes] | None:
        self.tasks.append(trio.lowlevel.current_task().name)
        if request == b"grpc-error":
            return outcome.Error(GRPCError(Status.FAILED_PRECONDITION, "not now", details=b"why"))
        if request == b"bug":
            return outcome.Error(ValueError("a bug"))
        if request == b"raise":
            raise KeyError("raised by start")
        return outcome.Value(request[::-1])

    def _later(self, request: bytes, done: Callable[[outcome.Outcome[bytes]], None]) -> None:
        self.tasks.append(trio.lowlevel.current_task().name)
        self.waiting.append((request, done))
        self.changed.set()
        self.changed = trio.Event()

    async def wait_for(self, count: int) -> None:
        while len(self.waiting) < count:
            await self.changed.wait()

    def server(self, **kwargs: Any) -> Server:
        async def plain(stream: Stream) -> None:
            message = await stream.recv_message()
            await stream.send_message(message or b"")

        return Server({AT_ONCE: self.at_once, LATER: self.later, "/t.S/Plain": plain}, **kwargs)

    async def serve(self, nursery: trio.Nursery, sock: str, **kwargs: Any) -> Server:
        """:meth:`server` (with *kwargs*), serving on *sock* in *nursery*."""
        server = self.server(**kwargs)
        await nursery.start(server.serve, sock)
        return server


@pytest.fixture
def grpcio(sock: str) -> Iterator[Callable[[str], Any]]:
    channel = grpc.insecure_channel("unix://" + sock)

    def method(path: str) -> Any:
        return channel.unary_unary(path, request_serializer=None, response_deserializer=None)

    yield method
    channel.close()


async def call(method: Any, message: bytes, **kwargs: Any) -> Any:
    kwargs.setdefault("timeout", LIVENESS_LIMIT)
    return await trio.to_thread.run_sync(functools.partial(method.with_call, message, **kwargs))


async def failure(method: Any, message: bytes, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        await call(method, message, **kwargs)
    return caught.value


def not_a_handler_task(name: str) -> bool:
    return "Served.run" not in name


async def test_answers_now_and_later_with_status_and_no_own_task(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], Any]
) -> None:
    """Answers at once and later with their status and no task of their own."""
    jobs = Jobs()
    await jobs.serve(nursery, sock)
    with trio.fail_after(LIVENESS_LIMIT):
        reply, state = await call(grpcio(AT_ONCE), b"abc")
        assert b"cba" == reply and grpc.StatusCode.OK == state.code()
        err = await failure(grpcio(AT_ONCE), b"grpc-error")
        assert (grpc.StatusCode.FAILED_PRECONDITION, "not now") == (err.code(), err.details())
        err = await failure(grpcio(AT_ONCE), b"bug")
        assert (grpc.StatusCode.UNKNOWN, "ValueError: a bug") == (err.code(), err.details())
        err = await failure(grpcio(AT_ONCE), b"raise")
        assert grpc.StatusCode.UNKNOWN == err.code() and "raised by start" in err.details()

        async with trio.open_nursery() as calls:
            answers: list[Any] = []

            async def late_call(message: bytes) -> None:
                answers.append(await call(grpcio(LATER), message))

            calls.start_soon(late_call, b"one")
            await jobs.wait_for(1)
            request, done = jobs.waiting[0]
            done(outcome.Value(request.upper()))
        assert b"ONE" == answers[0][0]
    assert len(jobs.tasks) == 5 and all(map(not_a_handler_task, jobs.tasks)), jobs.tasks


async def test_a_waiting_job_stalls_no_other_stream_or_connection(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], Any]
) -> None:
    """While one call's job has not answered, calls on the same connection (grpcio's one
    channel) and on another (the raw client) are answered; then the first one is too."""
    jobs = Jobs()
    await jobs.serve(nursery, sock)
    with trio.fail_after(LIVENESS_LIMIT):
        future = grpcio(LATER).future(b"slow", timeout=LIVENESS_LIMIT)
        await jobs.wait_for(1)
        assert b"cba" == (await call(grpcio(AT_ONCE), b"abc"))[0]
        assert b"plain" == (await call(grpcio("/t.S/Plain"), b"plain"))[0]
        assert b"olleh" == (await request(sock, grpc_request(AT_ONCE), framed(b"hello"))).message
        assert not future.done()
        jobs.waiting[0][1](outcome.Value(b"at last"))
        assert b"at last" == await trio.to_thread.run_sync(future.result)


async def test_the_deadline_ends_the_call_the_late_answer_dropped(
    nursery: trio.Nursery, sock: str, autojump_clock: trio.testing.MockClock
) -> None:
    """The deadline ends the call and the late answer is dropped."""
    jobs = Jobs()
    server = await jobs.serve(nursery, sock)
    for late in (outcome.Value(b"too late"), outcome.Error(ValueError("too late as well"))):
        answer = await request(sock, grpc_request(LATER, timeout=5.0), framed(b"x"))
        assert 4 == answer.grpc_status  # DEADLINE_EXCEEDED, from the server
        assert 0 == server.transport.in_flight  # its slot is free while the job still runs
        jobs.waiting[-1][1](late)  # nothing to send it to: dropped (an error logged only)
    assert b"cba" == (await request(sock, grpc_request(AT_ONCE, timeout=5.0), framed(b"abc"))).message


async def test_the_callers_reset_frees_the_call_before_the_job_answers(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], Any]
) -> None:
    jobs = Jobs()
    server = await jobs.serve(nursery, sock)
    with trio.fail_after(LIVENESS_LIMIT):
        future = grpcio(LATER).future(b"x", timeout=LIVENESS_LIMIT)
        await jobs.wait_for(1)
        assert 1 == server.transport.in_flight
        future.cancel()  # grpcio resets the stream (RST_STREAM CANCEL)
        await server.transport.wait_idle()
        jobs.waiting[0][1](outcome.Value(b"dropped"))
        assert b"cba" == (await call(grpcio(AT_ONCE), b"abc"))[0]


async def test_max_request_and_odd_requests_answer_as_unary_does(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], Any]
) -> None:
    """Too large: RESOURCE_EXHAUSTED, the job never started. No message, a message cut off,
    a compressed one: unary's answers, the job run from a task for the compressed one."""
    jobs = Jobs()
    await jobs.serve(nursery, sock, max_request=100)
    with trio.fail_after(LIVENESS_LIMIT):
        err = await failure(grpcio(AT_ONCE), b"x" * 101)
        assert grpc.StatusCode.RESOURCE_EXHAUSTED == err.code()
        assert [] == jobs.tasks

        none = await request(sock, grpc_request(AT_ONCE))
        assert (13, "the request carried no message") == (none.grpc_status, none.grpc_message)
        cut = await request(sock, grpc_request(AT_ONCE), framed(b"abc")[:-1])
        assert (13, "the request ended in the middle of a message") == (cut.grpc_status, cut.grpc_message)
        assert [] == jobs.tasks

        zipped = b"\x01" + len(gz := gzip.compress(b"abc")).to_bytes(4, "big") + gz
        answer = await request(sock, grpc_request(AT_ONCE, **{"grpc-encoding": "gzip"}), zipped)
        assert b"cba" == answer.message
        assert 1 == len(jobs.tasks) and not not_a_handler_task(jobs.tasks[0])


async def test_with_async_check_headers_the_job_runs_in_call_task(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], Any]
) -> None:
    """With an async check headers the job runs from the calls task."""
    jobs = Jobs()
    checked: list[str] = []

    async def check(stream: Stream) -> bool:
        checked.append(stream.path)
        return True

    await nursery.start(Server({LATER: jobs.later, AT_ONCE: jobs.at_once}, check_headers=check).serve, sock)
    with trio.fail_after(LIVENESS_LIMIT):
        assert b"cba" == (await call(grpcio(AT_ONCE), b"abc"))[0]
        future = grpcio(LATER).future(b"x", timeout=LIVENESS_LIMIT)
        await jobs.wait_for(1)
        jobs.waiting[0][1](outcome.Error(GRPCError(Status.ABORTED, "later")))
        with pytest.raises(grpc.RpcError) as caught:
            await trio.to_thread.run_sync(future.result)
        assert grpc.StatusCode.ABORTED == caught.value.code()
    assert [AT_ONCE, LATER] == checked
    assert 2 == len(jobs.tasks) and not any(map(not_a_handler_task, jobs.tasks))


@pytest.mark.relay_bug_expected
async def test_a_bug_answering_late_ends_only_that_connection(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A late answer is a ``run_sync_soon`` callback, where an exception would end the whole
    trio run: a bug there is logged as the relay's bugs are and closes that one connection."""
    jobs = Jobs()
    await jobs.serve(nursery, sock)
    real_reply = Served.reply

    def broken(call: Served, message: bytes) -> None:
        if message == b"BUG":
            raise RuntimeError("injected")
        real_reply(call, message)

    monkeypatch.setattr(Served, "reply", broken)
    with trio.fail_after(LIVENESS_LIMIT):
        future = grpcio(LATER).future(b"x", timeout=LIVENESS_LIMIT)
        await jobs.wait_for(1)
        jobs.waiting[0][1](outcome.Value(b"BUG"))
        with pytest.raises(grpc.RpcError) as caught:
            await trio.to_thread.run_sync(future.result)
        assert grpc.StatusCode.UNAVAILABLE == caught.value.code()
        assert b"olleh" == (await request(sock, grpc_request(AT_ONCE), framed(b"hello"))).message


async def test_a_jobs_bug_is_logged_with_its_exception(
    nursery: trio.Nursery, sock: str, grpcio: Callable[[str], Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A job's error that is no GRPCError (a bug), as its outcome at once or later, is logged with
    that exception, as one raised by start is."""
    jobs = Jobs()
    await jobs.serve(nursery, sock)
    with caplog.at_level(logging.ERROR), trio.fail_after(LIVENESS_LIMIT):
        assert grpc.StatusCode.UNKNOWN == (await failure(grpcio(AT_ONCE), b"raise")).code()
        assert grpc.StatusCode.UNKNOWN == (await failure(grpcio(AT_ONCE), b"bug")).code()
        future = grpcio(LATER).future(b"x", timeout=LIVENESS_LIMIT)
        await jobs.wait_for(1)
        jobs.waiting[0][1](outcome.Error(ValueError("a late bug")))
        with pytest.raises(grpc.RpcError):
            await trio.to_thread.run_sync(future.result)
    failed = [r for r in caplog.records if r.getMessage().startswith("handler of /t.S/")]
    assert [KeyError, ValueError, ValueError] == [r.exc_info[0] if r.exc_info else None for r in failed]
