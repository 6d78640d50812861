"""The tasks intercepted calls' handlers run in: one whose handler is over is parked and runs the next
call's handler (starting a task cost ~35 µs on the caller's reader, on every hooked call), with only that
call current; calls at once get tasks of their own; parked tasks end with the transport."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import trio

from krproxy import calls
from krproxy.forward import Forward, Reply
from krproxy.grpcstatus import GRPCError, Status
from krproxy.relay import Relay, _handlers
from tests.integration.handover_support import ECHO, SILENT, Harness
from tests.integration.support import LIVENESS_LIMIT, in_thread, raw_unary, serve_relay, wait_until

PATH = "/test.Echo/Intercepted"


async def test_a_parked_task_runs_the_next_handler(
    relay: Relay, nursery: trio.Nursery, short_tmp: Path, channel_to: Callable[[str], grpc.Channel]
) -> None:
    """Calls one after the other run in one task, each with its own context current, none after it."""
    seen: list[tuple[trio.lowlevel.Task, calls.CallContext | None, bytes]] = []

    async def intercept(path: str, request: bytes, forward: Forward) -> Reply:
        seen.append((trio.lowlevel.current_task(), calls.CURRENT.get(), request))
        return Reply(request)

    relay.configure(None, None, {PATH: intercept}, unary_paths=[PATH])
    listen = await serve_relay(nursery, relay, str(short_tmp / "relay.sock"))
    method = raw_unary(channel_to(listen), PATH)

    with trio.fail_after(LIVENESS_LIMIT):
        for n in range(3):
            assert b"%d" % n == await in_thread(method, b"%d" % n, timeout=LIVENESS_LIMIT)

    tasks = {task for task, _, _ in seen}
    assert 1 == len(tasks)
    assert [b"0", b"1", b"2"] == [ctx.request for _, ctx, _ in seen if ctx is not None]
    assert 3 == len({id(ctx) for _, ctx, _ in seen})
    parked = relay.transport.handlers.idle
    assert [None] == [p.fn for p in parked]
    assert tasks == {p.task for p in parked}
    assert None is parked[0].task.context.get(calls.CURRENT)  # the last call is not kept alive


async def test_calls_at_once_get_tasks_of_their_own(
    relay: Relay, nursery: trio.Nursery, short_tmp: Path, channel_to: Callable[[str], grpc.Channel]
) -> None:
    """Handlers waiting at once run in as many tasks; at most MAX_IDLE stay parked after."""
    count = _handlers.MAX_IDLE + 2
    arrived: list[trio.lowlevel.Task] = []
    release = trio.Event()

    async def intercept(path: str, request: bytes, forward: Forward) -> Reply:
        arrived.append(trio.lowlevel.current_task())
        await release.wait()
        assert calls.CURRENT.get() is not None and request == calls.CURRENT.get().request  # type: ignore[union-attr]
        return Reply(request)

    relay.configure(None, None, {PATH: intercept}, unary_paths=[PATH])
    listen = await serve_relay(nursery, relay, str(short_tmp / "relay.sock"))
    method = raw_unary(channel_to(listen), PATH)
    answers: list[bytes] = []

    async def one(n: int) -> None:
        answers.append(await in_thread(method, b"%d" % n, timeout=LIVENESS_LIMIT))

    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as callers:
            for n in range(count):
                callers.start_soon(one, n)
            await wait_until(lambda: len(arrived) == count)
            release.set()

    assert sorted(b"%d" % n for n in range(count)) == sorted(answers)
    assert count == len(set(arrived))
    assert _handlers.MAX_IDLE == len(relay.transport.handlers.idle)


async def test_a_cancelled_call_leaves_its_task_to_the_next(
    relay: Relay, nursery: trio.Nursery, short_tmp: Path, channel_to: Callable[[str], grpc.Channel]
) -> None:
    """A handler cancelled at its call's deadline ends that call only: the task runs the next handler in
    a cancel scope of its own, and a cancel of the first call after it ended reaches nobody."""
    seen: list[trio.lowlevel.Task] = []
    first = trio.Event()

    async def intercept(path: str, request: bytes, forward: Forward) -> Reply:
        seen.append(trio.lowlevel.current_task())
        if request == b"hang":
            first.set()
            await trio.sleep_forever()
        await trio.sleep(0.05)  # a checkpoint, where a cancel left behind would strike
        return Reply(request)

    relay.configure(None, None, {PATH: intercept}, unary_paths=[PATH])
    listen = await serve_relay(nursery, relay, str(short_tmp / "relay.sock"))
    method = raw_unary(channel_to(listen), PATH)

    with trio.fail_after(LIVENESS_LIMIT):
        with pytest.raises(grpc.RpcError) as err:
            await in_thread(method, b"hang", timeout=0.2)
        assert grpc.StatusCode.DEADLINE_EXCEEDED == err.value.code()  # type: ignore[attr-defined]
        assert first.is_set()
        assert b"next" == await in_thread(method, b"next", timeout=LIVENESS_LIMIT)
        assert b"again" == await in_thread(method, b"again", timeout=LIVENESS_LIMIT)

    assert 1 == len(set(seen))


async def test_a_handed_over_call_cancels_no_later_handler(harness: Harness) -> None:
    """A call whose interceptor handed its forward over and returned reaches its deadline after its task
    took the next call's handler: the deadline ends the first call, not the handler running then."""
    tasks: list[trio.lowlevel.Task] = []

    async def intercept(path: str, request: bytes, forward: Forward) -> Reply:
        tasks.append(trio.lowlevel.current_task())
        if request == b"first":
            reply: Reply = forward.hand_over(request, lambda status, reply: None)  # type: ignore[attr-defined]
            return reply
        await trio.sleep(1.0)  # past the first call's deadline
        return Reply(request)

    runtime, method = await harness.start(lambda n: SILENT if n == 1 else ECHO, intercept)
    answers: list[bytes | grpc.RpcError] = []

    async def first() -> None:
        answers.append(await harness.call(method, timeout=0.5, request=b"first"))

    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as callers:
            callers.start_soon(first)
            await wait_until(lambda: bool(runtime.bodies))
            second = await harness.call(method, request=b"second")

    assert b"second" == second
    assert [grpc.StatusCode.DEADLINE_EXCEEDED] == [a.code() for a in answers if isinstance(a, grpc.RpcError)]
    assert 2 == len(tasks) and 1 == len(set(tasks))


async def test_parked_tasks_end_with_the_transport(short_tmp: Path) -> None:
    """Cancelling the transport ends its parked handler tasks (its nursery does not wait for them)."""
    relay = Relay()

    async def intercept(path: str, request: bytes, forward: Forward) -> Reply:
        return Reply(b"")

    relay.configure(None, None, {PATH: intercept}, unary_paths=[PATH])
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(relay.run)
            done = trio.Event()

            async def handler(scope: trio.CancelScope) -> None:
                done.set()

            relay.transport.handlers.start(handler)
            await done.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert 1 == len(relay.transport.handlers.idle)
            nursery.cancel_scope.cancel()
    assert [] == relay.transport.handlers.idle


@pytest.mark.parametrize("ending", ["error", "deadline"])
async def test_an_ended_handler_keeps_no_call(
    ending: str,
    relay: Relay,
    nursery: trio.Nursery,
    short_tmp: Path,
    channel_to: Callable[[str], grpc.Channel],
) -> None:
    """A handler that raised a status or was cancelled at its call's deadline leaves its parked task with no
    call current, and its call is freed (the task's context, its frame and its scope keep none of it)."""
    contexts: list[weakref.ref[calls.CallContext]] = []

    async def intercept(path: str, request: bytes, forward: Forward) -> Reply:
        ctx = calls.CURRENT.get()
        assert ctx is not None
        contexts.append(weakref.ref(ctx))
        if ending == "error":
            raise GRPCError(Status.NOT_FOUND, "no such thing")
        await trio.sleep_forever()
        raise AssertionError("not cancelled")

    relay.configure(None, None, {PATH: intercept}, unary_paths=[PATH])
    listen = await serve_relay(nursery, relay, str(short_tmp / "relay.sock"))
    method = raw_unary(channel_to(listen), PATH)

    with trio.fail_after(LIVENESS_LIMIT):
        with pytest.raises(grpc.RpcError) as err:
            await in_thread(method, b"x" * 4096, timeout=0.3)
        await wait_until(lambda: relay.transport.in_flight == 0 and len(relay.transport.handlers.idle) == 1)

    expected = grpc.StatusCode.NOT_FOUND if ending == "error" else grpc.StatusCode.DEADLINE_EXCEEDED
    assert expected == err.value.code()  # type: ignore[attr-defined]
    assert None is relay.transport.handlers.idle[0].task.context.get(calls.CURRENT)
    gc.collect()
    assert [None] == [ref() for ref in contexts]
