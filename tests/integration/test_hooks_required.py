"""Required hook servers through the proxy: absent, unreachable, not answering, back; flags and annotations.

A call at a required server's hook point, while that server is not registered and answering, fails with
UNAVAILABLE naming the server and what is missing, and the fake containerd receives nothing; other
calls go through; once the server is there, the retry goes through with its changes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
from typing import Any

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy import admin
from krproxy.fakes.plugin import Changes, FakePlugin, Misbehaviour, run_fake_plugin
from krproxy.hooks.guard import MAX_ANNOTATED_SERVERS
from krproxy.hooks.points import HookPoint
from krproxy.hooks.registration import Registry
from krproxy.hooks.required import Requirements, parse_required_server
from krproxy.hookserver.testing import logged_events
from tests.integration.hooks_support import (
    HANG_TIMEOUT,
    Node,
    container_config,
    make_node,
    pod_config,
    refused,
    rejection,
)
from tests.integration.support import LIVENESS_LIMIT, wait_until

RUN = HookPoint.PRE_RUN_POD_SANDBOX
CREATE = HookPoint.PRE_CREATE_CONTAINER
#: The cgroup parent the required plugin gives pods: seen in the runtime's request only if it was called.
HOOKED_PARENT = "/kubepods/hooked"


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


def requiring(*flags: str, grace: float = 0.0, **kwargs: Any) -> Requirements:
    """The requirements of ``--required-hook-server FLAG...``; no start-up grace unless given."""
    return Requirements(tuple(parse_required_server(f) for f in flags), startup_grace=grace, **kwargs)


def hooked_plugin() -> FakePlugin:
    return FakePlugin(Changes(cgroup_parent=HOOKED_PARENT, annotations={"hooked": "yes"}))


def run_request(config: api_pb2.PodSandboxConfig | None = None) -> api_pb2.RunPodSandboxRequest:
    return api_pb2.RunPodSandboxRequest(config=config or pod_config(), runtime_handler="runc")


def held(node: Node, server: str, point: HookPoint) -> float | None:
    labels = {"server": server, "hook": point.value}
    return node.proxy.metrics.registry.get_sample_value("krproxy_required_calls_held_total", labels)


class TestAbsentServer:
    async def test_run_pod_refused_and_nothing_forwarded(self, node: Node) -> None:
        await node.start_proxy(requirements=requiring("koordlet"))

        details = await refused(node, "RunPodSandbox", run_request(), grpc.StatusCode.UNAVAILABLE)

        file = os.path.join(node.hook_dir, "koordlet.json")
        assert f"required hook server koordlet is not registered (no {file})" in details
        assert "PreRunPodSandbox needs it" in details
        assert 1.0 == held(node, "koordlet", RUN)

    async def test_other_calls_go_through(self, node: Node) -> None:
        await node.start_proxy(requirements=requiring("koordlet"))
        runtime = node.client.runtime

        assert (await node.client.call(runtime.Version, api_pb2.VersionRequest())).runtime_name
        await node.client.call(runtime.ListPodSandbox, api_pb2.ListPodSandboxRequest())
        await node.client.call(runtime.ListContainers, api_pb2.ListContainersRequest())
        await node.client.call(runtime.Status, api_pb2.StatusRequest())
        await node.client.call(
            node.client.image.ImageStatus, api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image="nginx"))
        )

        assert held(node, "koordlet", RUN) is None

    async def test_retry_goes_through_hooked_once_it_is_there(self, node: Node) -> None:
        await node.start_proxy(requirements=requiring("koordlet"))
        await rejection(node, "RunPodSandbox", run_request())

        plugin = await node.add_plugin("koordlet", hooked_plugin(), [RUN])
        pod_id = await node.run_pod()

        [forwarded] = node.received("RunPodSandbox")
        assert HOOKED_PARENT == forwarded.config.linux.cgroup_parent
        assert [RUN] == plugin.hooks_called()
        assert pod_id in node.proxy.hooks.store.pods()

    async def test_points_named_limit_the_requirement(self, node: Node) -> None:
        await node.start_proxy(requirements=requiring("koordlet=PreCreateContainer"))
        pod_id = await node.run_pod()  # PreRunPodSandbox is not required

        details = await refused(
            node, "CreateContainer", node.create_request(pod_id), grpc.StatusCode.UNAVAILABLE
        )

        assert "PreCreateContainer needs it" in details

    async def test_a_server_registered_without_a_required_point_refuses_it(
        self, node: Node, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Required at PreCreateContainer, registered (and answering) for PreRunPodSandbox only: the
        container is not created without it, as NRI's validator refuses a plugin that did not process it.
        The log names the file to fix once, not once per call."""
        caplog.set_level(logging.INFO, logger="krproxy.hooks.required")
        await node.add_plugin("koordlet", hooked_plugin(), [RUN])
        await node.start_proxy(requirements=requiring("koordlet=PreCreateContainer"))
        pod_id = await node.run_pod()

        await rejection(node, "CreateContainer", node.create_request(pod_id))
        details = await refused(
            node, "CreateContainer", node.create_request(pod_id), grpc.StatusCode.UNAVAILABLE
        )

        [logged] = logged_events(caplog.records, "required_server_not_hooked")
        assert ("koordlet", "PreCreateContainer") == (logged["server"], logged["hook"])
        assert (
            "required hook server koordlet is registered, but not for this hook point "
            "(koordlet.json lists PreRunPodSandbox): PreCreateContainer needs it"
        ) in details
        assert 2.0 == held(node, "koordlet", CREATE)

    async def test_an_annotated_server_must_be_registered_for_create(self, node: Node) -> None:
        """A container annotated with a server that does not hook PreCreateContainer is not created: NRI's
        validator refuses a container a required plugin did not process."""
        await node.add_plugin("gpu", hooked_plugin(), [RUN])
        await node.start_proxy(requirements=requiring())
        config = annotated({"required-plugins.noderesource.dev/container.app": '["gpu"]'})
        pod_id = await node.run_pod(config)
        request = api_pb2.CreateContainerRequest(
            pod_sandbox_id=pod_id, config=container_config("app"), sandbox_config=config
        )

        details = await refused(node, "CreateContainer", request, grpc.StatusCode.UNAVAILABLE)

        assert "required hook server gpu is registered, but not for this hook point" in details

    async def test_a_registration_gone_after_the_check_refuses_the_call(
        self, node: Node, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The server is up when the guard checks it, and its file goes away before the chain runs (it
        is shutting down): the call is refused, not sent on without it."""
        await node.add_plugin("koordlet", hooked_plugin(), [RUN])
        await node.start_proxy(requirements=requiring("koordlet"))
        guard = node.proxy.hooks.guard
        assert guard is not None
        checked = guard.admit

        async def admit_then_unregister(point: HookPoint, names: Any, **kwargs: Any) -> None:
            await checked(point, names, **kwargs)
            node.proxy.hooks.dispatcher.publish(Registry())

        monkeypatch.setattr(guard, "admit", admit_then_unregister)

        details = await refused(node, "RunPodSandbox", run_request(), grpc.StatusCode.UNAVAILABLE)

        assert "required hook server koordlet is not registered (its registration file went away)" in details

    async def test_a_registered_server_that_fails_a_call_refuses_it(self, node: Node, sockdir: str) -> None:
        """Up at the probe, gone at the call (Ignore in its file): the call is refused, not sent unhooked."""
        async with trio.open_nursery() as plugins:
            await plugins.start(run_fake_plugin, node.plugin_socket("koordlet"), hooked_plugin())
            await node.add_plugin("koordlet", hooks=[RUN], serve=False)
            await node.start_proxy(requirements=requiring("koordlet"))
            await wait_until(
                lambda: node.proxy.hooks.guard is not None and not node.proxy.hooks.guard.missing()
            )
            plugins.cancel_scope.cancel()

        details = await refused(node, "RunPodSandbox", run_request(), grpc.StatusCode.UNAVAILABLE)

        assert "required hook server koordlet" in details

    async def test_a_server_too_slow_for_its_hook_call_refuses_it(self, node: Node) -> None:
        """It answers the probe but not the hook call within its timeout (Ignore in its file): refused, not
        sent on without its changes; the next call, once it is fast again, is hooked."""
        plugin = hooked_plugin()
        plugin.misbehave(Misbehaviour(hang=True, times=1), RUN)
        await node.add_plugin("koordlet", plugin, [RUN], call_timeout=HANG_TIMEOUT)
        await node.start_proxy(requirements=requiring("koordlet"))

        details = await refused(node, "RunPodSandbox", run_request(), grpc.StatusCode.UNAVAILABLE)

        assert "required hook server koordlet failed PreRunPodSandbox: no answer within" in details
        await node.run_pod()
        assert [HOOKED_PARENT] == [r.config.linux.cgroup_parent for r in node.received("RunPodSandbox")]


class TestFlapping:
    async def test_many_pods_while_the_server_flaps_none_runs_unhooked(self, node: Node) -> None:
        """40 pods, a few milliseconds apart, while the required server stops and starts again and again
        (its file stays): each pod is refused or forwarded hooked, none is forwarded without its changes."""
        await node.add_plugin("koordlet", hooks=[RUN], serve=False)
        await node.start_proxy(requirements=requiring("koordlet"))
        codes: list[grpc.StatusCode] = []

        async def pod(i: int) -> None:
            await trio.sleep(i * 0.01)
            try:
                await node.run_pod(pod_config(f"p{i}"))
            except grpc.RpcError as err:
                codes.append(err.code())
            else:
                codes.append(grpc.StatusCode.OK)

        async def flap() -> None:
            for _ in range(5):
                async with trio.open_nursery() as server:
                    await server.start(run_fake_plugin, node.plugin_socket("koordlet"), hooked_plugin())
                    await trio.sleep(0.04)
                    server.cancel_scope.cancel()
                await trio.sleep(0.04)

        async with trio.open_nursery() as calls:
            calls.start_soon(flap)
            for i in range(40):
                calls.start_soon(pod, i)

        assert 40 == len(codes)
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}
        forwarded = node.received("RunPodSandbox")
        assert codes.count(grpc.StatusCode.OK) == len(forwarded)
        assert all(HOOKED_PARENT == r.config.linux.cgroup_parent for r in forwarded)


class TestRegisteredButNotThere:
    async def test_socket_unreachable(self, node: Node) -> None:
        await node.add_plugin("koordlet", hooks=[RUN], serve=False)  # registered, nothing listens
        await node.start_proxy(requirements=requiring("koordlet"))

        details = await refused(node, "RunPodSandbox", run_request(), grpc.StatusCode.UNAVAILABLE)

        socket_path = node.plugin_socket("koordlet")
        assert f"koordlet is registered but its socket is unreachable ({socket_path}:" in details

    async def test_not_answering(self, node: Node) -> None:
        """Registered and listening, but its serve loop never answers (a hung server): refused, named as
        not answering, not as unreachable."""
        await node.add_plugin("koordlet", hooked_plugin(), [RUN], answer_after=math.inf)
        await node.start_proxy(requirements=requiring("koordlet"))

        details = await refused(node, "RunPodSandbox", run_request(), grpc.StatusCode.UNAVAILABLE)

        socket_path = node.plugin_socket("koordlet")
        assert f"koordlet is registered but not answering (no answer within 1s at {socket_path})" in details

    async def test_answering_late_holds_calls_until_it_answers(self, node: Node) -> None:
        """Registered and listening, still starting (answers nothing yet): calls are refused; once it
        answers, kubelet's retry goes through hooked, without a new registration."""
        answering = trio.Event()
        plugin = await node.add_plugin("koordlet", hooked_plugin(), [RUN], answer_after=answering)
        await node.start_proxy(requirements=requiring("koordlet"))

        details = await refused(node, "RunPodSandbox", run_request(), grpc.StatusCode.UNAVAILABLE)
        assert "koordlet is registered but not answering" in details

        answering.set()
        await node.run_pod()
        assert [RUN] == plugin.hooks_called()
        assert [HOOKED_PARENT] == [r.config.linux.cgroup_parent for r in node.received("RunPodSandbox")]

    async def test_not_answering_from_the_command_line(self, node: Node, sockdir: str) -> None:
        """``python -m krproxy.fakes.plugin --not-answering``: registered, listening, never answering."""
        socket_path = os.path.join(sockdir, "cli.sock")
        command = [sys.executable, "-m", "krproxy.fakes.plugin", f"--socket={socket_path}"]
        command += [
            f"--hook-dir={node.hook_dir}",
            "--name=cli",
            "--hooks=PreRunPodSandbox",
            "--not-answering",
        ]
        process = await trio.lowlevel.open_process(command)
        try:
            await wait_until(lambda: os.path.exists(os.path.join(node.hook_dir, "cli.json")), LIVENESS_LIMIT)
            await node.start_proxy(requirements=requiring("cli"))

            details = await refused(node, "RunPodSandbox", run_request(), grpc.StatusCode.UNAVAILABLE)

            assert f"cli is registered but not answering (no answer within 1s at {socket_path})" in details
        finally:
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(LIVENESS_LIMIT):
                assert 0 == await process.wait()

    async def test_readyz_and_status_name_it(self, node: Node) -> None:
        await node.start_proxy(requirements=requiring("koordlet=PreRunPodSandbox"))
        view = node.proxy.admin_view
        assert view is not None
        await wait_until(lambda: "koordlet" in " ".join(view.readiness()[1]))

        ready, reasons = view.readiness()
        report = admin.render_status(view.status())

        assert not ready
        assert any(
            r.startswith("required hook servers missing") and "koordlet not registered" in r for r in reasons
        )
        assert "required hook server koordlet: missing (no " in report
        assert "hooks: PreRunPodSandbox" in report
        up = node.proxy.metrics.registry.get_sample_value(
            "krproxy_required_server_up", {"server": "koordlet"}
        )
        assert 0.0 == up

        await node.add_plugin("koordlet", hooks=[RUN])
        await wait_until(lambda: view.readiness()[0])
        assert "required hook server koordlet: up" in admin.render_status(view.status())


class TestStartup:
    async def test_a_call_waits_for_the_server_during_the_grace(self, node: Node) -> None:
        """Within the start-up grace a call needing a missing server waits for it, then goes through hooked."""
        await node.start_proxy(requirements=requiring("koordlet", grace=60.0))
        async with trio.open_nursery() as calls:
            calls.start_soon(node.run_pod)
            await wait_until(lambda: node.proxy.relay.transport.in_flight == 1)
            assert [] == node.fake.requests("RunPodSandbox")
            await node.add_plugin("koordlet", hooked_plugin(), [RUN])

        [forwarded] = node.received("RunPodSandbox")
        assert HOOKED_PARENT == forwarded.config.linux.cgroup_parent

    async def test_restart_with_the_server_absent_lets_nothing_through(self, node: Node) -> None:
        """A pod runs hooked; krproxy and the server go away; the new krproxy refuses until the server is back."""
        async with trio.open_nursery() as plugins:
            await plugins.start(run_fake_plugin, node.plugin_socket("koordlet"), hooked_plugin())
            await node.add_plugin("koordlet", hooks=[RUN], serve=False)
            await node.start_proxy(requirements=requiring("koordlet"))
            await node.run_pod()
            await node.stop_proxy()
            plugins.cancel_scope.cancel()

        await node.start_proxy(requirements=requiring("koordlet"), socket_name="proxy2.sock")
        error = await rejection(node, "RunPodSandbox", run_request(pod_config("db")))

        assert grpc.StatusCode.UNAVAILABLE == error.code()
        assert 1 == len(node.fake.requests("RunPodSandbox"))  # the first krproxy's pod only

        await node.nursery.start(run_fake_plugin, node.plugin_socket("koordlet"), hooked_plugin())
        await node.run_pod(pod_config("db"))
        assert [HOOKED_PARENT] * 2 == [r.config.linux.cgroup_parent for r in node.received("RunPodSandbox")]


def annotated(annotations: dict[str, str], name: str = "web") -> api_pb2.PodSandboxConfig:
    config = pod_config(name)
    config.annotations.update(annotations)
    return config


class TestAnnotations:
    async def test_container_scoped_requirement(self, node: Node) -> None:
        await node.start_proxy(requirements=requiring())
        key = "required-plugins.noderesource.dev/container.app"
        config = annotated({key: json.dumps(["gpu"])})
        pod_id = await node.run_pod(config)  # the pod itself requires nothing
        request = api_pb2.CreateContainerRequest(
            pod_sandbox_id=pod_id, config=container_config("app"), sandbox_config=config
        )

        error = await rejection(node, "CreateContainer", request)
        sidecar = await node.create_container(pod_id, container_config("sidecar"))

        assert grpc.StatusCode.UNAVAILABLE == error.code()
        assert "required hook server gpu is not registered" in error.details()
        assert ["sidecar"] == [r.config.metadata.name for r in node.received("CreateContainer")]
        assert sidecar

        await node.add_plugin("gpu", FakePlugin(Changes(cpu_quota=12345)), [CREATE])
        await node.call("CreateContainer", request)
        assert 12345 == node.received("CreateContainer")[-1].config.linux.resources.cpu_quota

    async def test_pod_scoped_requirement_holds_run_pod_sandbox(self, node: Node) -> None:
        await node.start_proxy(requirements=requiring())

        request = run_request(annotated({"required-plugins.noderesource.dev/pod": "[ net ]"}))
        details = await refused(node, "RunPodSandbox", request, grpc.StatusCode.UNAVAILABLE)

        assert "required hook server net is not registered" in details

    async def test_malformed_annotation_is_refused_with_the_fix(self, node: Node) -> None:
        await node.start_proxy(requirements=requiring())

        request = run_request(annotated({"required-plugins.noderesource.dev": "net"}))
        details = await refused(node, "RunPodSandbox", request, grpc.StatusCode.INVALID_ARGUMENT)

        assert "is not a list of hook server names" in details

    async def test_many_pods_naming_distinct_servers_keep_memory_bounded(self, node: Node) -> None:
        """300 pods, each requiring a server of its own that is not there: each is refused, the guard
        tracks at most MAX_ANNOTATED_SERVERS names and the held metric has as many series; the daemon
        answers on."""
        await node.start_proxy(requirements=requiring())
        for i in range(MAX_ANNOTATED_SERVERS + 44):
            config = annotated({"required-plugins.noderesource.dev/pod": f'["net-{i}"]'}, f"p{i}")
            error = await rejection(node, "RunPodSandbox", run_request(config))
            assert f"required hook server net-{i} is not registered" in error.details()

        guard = node.proxy.hooks.guard
        assert guard is not None
        assert MAX_ANNOTATED_SERVERS == len(guard.states())
        assert "net-299" in guard.states() and "net-0" not in guard.states()
        series = [
            s
            for metric in node.proxy.metrics.registry.collect()
            if metric.name == "krproxy_required_calls_held"
            for s in metric.samples
            if s.name.endswith("_total")
        ]
        assert MAX_ANNOTATED_SERVERS == len(series)
        assert [] == node.fake.requests("RunPodSandbox")
        assert (await node.client.call(node.client.runtime.Version, api_pb2.VersionRequest())).runtime_name

    async def test_tolerate_annotation_exempts(self, node: Node) -> None:
        tolerate = "tolerate-missing-nri-plugins.noderesource.dev"
        await node.start_proxy(requirements=requiring("koordlet", tolerate_annotation=tolerate))

        await node.run_pod(annotated({tolerate: "true"}))
        error = await rejection(node, "RunPodSandbox", run_request(annotated({tolerate: "false"}, "db")))

        assert grpc.StatusCode.UNAVAILABLE == error.code()
        assert 1 == len(node.fake.requests("RunPodSandbox"))

    async def test_skip_label_exempts(self, node: Node) -> None:
        """A hook server's own pods carry the skip label: they must start while it is missing."""
        await node.start_proxy(requirements=requiring("koordlet"))
        labels = {"runtimeproxy.koordinator.sh/skip-hookserver": "true"}

        await node.run_pod(pod_config("koordlet", labels=labels))

        assert 1 == len(node.fake.requests("RunPodSandbox"))
