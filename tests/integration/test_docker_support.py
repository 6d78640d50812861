"""Shared harness of the ``test_docker_*`` integration tests (this module holds no tests).

A :class:`DockerNode` is what dockershim sees: the real proxy daemon in Docker mode in front of a fake
dockerd (:mod:`krproxy.fakes.dockerd`), fake hook plugins registered in its hook directory, and a small HTTP
client (:mod:`krproxy.docker.client`) talking to the proxy socket. Bodies are built like dockershim's.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import h11
import trio

from krproxy.config import ProxyConfig
from krproxy.daemon import serve
from krproxy.docker import DockerDaemon
from krproxy.docker._http import Reply
from krproxy.docker.client import request
from krproxy.fakes.dockerd import FakeDockerd, run_fake_dockerd
from krproxy.fakes.plugin import ALL_HOOKS, FakePlugin, run_fake_plugin, write_registration
from krproxy.hooks.points import HookPoint
from tests.integration.hooks_support import PLUGIN_TIMEOUT
from tests.integration.support import LIVENESS_LIMIT, ProxyHolder
from tests.records import DOCKER_HOST_RESOURCES

#: Seconds any one socket operation of a test may take (a liveness bound).
IO_LIMIT = LIVENESS_LIMIT

SANDBOX_NAME = "k8s_POD_web_prod_uid-web_1"
CONTAINER_NAME = "k8s_app_web_prod_uid-web_2"
CGROUP_PARENT = "/kubepods/burstable/poduid-web"
POD_LABELS = {"io.kubernetes.pod.name": "web", "app": "web"}
POD_ANNOTATIONS = {"kubernetes.io/config.source": "api"}
HOST_RESOURCES = DOCKER_HOST_RESOURCES


def sandbox_body(labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A dockershim-like create body of the sandbox of pod prod/web."""
    return {
        "Image": "registry.k8s.io/pause:3.9",
        "Hostname": "web",
        "Labels": {
            "io.kubernetes.docker.type": "podsandbox",
            **(POD_LABELS if labels is None else labels),
            **{f"annotation.{k}": v for k, v in POD_ANNOTATIONS.items()},
        },
        "HostConfig": {"CgroupParent": CGROUP_PARENT, "CpuShares": 2, "NetworkMode": "none"},
    }


def container_body(sandbox_id: str) -> dict[str, Any]:
    """A dockershim-like create body of container ``app`` (envs with a repeated name, full resources)."""
    return {
        "Image": "nginx:1.25",
        "Env": ["PATH=/bin", "MODE=a", "MODE=b"],
        "Labels": {
            "io.kubernetes.docker.type": "container",
            "io.kubernetes.sandbox.id": sandbox_id,
            "io.kubernetes.container.name": "app",
            "annotation.io.kubernetes.container.hash": "abc",
        },
        "HostConfig": {
            "CgroupParent": CGROUP_PARENT,
            **HOST_RESOURCES,
            "NetworkMode": f"container:{sandbox_id}",
        },
    }


@attrs.define
class DockerNode(ProxyHolder):
    """The proxy in Docker mode, a fake dockerd and fake plugins, all in one test's nursery."""

    nursery: trio.Nursery
    sockdir: str
    fake: FakeDockerd = attrs.field(factory=FakeDockerd)
    daemon: DockerDaemon | None = None

    @property
    def hook_dir(self) -> str:
        return os.path.join(self.sockdir, "hooks")

    @property
    def proxy_socket(self) -> str:
        return os.path.join(self.sockdir, "proxy.sock")

    @property
    def docker_socket(self) -> str:
        return os.path.join(self.sockdir, "docker.sock")

    @property
    def proxy(self) -> DockerDaemon:
        assert self.daemon is not None, "start_proxy() first"
        return self.daemon

    async def start_dockerd(self) -> FakeDockerd:
        await self.nursery.start(run_fake_dockerd, self.docker_socket, self.fake)
        return self.fake

    async def add_plugin(
        self,
        name: str,
        plugin: FakePlugin | None = None,
        hooks: Iterable[HookPoint] = ALL_HOOKS,
        *,
        failure_policy: str = "Ignore",
        call_timeout: str = PLUGIN_TIMEOUT,
        serve: bool = True,
    ) -> FakePlugin:
        """Serve *plugin* on ``<sockdir>/<name>.sock`` (unless not *serve*) and register it (before the proxy
        starts: a running proxy picks the file up at its next poll)."""
        plugin = FakePlugin() if plugin is None else plugin
        path = os.path.join(self.sockdir, f"{name}.sock")
        if serve:
            await self.nursery.start(run_fake_plugin, path, plugin)
        write_registration(
            self.hook_dir, name, path, hooks, failure_policy=failure_policy, timeout=call_timeout
        )
        return plugin

    async def start_proxy(self, *, wait_recovered: bool = True, **config: Any) -> DockerDaemon:
        """Start the proxy (Docker mode) on ``proxy.sock`` in front of ``docker.sock``; wait for recovery."""
        settings: dict[str, Any] = {
            "listen": self.proxy_socket,
            "runtime_endpoint": self.docker_socket,
            "hook_dir": self.hook_dir,
            "backend_mode": "Docker",
            "grace_period": 1.0,
            **config,
        }
        self.daemon = await self.nursery.start(
            functools.partial(serve, ProxyConfig(**settings), handle_signals=False)
        )
        if wait_recovered:
            await self.wait_recovered()
        return self.proxy

    async def call(self, method: str, target: str, body: Any = None) -> Reply:
        """One request to the proxy (a JSON body unless bytes)."""
        data = body if isinstance(body, bytes) else (b"" if body is None else json.dumps(body).encode())
        headers = [(b"Content-Type", b"application/json")] if data else []
        with trio.fail_after(IO_LIMIT):
            return await request(self.proxy_socket, method, target, data, headers=headers)

    async def create(self, name: str, body: dict[str, Any]) -> str:
        reply = await self.call("POST", f"/v1.41/containers/create?name={name}", body)
        assert 201 == reply.status, reply.body
        ident: str = json.loads(reply.body)["Id"]
        return ident

    async def create_pod(self) -> tuple[str, str]:
        """Create the sandbox and container ``app`` through the proxy; their ids."""
        sandbox = await self.create(SANDBOX_NAME, sandbox_body())
        return sandbox, await self.create(CONTAINER_NAME, container_body(sandbox))


async def make_node(nursery: trio.Nursery, sockdir: str, *, dockerd: bool = True) -> DockerNode:
    node = DockerNode(nursery, sockdir)
    if dockerd:
        await node.start_dockerd()
    return node


async def open_raw(path: str) -> trio.SocketStream:
    with trio.fail_after(IO_LIMIT):
        return await trio.open_unix_socket(path)


async def receive_until(stream: trio.SocketStream, predicate: Any, limit: float = IO_LIMIT) -> bytes:
    """Read from *stream* until ``predicate(data so far)`` holds or the stream ends."""
    data = b""
    with trio.fail_after(limit):
        while not predicate(data):
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            data += chunk
    return data


async def read_response(
    stream: trio.SocketStream, on_data: Callable[[bytes], object] | None = None
) -> tuple[h11.Response, bytes]:
    """Read one whole HTTP response from a raw stream (h11 client side); ``on_data`` sees the body
    so far after each piece of it arrives (to feed a streamed response while it is read)."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))  # only to set h11's state
    conn.send(h11.EndOfMessage())
    head: h11.Response | None = None
    body = b""
    with trio.fail_after(IO_LIMIT):
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
                if on_data is not None:
                    on_data(body)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
    assert head is not None
    return head, body
