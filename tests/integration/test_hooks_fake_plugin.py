"""The fake hook plugin itself: its answers and misbehaviours seen by a plain gRPC client, and its
command line, registering with a running proxy and changing a container end to end."""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio

from krproxy import rpc
from krproxy.fakes.plugin import GARBAGE, Changes, FakePlugin, Misbehaviour, run_fake_plugin
from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks.points import HookPoint
from krproxy.proto.runtime import v1alpha1 as hookapi
from krproxy.unixsock import bind_unix_socket
from tests.integration.hooks_support import Node, container_config, make_node
from tests.integration.support import unary_call, wait_until

#: How long a new Python process may take to start (or stop) on a loaded CI machine.
PROCESS_START_LIMIT = 30.0


CREATE = HookPoint.PRE_CREATE_CONTAINER
REQUEST = hookapi.ContainerResourceHookRequest(
    container_meta=hookapi.ContainerMetadata(name="app"),
    container_annotations={"a": "1"},
    container_resources=hookapi.LinuxContainerResources(cpu_shares=2, cpuset_cpus="0"),
    pod_cgroup_parent="/kubepods",
    container_envs={"E": "1"},
    pod_labels={"l": "1"},
)


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


async def call_create(path: str, request: hookapi.ContainerResourceHookRequest = REQUEST) -> Any:
    async with rpc.Channel(path) as channel:
        return await unary_call(
            channel, CREATE.rpc_path, request, hookapi.ContainerResourceHookResponse, timeout=2
        )


class TestFakePlugin:
    async def test_default_echoes_like_koordlet(self, nursery: trio.Nursery, short_tmp: Path) -> None:
        """Without changes the answer echoes annotations, resources, pod cgroup parent and envs; the call
        is logged with its request."""
        path = str(short_tmp / "p.sock")
        plugin = await nursery.start(run_fake_plugin, path, FakePlugin())

        answer = await call_create(path)

        assert (
            hookapi.ContainerResourceHookResponse(
                container_annotations={"a": "1"},
                container_resources=hookapi.LinuxContainerResources(cpu_shares=2, cpuset_cpus="0"),
                pod_cgroup_parent="/kubepods",
                container_envs={"E": "1"},
            )
            == answer
        )
        assert [REQUEST] == plugin.requests(CREATE)

    async def test_changes_do_not_touch_the_logged_request(
        self, nursery: trio.Nursery, short_tmp: Path
    ) -> None:
        """Changes apply to the answer only; the call log keeps the request as received."""
        path = str(short_tmp / "p.sock")
        plugin = await nursery.start(
            run_fake_plugin, path, FakePlugin(Changes(cpu_quota=-1, envs={"X": "y"}))
        )

        answer = await call_create(path)

        assert -1 == answer.container_resources.cpu_quota
        assert {"E": "1", "X": "y"} == answer.container_envs
        assert [REQUEST] == plugin.requests(CREATE)

    async def test_canned_answer_and_misbehaviour_count(self, nursery: trio.Nursery, short_tmp: Path) -> None:
        """A canned answer is sent as is; a misbehaviour with ``times`` affects that many calls only."""
        path = str(short_tmp / "p.sock")
        plugin = FakePlugin()
        plugin.answer(CREATE, hookapi.ContainerResourceHookResponse(pod_cgroup_parent="/x"))
        plugin.misbehave(Misbehaviour(status=Status.PERMISSION_DENIED, message="no", times=1), CREATE)
        await nursery.start(run_fake_plugin, path, plugin)

        with pytest.raises(GRPCError) as info:
            await call_create(path)
        answer = await call_create(path)

        assert (Status.PERMISSION_DENIED, "no") == (info.value.status, info.value.message)
        assert hookapi.ContainerResourceHookResponse(pod_cgroup_parent="/x") == answer
        assert [CREATE, CREATE] == plugin.hooks_called()

    async def test_garbage_does_not_decode(self, nursery: trio.Nursery, short_tmp: Path) -> None:
        """The garbage answer really fails to decode as the response type."""
        path = str(short_tmp / "p.sock")
        plugin = FakePlugin()
        plugin.misbehave(Misbehaviour(garbage=GARBAGE))
        await nursery.start(run_fake_plugin, path, plugin)

        with pytest.raises(EOFError):
            await call_create(path)


class TestServerWithGrpcio:
    """The fake plugin (krproxy's gRPC server) under grpcio's client: a second, independent gRPC stack,
    with small initial flow-control windows."""

    @staticmethod
    async def grpcio_call(path: str, method: str, request: bytes) -> bytes:
        def run() -> bytes:
            with grpc.insecure_channel(f"unix://{path}") as channel:
                answer: bytes = channel.unary_unary(method)(request, timeout=5)
                return answer

        return await trio.to_thread.run_sync(run)

    async def test_large_echo(self, nursery: trio.Nursery, short_tmp: Path) -> None:
        """A request with 1 MB of annotations is echoed whole, and logged."""
        path = str(short_tmp / "p.sock")
        plugin = await nursery.start(run_fake_plugin, path, FakePlugin())
        request = hookapi.ContainerResourceHookRequest(container_annotations={"big": "x" * (1 << 20)})

        raw = await self.grpcio_call(path, CREATE.rpc_path, bytes(request.SerializeToString()))

        answer = hookapi.ContainerResourceHookResponse.FromString(raw)
        assert {"big": "x" * (1 << 20)} == answer.container_annotations
        assert [request] == plugin.requests(CREATE)

    async def test_status_and_unknown_method(self, nursery: trio.Nursery, short_tmp: Path) -> None:
        """A scripted status arrives with its message; a method the service lacks is UNIMPLEMENTED."""
        path = str(short_tmp / "p.sock")
        plugin = FakePlugin()
        plugin.misbehave(Misbehaviour(status=Status.UNAVAILABLE, message="busy: ünïcode"))
        await nursery.start(run_fake_plugin, path, plugin)

        with pytest.raises(grpc.RpcError) as refused:
            await self.grpcio_call(path, CREATE.rpc_path, bytes(REQUEST.SerializeToString()))
        with pytest.raises(grpc.RpcError) as unknown:
            await self.grpcio_call(path, "/runtime.v1alpha1.RuntimeHookService/Nope", b"")

        assert (grpc.StatusCode.UNAVAILABLE, "busy: ünïcode") == (
            refused.value.code(),
            refused.value.details(),
        )
        assert grpc.StatusCode.UNIMPLEMENTED == unknown.value.code()

    async def test_delay_then_answer(self, nursery: trio.Nursery, short_tmp: Path) -> None:
        """A delayed answer still comes, after the delay."""
        path = str(short_tmp / "p.sock")
        plugin = FakePlugin()
        plugin.misbehave(Misbehaviour(delay=0.2))
        await nursery.start(run_fake_plugin, path, plugin)

        started = trio.current_time()
        answer = await call_create(path)

        assert trio.current_time() - started >= 0.2
        assert "/kubepods" == answer.pod_cgroup_parent

    async def test_answer_after_listens_at_once_and_answers_later(
        self, nursery: trio.Nursery, short_tmp: Path
    ) -> None:
        """``answer_after``: the socket accepts a connection at once, the call (and any gRPC answer, even
        UNIMPLEMENTED for an unknown method) comes only after the delay, then the plugin serves as usual."""
        path = str(short_tmp / "p.sock")
        # Before the start: the plugin's delay begins inside nursery.start, before it returns here.
        started = trio.current_time()
        plugin = await nursery.start(functools.partial(run_fake_plugin, answer_after=0.3), path)

        connecting = trio.current_time()
        with trio.socket.socket(trio.socket.AF_UNIX) as sock:
            await sock.connect(path)  # the backlog takes it: a connect does not tell it is answering
        assert trio.current_time() - connecting < 0.3
        answer = await call_create(path)

        assert trio.current_time() - started >= 0.3
        assert "/kubepods" == answer.pod_cgroup_parent
        assert [CREATE] == plugin.hooks_called()

    async def test_never_answering(self, nursery: trio.Nursery, short_tmp: Path) -> None:
        """``answer_after=math.inf``: connects succeed, nothing is ever answered (the caller times out)."""
        path = str(short_tmp / "p.sock")
        plugin = await nursery.start(functools.partial(run_fake_plugin, answer_after=math.inf), path)

        with pytest.raises(GRPCError) as info:
            async with rpc.Channel(path) as channel:
                await unary_call(
                    channel, CREATE.rpc_path, REQUEST, hookapi.ContainerResourceHookResponse, timeout=0.3
                )

        assert Status.DEADLINE_EXCEEDED == info.value.status
        assert [] == plugin.calls


class TestCommandLine:
    async def test_registers_changes_and_unregisters(self, node: Node, sockdir: str) -> None:
        """``python -m krproxy.fakes.plugin`` writes its registration file, changes containers through a running
        proxy as its flags say, and on SIGTERM removes the file and exits 0."""
        await node.start_proxy()
        pod_id = await node.run_pod()
        socket_path = os.path.join(sockdir, "cli.sock")
        registration = os.path.join(node.hook_dir, "cli.json")
        command = [
            sys.executable,
            "-m",
            "krproxy.fakes.plugin",
            f"--socket=unix://{socket_path}",
            f"--hook-dir={node.hook_dir}",
            "--name=cli",
            "--hooks=PreCreateContainer,PreRunPodSandbox",
            "--failure-policy=Fail",
            "--set-cpu-quota=-1",
            "--set-memory-limit=536870912",
            "--set-cpuset=1-2",
            "--add-annotation=demo=yes",
            "--delay=0.01",
        ]
        process = await trio.lowlevel.open_process(command)
        try:
            # A new interpreter importing krproxy can take seconds on a loaded machine; the watcher's
            # own pick-up time is what wait_registered bounds, once the file is there.
            await wait_until(lambda: os.path.exists(registration), PROCESS_START_LIMIT)
            await node.wait_registered("cli.json")
            assert {
                "remote-endpoint": socket_path,
                "failure-policy": "Fail",
                "runtime-hooks": ["PreCreateContainer", "PreRunPodSandbox"],
            } == json.loads(await trio.Path(registration).read_text())

            await node.create_container(pod_id)

            [received] = node.received("CreateContainer")
            resources = received.config.linux.resources
            assert (-1, 536870912, "1-2") == (
                resources.cpu_quota,
                resources.memory_limit_in_bytes,
                resources.cpuset_cpus,
            )
            assert "yes" == received.config.annotations["demo"]
        finally:
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(PROCESS_START_LIMIT):
                code = await process.wait()
        assert 0 == code
        assert not await trio.Path(registration).exists()
        assert not await trio.Path(socket_path).exists()
        await node.wait_registered("cli.json", present=False)

    async def test_rejects_unknown_hook(self) -> None:
        """An unknown hook name is a usage error (exit 2), naming the hook."""
        result = await trio.run_process(
            [
                sys.executable,
                "-m",
                "krproxy.fakes.plugin",
                "--socket=/tmp/x.sock",
                "--hook-dir=/tmp",
                "--hooks=PreFoo",
            ],
            capture_stderr=True,
            check=False,
        )

        assert 2 == result.returncode
        assert b"unknown hook 'PreFoo'" in result.stderr


class _CountingListener:
    """A listening socket that counts the connections it accepted (the relay's accept loop calls
    ``accept`` and waits on ``fileno``)."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.accepted = 0

    def accept(self) -> Any:
        got = self.sock.accept()
        self.accepted += 1
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


async def test_one_connection_to_a_plugin_serves_every_hooked_call(nursery: trio.Nursery, node: Node) -> None:
    """The proxy keeps its connection to a registered plugin: hooked calls after the first open none
    (a connection per call would be a connect and an HTTP/2 handshake on every CreateContainer)."""
    path = node.plugin_socket("p")
    listener = _CountingListener(bind_unix_socket(path))
    plugin = FakePlugin()
    await nursery.start(plugin.server().serve_socket, listener)
    await node.start_proxy()
    await node.add_plugin("p", plugin, [CREATE], serve=False)
    pod_id = await node.run_pod()
    await node.create_container(pod_id, container_config("first"))
    opened = listener.accepted

    for n in range(5):
        await node.create_container(pod_id, container_config(f"c{n}"))

    assert 6 == len(plugin.requests(CREATE))
    assert 1 <= opened == listener.accepted
