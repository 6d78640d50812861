"""Tests of cb5bad6 from the served side: a hook server stopped while its app thread runs a plugin
function (the call late, its answer due back through trio) waits for that job to end, unregisters,
and leaves no fd of its worker open."""

from __future__ import annotations

import os
import pathlib
import threading

import pytest
import trio

from krproxy.grpcstatus import GRPCError
from krproxy.hookserver import ContainerContext, HookServer, ServeOptions, Stage, serve
from krproxy.hookserver.testing import FakeNode, HookClient, container_request, pod_request
from tests.integration.support import LIVENESS_LIMIT


def _open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


def _exists(path: str) -> bool:
    return os.path.exists(path)


def _options(short_tmp: pathlib.Path) -> ServeOptions:
    return ServeOptions(socket=str(short_tmp / "hs.sock"), hook_dir=str(short_tmp / "hookserver.d"))


async def test_a_stop_during_a_late_job_waits_and_closes_worker_fds(
    short_tmp: pathlib.Path,
) -> None:
    """A server stopped during a late job waits for it and closes the workers fds."""
    app = HookServer(executor=FakeNode(short_tmp / "node").create().executor())
    entered, release = threading.Event(), threading.Event()
    finished: list[str] = []

    @app.hook(Stage.PRE_CREATE_CONTAINER, name="slow")
    def slow(ctx: ContainerContext) -> None:
        entered.set()
        release.wait(LIVENESS_LIMIT)
        finished.append(ctx.request.name)

    options = _options(short_tmp)
    registration = os.path.join(options.hook_dir, "krproxy-hookserver.json")
    request = container_request(pod_request("p"), "slow")
    before = _open_fds()
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, options)
            assert _exists(registration)
            client = HookClient(options.socket)

            async def call() -> None:
                with pytest.raises((GRPCError, OSError, trio.BrokenResourceError, trio.ClosedResourceError)):
                    await client.call(Stage.PRE_CREATE_CONTAINER, request, seconds=LIVENESS_LIMIT)

            nursery.start_soon(call)
            await trio.to_thread.run_sync(entered.wait, LIVENESS_LIMIT)
            await trio.sleep(0.05)  # well past wait_inline: the answer is due through trio
            nursery.cancel_scope.cancel()  # ends serve, which waits for the app's thread
            release.set()
        await client.aclose()
    assert ["slow"] == finished  # the job ran to its end before serve returned
    assert not _exists(registration)
    assert _open_fds() <= before
