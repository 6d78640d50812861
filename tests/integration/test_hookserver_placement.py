"""Where the served SDK runs a hook call: a stage of non-blocking plain functions on the event loop in the
call's own step, one with ``async def`` functions in a task on the loop, one with a blocking function in
the worker thread; one call at a time on the app whichever way, in the order the calls came; the SDK's
own file work off the loop.

Each test bounds itself with ``fail_after``; the hook server is cancelled before the test returns.
"""

from __future__ import annotations

import pathlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from krproxy import rpc
from krproxy.grpcstatus import GRPCError, Status
from krproxy.hookserver import (
    CgroupFile,
    ContainerContext,
    Executor,
    FailurePolicy,
    HookServer,
    PodContext,
    ServeOptions,
    Stage,
    serve,
)
from krproxy.hookserver._executor import write_cgroup_file
from krproxy.hookserver._worker import AppWorker
from krproxy.hookserver.testing import FakeNode, HookClient, container_request, pod_request
from tests.integration.support import LIVENESS_LIMIT

CREATE = Stage.PRE_CREATE_CONTAINER
POD = "/kubepods/besteffort/poduid-be"


@pytest.fixture
async def client(short_tmp: pathlib.Path) -> AsyncIterator[HookClient]:
    async with HookClient(str(short_tmp / "hs.sock")) as hook_client:
        yield hook_client


@pytest.fixture
def submitted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the functions queued to the app's worker (every job, hook calls and the rest)."""
    jobs: list[str] = []
    submit = AppWorker.submit

    def spy(self: AppWorker, done_late: Any, fn: Any, *args: Any) -> Any:
        jobs.append(getattr(fn, "__name__", repr(fn)))
        return submit(self, done_late, fn, *args)

    monkeypatch.setattr(AppWorker, "submit", spy)
    return jobs


class Callers:
    """Hook calls made each on a connection of its own; :meth:`wait` for a number of answers."""

    def __init__(self, socket: str) -> None:
        self.socket = socket
        self.answers: list[Any] = []
        self._changed = trio.Event()

    async def call(self, stage: Stage, request: Any) -> None:
        async with HookClient(self.socket) as own:
            self.answers.append(await own.call(stage, request))
        self._changed.set()

    async def wait(self, count: int) -> None:
        while len(self.answers) < count:
            self._changed = trio.Event()
            await self._changed.wait()


def _app(short_tmp: pathlib.Path, **kw: Any) -> HookServer:
    return HookServer(executor=FakeNode(short_tmp / "node").create().executor(), **kw)


def _options(short_tmp: pathlib.Path) -> ServeOptions:
    return ServeOptions(socket=str(short_tmp / "hs.sock"), hook_dir=str(short_tmp / "hookserver.d"))


async def test_a_non_blocking_stage_runs_on_the_loop_without_a_job(
    short_tmp: pathlib.Path, client: HookClient, submitted: list[str]
) -> None:
    """A stage of non-blocking plain functions runs on the event loop's thread and queues no job to the
    worker; a blocking one's call is one job in the worker thread, as before."""
    app = _app(short_tmp)
    threads: dict[str, threading.Thread] = {}

    @app.hook(CREATE, name="quick", blocking=False)
    def quick(ctx: ContainerContext) -> None:
        threads["quick"] = threading.current_thread()
        ctx.response.add_envs["QUICK"] = ctx.request.name

    @app.hook(Stage.PRE_START_CONTAINER, name="plain")
    def plain(ctx: ContainerContext) -> None:
        threads["plain"] = threading.current_thread()

    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, _options(short_tmp))
            submitted.clear()  # (the server's start-up work)
            answer = await client.call(CREATE, container_request(pod_request("p"), "c"))
            assert [] == submitted
            await client.call(Stage.PRE_START_CONTAINER, container_request(pod_request("p"), "c", id="c1"))
            assert ["_in_worker"] == submitted
            nursery.cancel_scope.cancel()
    assert {"QUICK": "c"} == answer.container_envs
    assert threading.main_thread() is threads["quick"]
    assert threading.main_thread() is not threads["plain"]


async def test_a_function_registered_while_serving_counts(
    short_tmp: pathlib.Path, client: HookClient, submitted: list[str]
) -> None:
    """A blocking function registered while the server runs, after a call of its stage ran on the loop,
    is in the next call: that call is one job in the worker and its answer carries both functions'
    changes."""
    app = _app(short_tmp)

    @app.hook(CREATE, name="b-quick", blocking=False)
    def quick(ctx: ContainerContext) -> None:
        ctx.response.add_envs["QUICK"] = ctx.request.name

    def slow(ctx: ContainerContext) -> None:
        ctx.response.add_envs["SLOW"] = threading.current_thread().name

    request = container_request(pod_request("p"), "c")
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, _options(short_tmp))
            submitted.clear()
            first = await client.call(CREATE, request)
            assert [] == submitted
            app.hook(CREATE, name="a-slow")(slow)
            second = await client.call(CREATE, request)
            assert ["_in_worker"] == submitted
            nursery.cancel_scope.cancel()
    assert {"QUICK": "c"} == first.container_envs
    assert "SLOW" in second.container_envs
    assert threading.main_thread().name != second.container_envs["SLOW"]
    assert "c" == second.container_envs["QUICK"]


async def test_an_async_stage_runs_in_a_task_without_a_job(
    short_tmp: pathlib.Path, client: HookClient, submitted: list[str]
) -> None:
    """A stage of ``async def`` (and non-blocking) functions runs on the loop, awaiting trio, and queues
    no job to the worker: no hop to its thread and back for each function."""
    app = _app(short_tmp)

    @app.hook(CREATE, name="a-waits")
    async def waits(ctx: ContainerContext) -> None:
        await trio.sleep(0.001)
        ctx.response.add_envs["ASYNC"] = threading.current_thread().name

    @app.hook(CREATE, name="b-quick", blocking=False)
    def quick(ctx: ContainerContext) -> None:
        ctx.response.add_envs["QUICK"] = ctx.response.add_envs["ASYNC"]

    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, _options(short_tmp))
            submitted.clear()
            answer = await client.call(CREATE, container_request(pod_request("p"), "c"))
            assert [] == submitted
            nursery.cancel_scope.cancel()
    name = threading.main_thread().name
    assert {"ASYNC": name, "QUICK": name} == answer.container_envs


async def test_a_call_finding_the_app_busy_waits_its_turn(
    short_tmp: pathlib.Path, client: HookClient
) -> None:
    """A non-blocking stage's call that comes while a blocking function runs in the worker does not run
    beside it on the loop: it runs after it (queued in the worker), and both are answered."""
    app = _app(short_tmp)
    entered, release = threading.Event(), threading.Event()
    order: list[str] = []

    @app.hook(Stage.PRE_START_CONTAINER, name="slow")
    def slow(ctx: ContainerContext) -> None:
        entered.set()
        release.wait(LIVENESS_LIMIT)
        order.append("slow")

    @app.hook(CREATE, name="quick", blocking=False)
    def quick(ctx: ContainerContext) -> None:
        order.append("quick")

    callers = Callers(str(short_tmp / "hs.sock"))
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, _options(short_tmp))
            call = callers.call

            nursery.start_soon(
                call, Stage.PRE_START_CONTAINER, container_request(pod_request("p"), "a", id="a1")
            )
            await trio.to_thread.run_sync(entered.wait, LIVENESS_LIMIT)
            nursery.start_soon(call, CREATE, container_request(pod_request("p"), "b"))
            await trio.sleep(0.1)  # the second call has arrived and is waiting its turn
            assert [] == order
            release.set()
            await callers.wait(2)
            nursery.cancel_scope.cancel()
    assert ["slow", "quick"] == order


async def test_work_queued_while_an_async_stage_awaits_runs_after(
    short_tmp: pathlib.Path, client: HookClient
) -> None:
    """While an async stage's task awaits, the app is held: a blocking stage's call queued meanwhile
    runs once the task has ended, not beside it."""
    app = _app(short_tmp)
    order: list[str] = []
    awaiting, proceed = trio.Event(), trio.Event()

    @app.hook(CREATE, name="waits")
    async def waits(ctx: ContainerContext) -> None:
        awaiting.set()
        await proceed.wait()
        order.append("async")

    @app.hook(Stage.PRE_START_CONTAINER, name="plain")
    def plain(ctx: ContainerContext) -> None:
        order.append("plain")

    callers = Callers(str(short_tmp / "hs.sock"))
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, _options(short_tmp))
            call = callers.call

            nursery.start_soon(call, CREATE, container_request(pod_request("p"), "a"))
            await awaiting.wait()
            nursery.start_soon(
                call, Stage.PRE_START_CONTAINER, container_request(pod_request("p"), "b", id="b1")
            )
            await trio.sleep(0.1)  # the worker had every chance to run it
            assert [] == order
            proceed.set()
            await callers.wait(2)
            nursery.cancel_scope.cancel()
    assert ["async", "plain"] == order


@pytest.mark.parametrize("kind", ["non-blocking", "async"])
async def test_cgroup_writes_of_a_loop_stage_leave_the_loop(
    short_tmp: pathlib.Path, client: HookClient, kind: str
) -> None:
    """A call on the loop whose settings the SDK writes to cgroup files finishes off the loop's thread
    (the worker, or a thread of trio's from a task): the file is written, and the answer comes."""
    node = FakeNode(short_tmp / "node").create()
    node.add_cgroup(POD.lstrip("/"))
    threads: list[threading.Thread] = []

    def write(path: pathlib.Path, text: str) -> None:
        threads.append(threading.current_thread())
        write_cgroup_file(path, text)

    executor = Executor(node.cgroup_root, node.resctrl_root, node.cgroup_version, write_cgroup=write)
    app = HookServer(executor=executor)

    def set_idle(ctx: PodContext) -> None:
        ctx.response.resources.cpu_idle = 1

    async def set_idle_async(ctx: PodContext) -> None:
        set_idle(ctx)

    if kind == "async":
        app.hook(Stage.PRE_RUN_POD_SANDBOX, name="idle")(set_idle_async)
    else:
        app.hook(Stage.PRE_RUN_POD_SANDBOX, name="idle", blocking=False)(set_idle)
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, _options(short_tmp))
            answer = await client.call(Stage.PRE_RUN_POD_SANDBOX, pod_request("be", cgroup_parent=POD))
            nursery.cancel_scope.cancel()
    assert POD == answer.cgroup_parent
    assert "1" == node.read(POD, CgroupFile.CPU_IDLE)
    assert [] != threads
    assert threading.main_thread() not in threads


@pytest.mark.parametrize("kind", ["non-blocking", "async"])
async def test_a_loop_stage_failing_names_the_plugin(
    short_tmp: pathlib.Path, client: HookClient, kind: str
) -> None:
    """Under plugin failure policy Fail, a raising function on the loop fails the call UNKNOWN naming it
    and its error, as in the worker; the server answers the next call."""
    app = _app(short_tmp, plugin_failure_policy=FailurePolicy.FAIL)

    def broken(ctx: ContainerContext) -> None:
        raise RuntimeError("kaput")

    async def broken_async(ctx: ContainerContext) -> None:
        broken(ctx)

    if kind == "async":
        app.hook(CREATE, name="broken")(broken_async)
    else:
        app.hook(CREATE, name="broken", blocking=False)(broken)
    request = container_request(pod_request("p"), "c")
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, _options(short_tmp))
            with pytest.raises(GRPCError) as info:
                await client.call(CREATE, request)
            assert Status.UNKNOWN == info.value.status
            assert "'broken'" in (info.value.message or "")
            assert "kaput" in (info.value.message or "")
            app.plugin_failure_policy = FailurePolicy.IGNORE
            answer = await client.call(CREATE, request)
            nursery.cancel_scope.cancel()
    assert {} == answer.container_envs


async def test_a_bad_request_on_the_loop_is_invalid_argument(
    short_tmp: pathlib.Path, client: HookClient
) -> None:
    """A non-blocking stage's call whose bytes are no hook request is INVALID_ARGUMENT naming the
    message, as in the worker."""
    app = _app(short_tmp)
    app.hook(CREATE, name="quick", blocking=False)(lambda ctx: None)
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, _options(short_tmp))
            async with rpc.Channel(str(short_tmp / "hs.sock")) as channel:
                with pytest.raises(GRPCError) as info:
                    await channel.unary(CREATE.rpc_path, b"\x0a\xff\x01", timeout=5)
            nursery.cancel_scope.cancel()
    assert Status.INVALID_ARGUMENT == info.value.status
    assert "ContainerResourceHookRequest" in (info.value.message or "")
