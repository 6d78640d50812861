"""The daemon's memory stays bounded over many calls: finished calls are not kept.

Measured in-process with ``tracemalloc`` (Python allocations only, so the figures do not depend on
the allocator returning memory to the OS).

The leak this guards against: a finished call's deadline entry keeping the call alive, with its
:class:`krproxy.calls.CallContext` and its request and reply bytes (about 1 KB per Version call with
a 60 s deadline). The fake containerd once ran on trio-asyncio, whose loop kept cancelled timers
until they were due, each with the context it was created in.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import outcome
import pytest
import trio
from cri_api.v1 import api_pb2 as pb
from cri_api.v1 import api_pb2_grpc as pb_grpc

from krproxy import calls, rpc
from krproxy.daemon import Daemon
from krproxy.fakes.plugin import FakePlugin
from krproxy.hooks.points import HookPoint
from krproxy.relay.served import Served
from tests.integration.hooks_support import make_node
from tests.integration.support import LIVENESS_LIMIT, ProxiedFake, in_thread, wait_until

#: Calls measured, after WARM_UP calls (connections made, caches filled).
CALLS = 600
WARM_UP = 100
#: Growth allowed over CALLS calls. Kept calls grow it by about 1.1 KB per call.
MAX_GROWTH = 256 * 1024
#: Call contexts that may still be alive (the bound from when the fake ran on trio-asyncio, whose
#: loop kept up to 100 cancelled timers, as asyncio's own loops do).
MAX_CALL_CONTEXTS = 110


@pytest.fixture
def traced() -> Iterator[None]:
    """tracemalloc on for the test (1 frame is enough to tell tracemalloc's own apart), off after."""
    already = tracemalloc.is_tracing()
    if not already:
        tracemalloc.start(1)
    yield
    if not already:
        tracemalloc.stop()


def _traced_bytes() -> int:
    """Traced memory now, leaving out tracemalloc's own."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    return sum(stat.size for stat in snapshot.statistics("filename"))


def _call_contexts() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if type(obj) is calls.CallContext)


def _versions(stub: pb_grpc.RuntimeServiceStub, times: int) -> None:
    for _ in range(times):
        stub.Version(pb.VersionRequest(), timeout=60)


@pytest.fixture
def proxy(proxied_fake: ProxiedFake) -> Daemon:
    """The proxy in front of the fake containerd."""
    return proxied_fake.daemon


class TestMemory:
    async def test_finished_calls_are_not_kept(
        self, traced: None, proxy: Daemon, channel_to: Callable[[str], grpc.Channel]
    ) -> None:
        """Calls with a deadline leave neither their CallContext nor their bytes behind."""
        stub = pb_grpc.RuntimeServiceStub(channel_to(proxy.config.listen))
        await in_thread(_versions, stub, WARM_UP)
        before = _traced_bytes()
        await in_thread(_versions, stub, CALLS)
        growth = _traced_bytes() - before
        assert _call_contexts() <= MAX_CALL_CONTEXTS
        assert growth < MAX_GROWTH, f"traced memory grew {growth} bytes over {CALLS} calls"


class TestCallContextsOfTasks:
    async def test_a_connection_opened_during_a_call_does_not_keep_it(
        self, nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any
    ) -> None:
        """The first PreRunPodSandbox opens the plugin's connection from within the call; its
        reader task must not inherit the call's context (``calls.CURRENT``, with the request),
        which would keep that call alive as long as the connection."""
        node = await make_node(nursery, sockdir, fake_containerd, cri_client)
        await node.add_plugin("p", FakePlugin(), [HookPoint.PRE_RUN_POD_SANDBOX])
        await node.start_proxy()
        await node.run_pod()
        await wait_until(lambda: node.proxy.relay.transport.in_flight == 0)
        assert 0 == _call_contexts()


class TestServedCalls:
    async def test_a_finished_served_call_needs_no_collector(self, nursery: trio.Nursery, sock: str) -> None:
        """A served call's objects are freed as it ends, by reference counting: with the cyclic
        collector off during 20 calls, it then finds no :class:`Served` among the unreachable (a
        cycle between the call and the handler's view of it kept each until the next collection)."""
        path = "/t.S/Echo"
        server = rpc.Server({path: rpc.UnaryJob(lambda request, done: outcome.Value(request))})
        await nursery.start(server.serve, sock)
        async with rpc.Channel(sock) as channel:
            assert b"warm" == await channel.unary(path, b"warm", timeout=LIVENESS_LIMIT)
            gc.collect()
            gc.disable()
            try:
                for i in range(20):
                    assert b"%d" % i == await channel.unary(path, b"%d" % i, timeout=LIVENESS_LIMIT)
                gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds unreachable, kept to look at
                gc.collect()
                unreachable = sum(1 for obj in gc.garbage if type(obj) is Served)
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()
        assert 0 == unreachable
