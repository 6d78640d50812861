"""What the tests of ``krproxy nri`` share: NRI's pod and container, and a node (the fake NRI
runtime, krproxy's NRI plugin and a hook directory).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import attrs
import trio

from krproxy.fakes.nri import FakeNriRuntime
from krproxy.fakes.plugin import FakePlugin, run_fake_plugin, write_registration
from krproxy.hooks.points import HookPoint
from krproxy.nri import plugin as nri_plugin
from krproxy.nri.plugin import NriConfig, NriPlugin
from krproxy.proto.nri.pkg.api import v1alpha1 as api
from tests.integration.support import LIVENESS_LIMIT, wait_until

LIMIT = LIVENESS_LIMIT  # seconds any one test may take (a liveness bound)


def pod(name: str = "web", *, labels: dict[str, str] | None = None) -> api.PodSandbox:
    return api.PodSandbox(
        id=f"pod-{name}",
        name=name,
        uid=f"uid-{name}",
        namespace="prod",
        labels={"app": name} if labels is None else labels,
        annotations={"kubernetes.io/config.source": "api"},
        linux=api.LinuxPodSandbox(cgroup_parent="/kubepods/burstable/pod-uid"),
    )


def nri_resources(
    *, cpu_period: int, cpu_quota: int, cpu_shares: int, memory_limit_in_bytes: int
) -> api.LinuxResources:
    """NRI's resources for CPU period, quota and shares and a memory limit (CRI's names for them)."""
    cpu = api.LinuxCpu(
        shares=api.OptionalUInt64(value=cpu_shares),
        quota=api.OptionalInt64(value=cpu_quota),
        period=api.OptionalUInt64(value=cpu_period),
    )
    return api.LinuxResources(
        cpu=cpu, memory=api.LinuxMemory(limit=api.OptionalInt64(value=memory_limit_in_bytes))
    )


def container(name: str = "app", pod_id: str = "pod-web") -> api.Container:
    return api.Container(
        id=f"ctr-{name}",
        pod_sandbox_id=pod_id,
        name=name,
        annotations={"io.kubernetes.container.hash": "abc"},
        env=["PATH=/bin", "MODE=a"],
        linux=api.LinuxContainer(
            resources=nri_resources(
                cpu_period=100_000, cpu_quota=100_000, cpu_shares=1024, memory_limit_in_bytes=1 << 30
            )
        ),
    )


@attrs.define
class Node:
    """A fake runtime, krproxy's NRI plugin and a hook directory."""

    sockdir: str
    runtime: FakeNriRuntime
    nursery: trio.Nursery
    plugin: NriPlugin | None = None

    @property
    def hook_dir(self) -> str:
        return os.path.join(self.sockdir, "hooks")

    async def hook_server(
        self,
        name: str,
        hooks: Iterable[HookPoint],
        *,
        policy: str = "Ignore",
        plugin_timeout: str = "10s",
        **kw: object,
    ) -> FakePlugin:
        fake = FakePlugin(**kw)  # type: ignore[arg-type]
        endpoint = os.path.join(self.sockdir, f"{name}.sock")
        await self.nursery.start(run_fake_plugin, endpoint, fake)
        write_registration(
            self.hook_dir, name, endpoint, hooks, failure_policy=policy, timeout=plugin_timeout
        )
        return fake

    async def start_krproxy(self) -> NriPlugin:
        os.makedirs(self.hook_dir, exist_ok=True)
        config = NriConfig(
            socket=self.runtime.socket_path, hook_dir=self.hook_dir, insecure_registration_files=True
        )
        self.plugin = await self.nursery.start(nri_plugin.serve, config)
        await self.runtime.wait_for_plugins(1)
        return self.plugin


async def start_node(nursery: trio.Nursery, short_tmp: object) -> Node:
    """A fake NRI runtime serving in ``short_tmp`` (krproxy is started by the test)."""
    sockdir = str(short_tmp)
    # Generous (NRI's default is 2 s): a request timeout that fires on a loaded machine drops krproxy.
    # Tests of the budget set their own, and run in virtual time.
    runtime = FakeNriRuntime(os.path.join(sockdir, "nri.sock"), request_timeout=10.0)
    await nursery.start(runtime.serve)
    return Node(sockdir, runtime, nursery)


async def wait_subscribed(node: Node, event: api.Event) -> None:
    """Until the plugin containerd knows (the latest registration) subscribes to ``event``."""
    await wait_until(lambda: bool(node.runtime.plugins) and node.runtime.plugins[0].subscribed(event), LIMIT)


async def fake_runtime(nursery: trio.Nursery, short_tmp: object, **settings: object) -> FakeNriRuntime:
    """A fake NRI runtime serving ``nri.sock`` in ``short_tmp``, with *settings* (FakeNriRuntime's)."""
    fake = FakeNriRuntime(os.path.join(str(short_tmp), "nri.sock"), **settings)  # type: ignore[arg-type]
    await nursery.start(fake.serve)
    return fake


async def whole_lifecycle(runtime: FakeNriRuntime, pod: api.PodSandbox, container: api.Container) -> None:
    """Run *pod*, then create, start, update, stop and remove *container*, then stop and remove the pod."""
    await runtime.run_pod(pod)
    await runtime.create_container(container)
    await runtime.start_container(container.id)
    await runtime.update_container(container.id, api.LinuxResources())
    await runtime.stop_container(container.id)
    await runtime.remove_container(container.id)
    await runtime.stop_pod(pod.id)
    await runtime.remove_pod(pod.id)
