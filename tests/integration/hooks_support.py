"""Shared harness of the ``test_hooks_*`` integration tests (this module holds no tests).

A :class:`Node` is what a kubelet sees: the real proxy daemon in front of a fake containerd, hook
plugins (:class:`krproxy.fakes.plugin.FakePlugin`) registered in its hook directory, and an independent grpcio
CRI client (upstream ``cri_api`` stubs) talking to the proxy.

Plugins started before :meth:`Node.start_proxy` are loaded by the proxy's first directory scan (no
waiting); plugins registered (or registered anew) later are waited for until the proxy uses what was
written (the directory is polled every 0.5 s).

Timing: a plugin that answers gets :data:`PLUGIN_TIMEOUT`, long enough that it never fires on a loaded
machine (CI runs three suites at once on 2 cores); a test that wants the proxy's timeout to fire makes
the plugin hang on exactly the calls that should time out and gives it :data:`HANG_TIMEOUT` for them
(:meth:`Node.add_plugin` again with ``call_timeout=HANG_TIMEOUT``, after any calls it must answer).
Waits for something that must happen are liveness bounds (:data:`~tests.integration.support.LIVENESS_LIMIT`),
never speed claims.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import grpc
import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy.daemon import Daemon
from krproxy.fakes.containerd import FakeContainerd, Fault
from krproxy.fakes.plugin import ALL_HOOKS, FakePlugin, run_fake_plugin, write_atomic, write_registration
from krproxy.grpcstatus import Status
from krproxy.hooks.points import HookPoint
from krproxy.hooks.registration import parse_registration
from krproxy.proto.runtime import v1alpha1 as hookapi
from tests.integration.support import LIVENESS_LIMIT, ProxyHolder, start_proxy, wait_until

#: Plugin timeout used by default, for plugins that answer: it must not fire even when the machine is
#: loaded (at 0.3 s a PreRunPodSandbox answer came too late now and then, and the pod went unchanged).
PLUGIN_TIMEOUT = "10s"
#: Plugin timeout for calls a test makes the plugin hang on (the timeout is meant to fire): short, so that
#: timeout tests take little real time. A hang never answers, so the timeout fires however loaded.
HANG_TIMEOUT = "0.3s"
#: How long a registration change may take to reach the proxy before a test fails. A liveness bound:
#: the watcher's poll interval is shown in virtual time (tests/unit/test_hooks_watcher.py).
REGISTRATION_LIMIT = LIVENESS_LIMIT

#: The hook points a pod's whole life calls, in order (PostStop hooks run after the runtime stopped
#: the object): run the pod, create, start, update and stop a container, stop the pod.
LIFECYCLE_HOOKS = [
    HookPoint.PRE_RUN_POD_SANDBOX,
    HookPoint.PRE_CREATE_CONTAINER,
    HookPoint.PRE_START_CONTAINER,
    HookPoint.POST_START_CONTAINER,
    HookPoint.PRE_UPDATE_CONTAINER_RESOURCES,
    HookPoint.POST_STOP_CONTAINER,
    HookPoint.POST_STOP_POD_SANDBOX,
]
#: Runtime faults of a create or remove after which the caller got an error, so the store keeps what it
#: had: the runtime did not do the work, or the caller cannot know it did.
FAILED_WORK = {
    "error": Fault(status=Status.INTERNAL, message="boom"),
    "error after the work": Fault(status=Status.INTERNAL, message="lost", after_call=True),
    "dropped": Fault(drop=True),
    "dropped after the work": Fault(drop=True, after_call=True),
}

POD_LABELS = {"io.kubernetes.pod.name": "web", "app": "web"}
POD_ANNOTATIONS = {"kubernetes.io/config.source": "api"}
CGROUP_PARENT = "/kubepods/burstable/poduid-web"
RESOURCES = {
    "cpu_period": 100_000,
    "cpu_quota": 200_000,
    "cpu_shares": 2048,
    "memory_limit_in_bytes": 1 << 30,
    "oom_score_adj": 900,
    "cpuset_cpus": "0-3",
    "cpuset_mems": "0",
}


#: The hook-protocol metadata of :func:`pod_config`'s pod.
POD_META = hookapi.PodSandboxMetadata(name="web", uid="uid-web", namespace="prod", attempt=1)


def pod_hook_request(**changes: Any) -> hookapi.PodSandboxHookRequest:
    """What pod hooks get for :func:`pod_config` run with handler runc, before any plugin change;
    ``changes`` replace or add fields."""
    fields: dict[str, Any] = {
        "pod_meta": POD_META,
        "runtime_handler": "runc",
        "labels": POD_LABELS,
        "annotations": POD_ANNOTATIONS,
        "cgroup_parent": CGROUP_PARENT,
    }
    return hookapi.PodSandboxHookRequest(**{**fields, **changes})


def pod_config(
    name: str = "web", *, labels: Mapping[str, str] | None = None, attempt: int = 1
) -> api_pb2.PodSandboxConfig:
    """A kubelet-like PodSandboxConfig with labels, annotations and a cgroup parent."""
    return api_pb2.PodSandboxConfig(
        metadata=api_pb2.PodSandboxMetadata(name=name, uid=f"uid-{name}", namespace="prod", attempt=attempt),
        hostname=name,
        labels=dict(POD_LABELS if labels is None else labels),
        annotations=POD_ANNOTATIONS,
        linux=api_pb2.LinuxPodSandboxConfig(cgroup_parent=CGROUP_PARENT),
    )


def container_config(name: str = "app") -> api_pb2.ContainerConfig:
    """A kubelet-like ContainerConfig with annotations, envs (one duplicated) and full Linux resources."""
    return api_pb2.ContainerConfig(
        metadata=api_pb2.ContainerMetadata(name=name, attempt=2),
        image=api_pb2.ImageSpec(image="nginx:1.25"),
        labels={"io.kubernetes.container.name": name},
        annotations={"io.kubernetes.container.hash": "abc"},
        envs=[
            api_pb2.KeyValue(key="PATH", value="/bin"),
            api_pb2.KeyValue(key="MODE", value="a"),
            api_pb2.KeyValue(key="MODE", value="b"),
        ],
        linux=api_pb2.LinuxContainerConfig(resources=api_pb2.LinuxContainerResources(**RESOURCES)),
    )


def hook_resources(**overrides: Any) -> hookapi.LinuxContainerResources:
    """The hook-protocol form of :data:`RESOURCES`, with *overrides*."""
    return hookapi.LinuxContainerResources(**{**RESOURCES, **overrides})


@attrs.define
class Node(ProxyHolder):
    """The proxy, a fake containerd, fake plugins and a grpcio client, all in one test's nursery."""

    nursery: trio.Nursery
    sockdir: str
    fake: FakeContainerd
    runtime_socket: str
    client_factory: Any
    daemon: Daemon | None = None
    proxy_name: str = "proxy.sock"
    _client: Any = None

    @property
    def hook_dir(self) -> str:
        return os.path.join(self.sockdir, "hooks")

    @property
    def proxy_socket(self) -> str:
        return os.path.join(self.sockdir, self.proxy_name)

    @property
    def proxy(self) -> Daemon:
        assert self.daemon is not None, "start_proxy() first"
        return self.daemon

    # -- plugins --------------------------------------------------------------------------------

    def plugin_socket(self, name: str) -> str:
        return os.path.join(self.sockdir, f"{name}.sock")

    async def add_plugin(
        self,
        name: str,
        plugin: FakePlugin | None = None,
        hooks: Iterable[HookPoint | str] = ALL_HOOKS,
        *,
        failure_policy: str = "Ignore",
        call_timeout: str | float | None = PLUGIN_TIMEOUT,
        order: int | None = None,
        serve: bool = True,
        answer_after: float | trio.Event = 0.0,
    ) -> FakePlugin:
        """Serve *plugin* on ``<sockdir>/<name>.sock`` (unless not *serve*) and register it as ``<name>.json``.
        With *answer_after*, the plugin listens at once but answers nothing for that long (``math.inf``:
        never; an event: until it is set; :func:`~krproxy.fakes.plugin.run_fake_plugin`).

        With the proxy running, returns once the proxy uses this registration (a rewritten one too: the
        same endpoint keeps the proxy's connection to the plugin).
        """
        plugin = FakePlugin() if plugin is None else plugin
        if serve:
            serving = functools.partial(run_fake_plugin, answer_after=answer_after)
            await self.nursery.start(serving, self.plugin_socket(name), plugin)
        path = write_registration(
            self.hook_dir,
            name,
            self.plugin_socket(name),
            hooks,
            failure_policy=failure_policy,
            timeout=call_timeout,
            order=order,
        )
        if self.daemon is not None:
            expected = parse_registration(f"{name}.json", await trio.Path(path).read_bytes())
            dispatcher = self.proxy.hooks.dispatcher
            await wait_until(
                lambda: dispatcher.registry.plugins.get(expected.file) == expected, REGISTRATION_LIMIT
            )
        return plugin

    def write_file(self, file: str, content: bytes | dict[str, Any]) -> None:
        """Write any content as ``hook_dir/<file>``, atomically."""
        os.makedirs(self.hook_dir, exist_ok=True)
        data = content if isinstance(content, bytes) else json.dumps(content).encode()
        write_atomic(os.path.join(self.hook_dir, file), data)

    def registered(self) -> list[str]:
        """The registration files the proxy currently uses, in call order."""
        return [p.file for p in self.proxy.hooks.dispatcher.registry.ordered()]

    async def wait_registered(self, file: str, present: bool = True) -> None:
        await wait_until(lambda: (file in self.registered()) == present, REGISTRATION_LIMIT)

    # -- proxy ----------------------------------------------------------------------------------

    async def start_proxy(
        self, *, wait_recovered: bool = True, socket_name: str = "proxy.sock", **config: Any
    ) -> Daemon:
        """Start the proxy on ``<sockdir>/<socket_name>`` in front of the fake containerd, and wait until
        its store is recovered."""
        config.setdefault("runtime_endpoint", self.runtime_socket)
        self.proxy_name = socket_name
        self._client = None
        config["listen"] = self.proxy_socket
        self.daemon = await start_proxy(self.nursery, self.sockdir, **config)
        if wait_recovered:
            await self.wait_recovered()
        return self.daemon

    # -- CRI calls through the proxy (grpcio) ---------------------------------------------------

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = self.client_factory(self.proxy_socket)
        return self._client

    async def call(self, method: str, request: Any) -> Any:
        return await self.client.call(getattr(self.client.runtime, method), request)

    async def run_pod(self, config: api_pb2.PodSandboxConfig | None = None) -> str:
        request = api_pb2.RunPodSandboxRequest(config=config or pod_config(), runtime_handler="runc")
        return str((await self.call("RunPodSandbox", request)).pod_sandbox_id)

    def create_request(
        self, pod_id: str, config: api_pb2.ContainerConfig | None = None
    ) -> api_pb2.CreateContainerRequest:
        """A CreateContainer in pod *pod_id* whose sandbox_config names that pod, as kubelet's does (the
        proxy refuses another pod's): :func:`pod_config` with the pod's identity where the runtime has it."""
        sandbox = pod_config()
        known = self.fake.state.sandboxes.get(pod_id)
        if known is not None:
            sandbox.metadata.name, sandbox.metadata.uid = known.name, known.uid
            sandbox.metadata.namespace = known.namespace
        return api_pb2.CreateContainerRequest(
            pod_sandbox_id=pod_id, config=config or container_config(), sandbox_config=sandbox
        )

    async def create_container(self, pod_id: str, config: api_pb2.ContainerConfig | None = None) -> str:
        reply = await self.call("CreateContainer", self.create_request(pod_id, config))
        return str(reply.container_id)

    async def start(self, container_id: str) -> None:
        await self.call("StartContainer", api_pb2.StartContainerRequest(container_id=container_id))

    async def stop(self, container_id: str) -> None:
        await self.call("StopContainer", api_pb2.StopContainerRequest(container_id=container_id, timeout=0))

    async def stop_pod(self, pod_id: str) -> None:
        await self.call("StopPodSandbox", api_pb2.StopPodSandboxRequest(pod_sandbox_id=pod_id))

    async def update(self, container_id: str, **resources: Any) -> None:
        request = api_pb2.UpdateContainerResourcesRequest(
            container_id=container_id, linux=api_pb2.LinuxContainerResources(**resources)
        )
        await self.call("UpdateContainerResources", request)

    async def update_pod(self, request: api_pb2.UpdatePodSandboxResourcesRequest | bytes) -> None:
        """UpdatePodSandboxResources (pod-level resize), a message or its bytes as they are to be sent;
        the upstream grpcio stubs predate the method, so it is called by path."""
        serialize = api_pb2.UpdatePodSandboxResourcesRequest.SerializeToString
        call = self.client.channel.unary_unary(
            "/runtime.v1.RuntimeService/UpdatePodSandboxResources",
            request_serializer=(lambda data: data) if isinstance(request, bytes) else serialize,
            response_deserializer=api_pb2.UpdatePodSandboxResourcesResponse.FromString,
        )
        await self.client.call(call, request)

    async def pod_with_container(self) -> tuple[str, str]:
        """Run the default pod and create (not start) its default container; return both ids."""
        pod_id = await self.run_pod()
        return pod_id, await self.create_container(pod_id)

    # -- what the fake containerd received ------------------------------------------------------

    def received(self, method: str) -> list[Any]:
        """The requests of *method* the fake containerd got, decoded with the upstream (grpcio) types."""
        message_type = getattr(api_pb2, f"{method}Request")
        return [message_type.FromString(r.raw) for r in self.fake.requests(method)]


async def make_node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    """The fixture body of ``node`` in each ``test_hooks_*`` module (proxy not started yet)."""
    fake, path = fake_containerd
    return Node(nursery, sockdir, fake, path, cri_client)


async def rejection(node: Node, method: str, request: Any) -> grpc.RpcError:
    """The error ``method`` fails with when ``node``'s proxy is called with ``request`` (the call must fail)."""
    with pytest.raises(grpc.RpcError) as info:
        if method == "UpdatePodSandboxResources":
            await node.update_pod(request)
        else:
            await node.call(method, request)
    return info.value


async def refused(node: Node, method: str, request: Any, code: grpc.StatusCode) -> str:
    """Call ``method`` through ``node``'s proxy and check that the proxy refused it with ``code`` before it
    reached the runtime (the fake containerd got no ``method`` call at all); return the error's details for
    the caller's checks of the message."""
    error = await rejection(node, method, request)
    details = error.details() or ""
    # This module is not rewritten by pytest: the messages say what a failed check saw.
    assert code == error.code(), f"{method} refused with {error.code()}, not {code}: {details}"
    forwarded = node.fake.requests(method)
    assert [] == forwarded, f"{method} refused ({details}) but the runtime got {len(forwarded)} call(s)"
    return details
