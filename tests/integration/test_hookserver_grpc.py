"""The SDK hook server over a real unix socket: gRPC round trip, registration file, live policy.

Each test bounds itself with ``fail_after``; the hook server is cancelled (and its
registration file removed) before the test returns.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import trio

from krproxy import cli, log, rpc
from krproxy.grpcstatus import GRPCError, Status
from krproxy.hookserver import (
    CgroupFile,
    ContainerContext,
    FailurePolicy,
    HookServer,
    PodContext,
    ServeOptions,
    Stage,
    serve,
)
from krproxy.hookserver.policies import install_all
from krproxy.hookserver.policies.cpusuppress import Measurement
from krproxy.hookserver.testing import FakeNode, HookClient, container_request, logged_events, pod_request
from krproxy.proto.runtime import v1alpha1 as pb
from tests.integration.processes import wait_for_file
from tests.integration.support import LIVENESS_LIMIT

BE_POD = "/kubepods/besteffort/poduid-be"
POLICY = "resourceQOSStrategy: {beClass: {cpuQOS: {groupIdentity: -1}}}\n"


@pytest.fixture
async def stub_for() -> AsyncIterator[Any]:
    """Hook clients (:class:`HookClient`); closed at teardown."""
    clients: list[HookClient] = []

    def connect(path: str) -> HookClient:
        clients.append(HookClient(path))
        return clients[-1]

    yield connect
    for client in clients:
        await client.aclose()


def _options(short_tmp: pathlib.Path, **kw: Any) -> ServeOptions:
    return ServeOptions(socket=str(short_tmp / "hs.sock"), hook_dir=str(short_tmp / "hookserver.d"), **kw)


async def test_round_trip_and_registration(short_tmp: pathlib.Path, stub_for: Any) -> None:
    """Registration written koordlet-shaped on start; a hook call round-trips; file removed on stop."""
    node = FakeNode(short_tmp / "node").create()
    node.add_cgroup(BE_POD)
    app = HookServer(executor=node.executor())

    @app.hook(Stage.PRE_CREATE_CONTAINER, name="hello")
    def hello(ctx: ContainerContext) -> None:
        ctx.response.add_envs["HELLO"] = ctx.request.pod.meta.name

    @app.hook(Stage.PRE_RUN_POD_SANDBOX, name="idle")
    def idle(ctx: PodContext) -> None:
        ctx.response.resources.cpu_idle = 1

    options = _options(short_tmp, endpoint="/var/run/hs.sock", failure_policy=FailurePolicy.FAIL)
    registration = short_tmp / "hookserver.d" / "krproxy-hookserver.json"
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            path = await nursery.start(serve, app, options)
            assert str(registration) == path
            assert (
                '{"remote-endpoint":"/var/run/hs.sock","failure-policy":"Fail",'
                '"runtime-hooks":["PreRunPodSandbox","PostStopPodSandbox","PreCreateContainer","PostStopContainer"]}'
            ) == registration.read_text()
            assert [".", "krproxy-hookserver.json"] == sorted([".", *os.listdir(registration.parent)])

            stub = stub_for(options.socket)
            pod = pod_request("web", qos="BE", cgroup_parent=BE_POD)
            resp = await stub.call(Stage.PRE_RUN_POD_SANDBOX, pod)
            assert (pod.labels, pod.cgroup_parent) == (resp.labels, resp.cgroup_parent)
            assert "1" == node.read(BE_POD, CgroupFile.CPU_IDLE)

            req = container_request(pod, "app", resources=pb.LinuxContainerResources(cpuset_cpus="1"))
            cresp = await stub.call(Stage.PRE_CREATE_CONTAINER, req)
            assert {"HELLO": "web"} == cresp.container_envs
            assert "1" == cresp.container_resources.cpuset_cpus
            nursery.cancel_scope.cancel()
    assert not registration.exists()
    assert "hs.sock" not in os.listdir(short_tmp)  # the socket file is gone too


async def test_plain_functions_in_a_thread_async_ones_on_trio(short_tmp: pathlib.Path, stub_for: Any) -> None:
    """A plain plugin function runs in a worker thread, so a slow one cannot stall the event loop;
    an ``async def`` one runs on the trio loop's thread and may await anyio. Both on one context,
    by name: the async one sees what the plain one set."""
    app = HookServer(executor=FakeNode(short_tmp / "node").create().executor())
    threads: dict[str, threading.Thread] = {}

    @app.hook(Stage.PRE_CREATE_CONTAINER, name="a-plain")
    def plain(ctx: ContainerContext) -> None:
        threads["plain"] = threading.current_thread()
        ctx.response.add_envs["PLAIN"] = "1"

    @app.hook(Stage.PRE_CREATE_CONTAINER, name="b-async")
    async def asynchronous(ctx: ContainerContext) -> None:
        await anyio.sleep(0.001)  # anyio, on trio
        threads["async"] = threading.current_thread()
        ctx.response.add_envs["ASYNC"] = ctx.response.add_envs["PLAIN"] + "2"

    options = _options(short_tmp)
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, options)
            stub = stub_for(options.socket)
            resp = await stub.call(Stage.PRE_CREATE_CONTAINER, container_request(pod_request("p"), "c"))
            nursery.cancel_scope.cancel()
    assert {"PLAIN": "1", "ASYNC": "12"} == resp.container_envs
    assert threading.main_thread() is threads["async"]
    assert threading.main_thread() is not threads["plain"]


async def test_a_slow_plain_function_stalls_no_other_connection(
    short_tmp: pathlib.Path, stub_for: Any
) -> None:
    """While a plain plugin function blocks in the worker thread, the event loop serves: a
    second connection's call of an unknown method is answered, and a hook call queued behind the
    slow one ends DEADLINE_EXCEEDED at its deadline (its job runs later, its answer dropped).
    Then the slow call is answered, and so is the next one."""
    app = HookServer(executor=FakeNode(short_tmp / "node").create().executor())
    release, entered = threading.Event(), threading.Event()

    @app.hook(Stage.PRE_CREATE_CONTAINER, name="slow")
    def slow(ctx: ContainerContext) -> None:
        if ctx.request.name == "slow":
            entered.set()
            release.wait(LIVENESS_LIMIT)
        ctx.response.add_envs["SEEN"] = ctx.request.name

    options = _options(short_tmp)
    request = container_request(pod_request("p"), "slow")
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, options)
            answers: list[Any] = []
            answered = trio.Event()

            async def slow_call() -> None:
                answers.append(await stub_for(options.socket).call(Stage.PRE_CREATE_CONTAINER, request))
                answered.set()

            nursery.start_soon(slow_call)
            await trio.to_thread.run_sync(entered.wait, LIVENESS_LIMIT)
            async with rpc.Channel(options.socket) as other:
                with pytest.raises(GRPCError) as info:
                    await other.unary("/no.Such/Method", b"", timeout=LIVENESS_LIMIT)
                assert Status.UNIMPLEMENTED == info.value.status
                queued = bytes(container_request(pod_request("p"), "queued").SerializeToString())
                with pytest.raises(GRPCError) as info:
                    await other.unary(Stage.PRE_CREATE_CONTAINER.rpc_path, queued, timeout=0.2)
                assert Status.DEADLINE_EXCEEDED == info.value.status
                assert [] == answers
                release.set()
                reply = await other.unary(Stage.PRE_CREATE_CONTAINER.rpc_path, queued, timeout=LIVENESS_LIMIT)
            assert {"SEEN": "queued"} == pb.ContainerResourceHookResponse.FromString(reply).container_envs
            await answered.wait()
            assert {"SEEN": "slow"} == answers[0].container_envs
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    "raised",
    [RuntimeError("kaput"), SystemExit(3), KeyboardInterrupt()],
    ids=["an error", "sys.exit", "KeyboardInterrupt"],
)
async def test_fail_policy_answers_with_error(
    short_tmp: pathlib.Path, stub_for: Any, raised: BaseException
) -> None:
    """Under plugin failure policy Fail, a raising plugin makes the hook call fail UNKNOWN, naming it
    and what it raised; under Ignore the call answers the echo. A served function that calls
    sys.exit() or raises KeyboardInterrupt is a raising function like any other, not the server's
    end (in the worker thread only the function raises them): the server answers the next call."""
    app = HookServer(
        executor=FakeNode(short_tmp / "node").create().executor(), plugin_failure_policy=FailurePolicy.FAIL
    )

    @app.hook(Stage.PRE_START_CONTAINER, name="broken")
    def broken(ctx: ContainerContext) -> None:
        raise raised

    options = _options(short_tmp)
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, options)
            stub = stub_for(options.socket)
            req = container_request(pod_request("p"), "c", id="c1")
            with pytest.raises(GRPCError) as info:
                await stub.call(Stage.PRE_START_CONTAINER, req)
            assert Status.UNKNOWN == info.value.status
            named = str(raised) if isinstance(raised, Exception) else repr(raised)
            assert "'broken'" in (info.value.message or "")
            assert named in (info.value.message or "")
            # Ignore: same plugin, the call succeeds with the echo.
            app.plugin_failure_policy = FailurePolicy.IGNORE
            resp = await stub.call(Stage.PRE_START_CONTAINER, req)
            assert req.container_resources == resp.container_resources
            nursery.cancel_scope.cancel()


def test_in_process_an_exit_is_the_callers() -> None:
    """Called in-process (no server, the caller's own thread), SystemExit and KeyboardInterrupt are the
    caller's: they pass through, not as a plugin's failure."""
    app = HookServer(plugin_failure_policy=FailurePolicy.IGNORE)

    @app.hook(Stage.PRE_START_CONTAINER, name="exits")
    def exits(ctx: ContainerContext) -> None:
        raise SystemExit(3)

    with pytest.raises(SystemExit):
        app.handle_container(Stage.PRE_START_CONTAINER, container_request(pod_request("p"), "c", id="c1"))


async def test_a_request_that_is_no_hook_message_is_invalid_argument(short_tmp: pathlib.Path) -> None:
    """Bytes that are no hook request end the call INVALID_ARGUMENT, naming the message expected;
    no plugin runs, and the server answers the next call."""
    app = HookServer(executor=FakeNode(short_tmp / "node").create().executor())
    ran: list[str] = []

    @app.hook(Stage.PRE_CREATE_CONTAINER, name="seen")
    def seen(ctx: ContainerContext) -> None:
        ran.append(ctx.request.name)

    options = _options(short_tmp)
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, options)
            async with rpc.Channel(options.socket) as channel:
                for stage, expected in (
                    (Stage.PRE_CREATE_CONTAINER, "ContainerResourceHookRequest"),
                    (Stage.PRE_RUN_POD_SANDBOX, "PodSandboxHookRequest"),
                ):
                    with pytest.raises(GRPCError) as info:
                        await channel.unary(stage.rpc_path, b"\x0a\xff\x01", timeout=5)
                    assert Status.INVALID_ARGUMENT == info.value.status
                    assert f"{stage.rpc_name}: the request is no {expected}" in (info.value.message or "")
                assert [] == ran
                reply = await channel.unary(
                    Stage.PRE_CREATE_CONTAINER.rpc_path,
                    bytes(container_request(pod_request("p"), "c").SerializeToString()),
                    timeout=5,
                )
            assert ["c"] == ran
            assert pb.ContainerResourceHookResponse.FromString(reply).pod_cgroup_parent
            nursery.cancel_scope.cancel()


async def test_policy_file_change_reapplies_to_running_pods(short_tmp: pathlib.Path, stub_for: Any) -> None:
    """Editing the watched policy file re-applies group identity to a pod the server already saw."""
    node = FakeNode(short_tmp / "node").create()
    node.add_cgroup(BE_POD)
    app = HookServer(executor=node.executor())
    install_all(app, meter=lambda targets: Measurement(4, 0.0, 0.0))
    policy = short_tmp / "policy.yaml"
    policy.write_text(POLICY)
    options = _options(short_tmp, policy_path=str(policy))
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, options)
            registered = json.loads((short_tmp / "hookserver.d" / "krproxy-hookserver.json").read_text())
            assert [
                "PreRunPodSandbox",
                "PostStopPodSandbox",
                "PreCreateContainer",
                "PostStartContainer",
                "PostStopContainer",
                "PreUpdateContainerResources",
            ] == registered["runtime-hooks"]
            stub = stub_for(options.socket)
            pod = pod_request("be", qos="BE", cgroup_parent=BE_POD)
            await stub.call(Stage.PRE_RUN_POD_SANDBOX, pod)
            assert "-1" == node.read(BE_POD, CgroupFile.CPU_BVT)
            policy.write_text(POLICY.replace("-1", "0"))
            # Polls a file the watcher's callback writes; there is no event to wait on.
            while node.read(BE_POD, CgroupFile.CPU_BVT) != "0":  # noqa: ASYNC110
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()


async def test_one_log_format_and_a_stop_line(
    short_tmp: pathlib.Path, stub_for: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Everything the hook server logs — start, policy (refused too), features, hook decisions at
    debug, writes, stop — is an event with its keys at the top level and booleans as true/false."""
    node = FakeNode(short_tmp / "node", bvt=False).create()
    node.add_cgroup(BE_POD)
    app = HookServer(executor=node.executor())
    install_all(app, meter=lambda targets: Measurement(4, 0.0, 0.0))
    policy = short_tmp / "policy.yaml"
    policy.write_text("resourceQOSStrategy: {beClass: {cpuQOS: {groupIdentiy: -1}}}\n")
    with caplog.at_level(logging.DEBUG), trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, _options(short_tmp, policy_path=str(policy)))
            stub = stub_for(str(short_tmp / "hs.sock"))
            pod = pod_request("web", qos="BE", cgroup_parent=BE_POD)
            await stub.call(Stage.PRE_RUN_POD_SANDBOX, pod)
            nursery.cancel_scope.cancel()
    ours = [r for r in caplog.records if r.name.startswith("krproxy.hookserver")]
    lines = [log.LogfmtFormatter().format(r) for r in ours]
    assert lines and all(" event=" in line and " msg=" not in line for line in lines), lines
    assert not [line for line in lines if "=True" in line or "=False" in line]
    events = [r.getMessage() for r in ours]
    for expected in (
        "policy_invalid",
        "feature_status",
        "hook_decision",
        "hookserver_started",
        "hookserver_stopped",
    ):
        assert expected in events
    assert "hookserver_stopped" == events[-1]
    [invalid] = logged_events(caplog.records, "policy_invalid")
    assert invalid["kept_last_good"] is False  # there was none: nothing is applied


EXAMPLE_PLUGIN = pathlib.Path(__file__).resolve().parents[2] / "examples" / "first_plugin.py"


STOP_SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]


@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=lambda s: s.name)
@pytest.mark.parametrize("server", ["hooks-serve", "example"])
def test_hooks_serve_stops_on_a_signal_and_unregisters(
    short_tmp: pathlib.Path, signum: signal.Signals, server: str
) -> None:
    """``krproxy hooks serve`` and the guide's example plugin as processes: one SIGINT (Ctrl-C), SIGTERM
    or SIGHUP (its terminal closed) removes the registration file and exits 0, with no traceback.
    SIGHUP used to kill them at once, leaving a registration that names a dead socket (with ``Fail``,
    every hooked CRI call then fails); SIGINT ended in trio's exception-group traceback, exit 1."""
    hook_dir = short_tmp / "hooks"
    socket = str(short_tmp / "s.sock")
    if server == "example":
        registration = hook_dir / "first-plugin.json"
        command = [sys.executable, str(EXAMPLE_PLUGIN), "--socket", socket, "--hook-dir", str(hook_dir)]
    else:
        registration = hook_dir / "sdk.json"
        command = [sys.executable, "-m", "krproxy", "hooks", "serve", "--socket", socket]
        command += [
            "--hook-dir",
            str(hook_dir),
            "--name",
            "sdk",
            "--no-builtin",
            "--cgroup-root",
            str(short_tmp),
        ]
    process = subprocess.Popen(command, stderr=subprocess.PIPE)
    try:
        wait_for_file(registration, process)
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=LIVENESS_LIMIT)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert 0 == process.returncode, stderr
    assert not registration.exists()
    assert b"event=hookserver_stopped" in stderr
    assert b"Traceback" not in stderr


@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=lambda s: s.name)
def test_hooks_standalone_stops_on_a_signal(short_tmp: pathlib.Path, signum: signal.Signals) -> None:
    """``krproxy hooks standalone`` as a process (its runtime absent, so it keeps retrying) stops on one
    SIGINT, SIGTERM or SIGHUP: its stop line, exit 0, no traceback (SIGINT gave trio's exception-group
    traceback and exit 1)."""
    command = [sys.executable, "-m", "krproxy", "hooks", "standalone", "--no-builtin"]
    command += ["--cri-endpoint", f"unix://{short_tmp}/absent.sock", "--cgroup-root", str(short_tmp)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE)
    try:
        assert process.stderr is not None
        seen = b""
        deadline = time.monotonic() + LIVENESS_LIMIT
        while b"event=standalone_started" not in seen:  # logged once its signals are caught
            line = process.stderr.readline()
            assert line and time.monotonic() < deadline, seen
            seen += line
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=LIVENESS_LIMIT)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert 0 == process.returncode, seen + stderr
    assert b"event=standalone_stopped" in stderr
    assert b"Traceback" not in stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["hooks", "serve", "--no-builtin", "--socket", "{socket}", "--hook-dir", "{tmp}/hooks"],
        ["trace", "serve", "{trace}", "--socket", "{socket}"],
    ],
    ids=["hooks-serve", "trace-serve"],
)
def test_a_socket_in_use_is_refused_in_one_line(
    argv: list[str], short_tmp: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`krproxy hooks serve` and `trace serve` on a socket another process listens on exit 1 with
    one line naming the socket and what to do (a trio exception-group traceback before)."""
    socket_path = str(short_tmp / "busy.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as busy:
        busy.bind(socket_path)
        busy.listen()
        trace = pathlib.Path(__file__).parents[1] / "data" / "traces" / "fake-lifecycle.krt"
        code = cli.main([a.format(socket=socket_path, tmp=short_tmp, trace=trace) for a in argv])
    err = capsys.readouterr().err
    assert 1 == code
    assert f"another process is listening on this socket: '{socket_path}'; stop that process first" in err
    assert "Traceback" not in err
