"""HookRuntime's recovery gate: intercepted calls wait until the store is recovered, and once it is they
reach their handler without a pass of trio's scheduler (a checkpoint per intercepted call was an
``epoll_wait`` and a turn of the run loop each)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from krproxy.forward import RUNTIME_PREFIX, Reply
from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks._reading import malformed
from krproxy.hooks.model import ContainerInfo, PodInfo
from krproxy.hooks.runtime import HookRuntime
from krproxy.hooks.store import HookStore
from krproxy.proto.runtime import v1

REMOVE = RUNTIME_PREFIX + "RemoveContainer"
POD = PodInfo(name="p", namespace="ns", uid="u")


class _NoPlugins:
    """RemoveContainer runs no hooks: the dispatcher is never called."""

    async def run(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("no hook runs for RemoveContainer")


def _runtime() -> HookRuntime:
    store = HookStore()
    store.put_pod("sb1", POD)
    store.put_container("c1", ContainerInfo(pod_sandbox_id="sb1", pod=POD, name="a", id="c1"))
    return HookRuntime(store, _NoPlugins(), ("skip", "true"))  # type: ignore[arg-type]


async def _forward(data: bytes) -> Reply:
    return Reply(bytes(v1.RemoveContainerResponse()), [], None)


def test_a_recovered_runtime_runs_the_handler_without_yielding() -> None:
    """The coroutine of an intercepted call finishes on its first step: nothing in front of the handler
    (and nothing in a handler that forwards at once) gives the scheduler a turn."""
    runtime = _runtime()
    runtime.mark_recovered()
    call = runtime.interceptors()[REMOVE](
        REMOVE, bytes(v1.RemoveContainerRequest(container_id="c1")), _forward
    )
    with pytest.raises(StopIteration) as finished:
        call.send(None)
    reply = finished.value.value
    assert isinstance(reply, Reply) and b"" == reply.message
    assert runtime.store.get_container("c1") is None  # the handler ran: the container is forgotten


async def test_calls_wait_for_recovery() -> None:
    runtime = _runtime()
    intercept = runtime.interceptors()[REMOVE]
    done = trio.Event()

    async def remove() -> None:
        await intercept(REMOVE, bytes(v1.RemoveContainerRequest(container_id="c1")), _forward)
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(remove)
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set() and runtime.store.get_container("c1") is not None
        runtime.mark_recovered()
        await done.wait()
    assert runtime.store.get_container("c1") is None


class TestMalformed:
    """``malformed`` (a class since the context manager's generator cost more calls): a request read that
    fails is INVALID_ARGUMENT naming the request, anything else passes as it is."""

    @pytest.mark.parametrize(
        "error", [AttributeError("x"), TypeError("x"), ValueError("x"), UnicodeError("x")]
    )
    def test_a_failed_read_is_invalid_argument(self, error: Exception) -> None:
        with pytest.raises(GRPCError) as raised, malformed("CreateContainerRequest"):
            raise error
        assert Status.INVALID_ARGUMENT is raised.value.status
        assert f"malformed CreateContainerRequest: {type(error).__name__}: x" == raised.value.message
        assert raised.value.__suppress_context__  # the read's traceback is not shown as the cause

    @pytest.mark.parametrize("error", [KeyError("x"), GRPCError(Status.UNAVAILABLE, "x"), RuntimeError("x")])
    def test_other_errors_pass(self, error: Exception) -> None:
        with pytest.raises(type(error)) as raised, malformed("CreateContainerRequest"):
            raise error
        assert error is raised.value

    def test_nothing_raised(self) -> None:
        with malformed("CreateContainerRequest"):
            pass
