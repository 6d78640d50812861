"""The SDK hook server (built-in policies) behind the real proxy, in front of the fake containerd.

Issue 7's "done when", end to end: the SDK server registers itself in the proxy's hook
directory with its own file (accepted unchanged); pods created through the proxy with the
grpcio CRI client get group identity, CPU suppress and resctrl settings written under a
temp node tree (:class:`FakeNode`), and the CRI-expressible ones reach the runtime inside
the CreateContainer request; a policy edit re-applies without CRI calls; standalone mode
converges the same tree without the proxy; plugin failures behave per failure policy.

The fake containerd does not touch cgroups. Where a real runtime (runc) would apply the
CreateContainer resources to the new container's cgroup, :func:`runtime_applies` does it
from what the fake received, so a node tree here looks like a real node's after start.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import trio
from cri_api.v1 import api_pb2 as pb

from krproxy.daemon import Daemon
from krproxy.fakes.containerd import (
    FakeContainerd,
    RuntimeState,
    run_fake_containerd,
    sequential_ids,
    stepping_clock,
)
from krproxy.hooks.points import HookPoint
from krproxy.hooks.registration import FailurePolicy as ProxyFailurePolicy
from krproxy.hookserver import (
    CgroupFile,
    FailurePolicy,
    HookServer,
    PodTarget,
    ServeOptions,
    Stage,
    registration_json,
    run_standalone,
    serve,
)
from krproxy.hookserver.policies import cpuset, envinject, install_all
from krproxy.hookserver.policies.cpusuppress import Measurement
from krproxy.hookserver.testing import FakeNode
from krproxy.proto.runtime import v1 as cri
from tests.conftest import CriClient
from tests.integration.support import LIVENESS_LIMIT, start_proxy, wait_until

POLICY = """
resourceQOSStrategy:
  lsClass: {cpuQOS: {groupIdentity: 2}, resctrlQOS: {catRangeEndPercent: 100, mbaPercent: 100}}
  beClass: {cpuQOS: {groupIdentity: -1}, resctrlQOS: {catRangeEndPercent: 25, mbaPercent: 30}}
resourceUsedThresholdWithBE: {cpuSuppressThresholdPercent: 50, cpuSuppressPolicy: cfsQuota}
"""
#: The edit of the policy-change test: only BE settings move.
EDITED_POLICY = (
    POLICY.replace("groupIdentity: -1", "groupIdentity: 0")
    .replace("catRangeEndPercent: 25, mbaPercent: 30", "catRangeEndPercent: 50, mbaPercent: 60")
    .replace("cpuSuppressThresholdPercent: 50", "cpuSuppressThresholdPercent: 75")
)
REGISTRATION = "krproxy-hookserver.json"


def meter(targets: Sequence[PodTarget]) -> Measurement:
    """CPU suppress's usage sampler, fixed: 8 cores, 2 busy, all by LS pods.

    BE budget = 8 × threshold − 2 LS − 0 system: 2 cores at 50 %, 4 at 75 %.
    """
    return Measurement(total_cores=8, node_used=2.0, ls_used=2.0)


@attrs.frozen
class Pod:
    """A pod of the scenario: one container ``app`` with kubelet-style resources."""

    name: str
    qos: str
    qos_dir: str  # kubelet's QoS cgroup: besteffort / burstable
    pid: int
    resources: pb.LinuxContainerResources
    annotations: Mapping[str, str] = attrs.field(factory=dict)
    labels: Mapping[str, str] = attrs.field(factory=dict)
    container_annotations: Mapping[str, str] = attrs.field(factory=dict)

    @property
    def uid(self) -> str:
        return f"uid-{self.name}"

    @property
    def cgroup_parent(self) -> str:
        return f"/kubepods/{self.qos_dir}/pod{self.uid}"

    def sandbox_config(self) -> pb.PodSandboxConfig:
        return pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=self.name, uid=self.uid, namespace="default"),
            labels={"koordinator.sh/qosClass": self.qos, **self.labels},
            annotations=dict(self.annotations),
            linux=pb.LinuxPodSandboxConfig(cgroup_parent=self.cgroup_parent),
        )

    def container_config(self) -> pb.ContainerConfig:
        return pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name="app"),
            image=pb.ImageSpec(image="registry.k8s.io/pause:3.9"),
            annotations=dict(self.container_annotations),
            envs=[pb.KeyValue(key="FROM_KUBELET", value="1")],
            linux=pb.LinuxContainerConfig(resources=self.resources),
        )


BE = Pod(
    "be",
    "BE",
    "besteffort",
    pid=100,
    resources=pb.LinuxContainerResources(cpu_period=100_000, cpu_shares=2, oom_score_adj=1000),
    annotations={envinject.ANNOTATION: json.dumps({"OMP_NUM_THREADS": "2"})},
)
LS = Pod(
    "ls",
    "LS",
    "burstable",
    pid=101,
    resources=pb.LinuxContainerResources(
        cpu_period=100_000,
        cpu_quota=50_000,
        cpu_shares=512,
        memory_limit_in_bytes=256 << 20,
        oom_score_adj=900,
    ),
    annotations={cpuset.ANNOTATION: json.dumps({"cpuset": "0-1"})},
)


# -- helpers -----------------------------------------------------------------------------------


def make_app(node: FakeNode, plugin_failure_policy: FailurePolicy = FailurePolicy.IGNORE) -> HookServer:
    app = HookServer(executor=node.executor(), plugin_failure_policy=plugin_failure_policy)
    install_all(app, meter=meter)
    return app


def prime_cpu_suppress(app: HookServer) -> None:
    """Take CPU suppress's first sample now instead of after its 1 s ticker interval.

    ``install_all`` has no interval knob; without this the first BE pod would be created
    before any BE budget exists (and get its quota one tick later, by re-apply).
    """
    (ticker,) = app.tickers
    app.tick(ticker)


def write_policy(path: pathlib.Path, text: str) -> None:
    """Replace the policy file atomically (new inode: the watcher cannot miss it)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def proxy_and_hookserver(
    nursery: trio.Nursery, app: HookServer, runtime: str, tmp: pathlib.Path, **options: Any
) -> tuple[Daemon, ServeOptions]:
    """The proxy in ``tmp`` in front of ``runtime``, and ``app`` served registering into its hook
    dir (``options`` go to :class:`ServeOptions`); return once the proxy uses the registration."""
    daemon = await start_proxy(nursery, str(tmp), runtime_endpoint=runtime)
    opts = ServeOptions(socket=str(tmp / "hs.sock"), hook_dir=daemon.config.hook_dir, **options)
    await nursery.start(serve, app, opts)
    await wait_until(lambda: REGISTRATION in daemon.hooks.dispatcher.registry.plugins)
    return daemon, opts


@contextlib.asynccontextmanager
async def sdk_behind_proxy(
    runtime: str, tmp: pathlib.Path, **options: Any
) -> AsyncIterator[tuple[FakeNode, HookServer, Daemon, ServeOptions]]:
    """A fake node in ``tmp``, :func:`make_app`'s SDK server on it, and :func:`proxy_and_hookserver`
    (``options`` go to :class:`ServeOptions`), all within the liveness bound: yields the node, the
    server, the proxy and the serve options; stops them all after."""
    node = FakeNode(tmp / "node").create()
    app = make_app(node)
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            daemon, opts = await proxy_and_hookserver(nursery, app, runtime, tmp, **options)
            yield node, app, daemon, opts
            nursery.cancel_scope.cancel()


def runtime_applies(node: FakeNode, cgroup_dir: str, res: cri.LinuxContainerResources | None) -> None:
    """What runc does at create: the CRI resources into the container cgroup (set fields only)."""
    if res is None:
        return
    executor = node.executor()
    if res.cpu_shares:
        executor.set(cgroup_dir, CgroupFile.CPU_SHARES, res.cpu_shares)
    if res.cpu_quota:
        executor.set(cgroup_dir, CgroupFile.CFS_QUOTA, res.cpu_quota)
    if res.memory_limit_in_bytes:
        executor.set(cgroup_dir, CgroupFile.MEMORY_LIMIT, res.memory_limit_in_bytes)
    if res.cpuset_cpus:
        executor.set(cgroup_dir, CgroupFile.CPUSET_CPUS, res.cpuset_cpus)


def created(fake: FakeContainerd, sandbox_id: str) -> cri.CreateContainerRequest:
    """The CreateContainer request the runtime received for ``sandbox_id``'s container."""
    (request,) = [
        r.message
        for r in fake.requests("CreateContainer")
        if isinstance(r.message, cri.CreateContainerRequest) and r.message.pod_sandbox_id == sandbox_id
    ]
    return request


@attrs.frozen
class Started:
    sandbox_id: str
    container_id: str


async def start_pod(client: CriClient, fake: FakeContainerd, node: FakeNode, pod: Pod) -> Started:
    """kubelet's pod start against ``client``'s socket (proxy or runtime), with the node's cgroups.

    The pod cgroup exists before RunPodSandbox (kubelet makes it); the container cgroup appears
    at create, holding ``pod.pid``, with what the runtime received applied to it.
    """
    node.add_cgroup(pod.cgroup_parent)
    config = pod.sandbox_config()
    sandbox = await client.call(client.runtime.RunPodSandbox, pb.RunPodSandboxRequest(config=config))
    request = pb.CreateContainerRequest(
        pod_sandbox_id=sandbox.pod_sandbox_id, config=pod.container_config(), sandbox_config=config
    )
    container = await client.call(client.runtime.CreateContainer, request)
    cgroup_dir = f"{pod.cgroup_parent}/{container.container_id}"
    node.add_cgroup(cgroup_dir, pids=[pod.pid])
    received = created(fake, sandbox.pod_sandbox_id).config
    runtime_applies(node, cgroup_dir, received.linux.resources if received and received.linux else None)
    await client.call(
        client.runtime.StartContainer, pb.StartContainerRequest(container_id=container.container_id)
    )
    return Started(sandbox.pod_sandbox_id, container.container_id)


def cri_call_counts(fake: FakeContainerd) -> dict[str, int]:
    """How many requests of each CRI method the runtime received."""
    names = ("".join(part.title() for part in call.split("_")) for call in RuntimeState.CRI_CALLS)
    return {name: len(fake.requests(name)) for name in names}


def tree(node: FakeNode, rename: Mapping[str, str]) -> dict[str, str]:
    """Every file of the node (cgroup and resctrl) → stripped content; container ids → names."""

    def walk() -> Iterator[tuple[str, str]]:
        for path in sorted(node.root.rglob("*")):
            if path.is_file():
                rel = str(path.relative_to(node.root))
                for old, new in rename.items():
                    rel = rel.replace(old, new)
                yield rel, path.read_text().strip()

    return dict(walk())


async def converge(actual: Callable[[], dict[str, str]], expected: dict[str, str]) -> None:
    """Wait for ``actual()`` to equal ``expected`` (a liveness bound); on timeout, fail with pytest's diff."""
    try:
        await wait_until(lambda: actual() == expected)
    except trio.TooSlowError:
        assert expected == actual()


def pod_files(node: FakeNode, pod: Pod) -> tuple[str | None, str | None]:
    """The pod-level settings: (group identity, cfs quota)."""
    return node.read(pod.cgroup_parent, CgroupFile.CPU_BVT), node.read(
        pod.cgroup_parent, CgroupFile.CFS_QUOTA
    )


def resctrl_files(node: FakeNode, group: str) -> tuple[str | None, str | None]:
    return node.read_resctrl(f"{group}/schemata"), node.read_resctrl(f"{group}/tasks")


# -- tests -------------------------------------------------------------------------------------


async def test_sdk_registration_file_is_accepted_unchanged(
    fake_containerd: tuple[FakeContainerd, str], short_tmp: pathlib.Path
) -> None:
    """The file the SDK writes (koordlet-shaped) is what the proxy registers, byte for byte, no warnings."""
    _fake, runtime = fake_containerd
    async with sdk_behind_proxy(runtime, short_tmp, failure_policy=FailurePolicy.FAIL) as (
        _,
        _,
        daemon,
        opts,
    ):
        path = pathlib.Path(daemon.config.hook_dir) / REGISTRATION
        written = path.read_bytes()
        stages = (  # the built-ins' stages plus the two lifecycle stages every SDK server takes
            Stage.PRE_RUN_POD_SANDBOX,
            Stage.POST_STOP_POD_SANDBOX,
            Stage.PRE_CREATE_CONTAINER,
            Stage.POST_START_CONTAINER,
            Stage.POST_STOP_CONTAINER,
            Stage.PRE_UPDATE_CONTAINER_RESOURCES,
        )
        assert registration_json(opts.socket, FailurePolicy.FAIL, stages).encode() == written
        assert [REGISTRATION] == os.listdir(path.parent)  # no temp file left behind

        registry = daemon.hooks.dispatcher.registry
        assert {} == dict(registry.errors)
        plugin = registry.plugins[REGISTRATION]
        assert ("krproxy-hookserver", opts.socket, ProxyFailurePolicy.FAIL) == (
            plugin.name,
            plugin.endpoint,
            plugin.failure_policy,
        )
        assert tuple(HookPoint(s.value) for s in stages) == plugin.hooks
        assert () == plugin.warnings
        assert written == path.read_bytes()  # nobody rewrote it


@contextlib.asynccontextmanager
async def be_and_ls_through_proxy(
    fake_containerd: tuple[FakeContainerd, str],
    short_tmp: pathlib.Path,
    cri_client: Callable[[str], CriClient],
) -> AsyncIterator[tuple[FakeNode, pathlib.Path, Started, Started]]:
    """The proxy in front of the fake containerd, the SDK server (built-in policies, reading
    :data:`POLICY` from a file) registered with it, and the BE and LS pods started through it:
    yields the node, the policy file and the two pods; stops it all after."""
    fake, runtime = fake_containerd
    policy = short_tmp / "policy.yaml"
    write_policy(policy, POLICY)
    async with sdk_behind_proxy(runtime, short_tmp, policy_path=str(policy)) as (node, app, daemon, _):
        prime_cpu_suppress(app)
        client = cri_client(daemon.config.listen)
        be = await start_pod(client, fake, node, BE)
        ls = await start_pod(client, fake, node, LS)
        yield node, policy, be, ls


async def test_be_and_ls_pods_get_their_settings_through_proxy(
    fake_containerd: tuple[FakeContainerd, str],
    short_tmp: pathlib.Path,
    cri_client: Callable[[str], CriClient],
) -> None:
    """BE and LS pods created through the proxy: pod cgroups, resctrl groups and the exact
    CreateContainer requests the runtime received."""
    fake = fake_containerd[0]
    async with be_and_ls_through_proxy(fake_containerd, short_tmp, cri_client) as (node, _, be, ls):
        # Group identity and CPU suppress: BE bvt −1 and quota 2 cores; LS bvt 2, no quota.
        assert ("-1", "200000 100000") == pod_files(node, BE)
        assert ("2", "max 100000") == pod_files(node, LS)
        assert "0" == node.read(BE.cgroup_parent, CgroupFile.CPU_IDLE)  # bvt exists: no fallback
        # Resctrl: one group per class, the container's processes in it (PostStartContainer).
        assert ("L3:0=7\nMB:0=30", "100") == resctrl_files(node, "BE")
        assert ("L3:0=fff\nMB:0=100", "101") == resctrl_files(node, "LS")

        # What the runtime received: the SDK's echo + the proxy's merge keep kubelet's values
        # and add the plugins' (cpuset and unlimited quota for LS, env for BE).
        be_req, ls_req = created(fake, be.sandbox_id), created(fake, ls.sandbox_id)
        assert be_req.config is not None and be_req.config.linux is not None
        assert ls_req.config is not None and ls_req.config.linux is not None
        assert (
            cri.LinuxContainerResources(cpu_period=100_000, cpu_shares=2, oom_score_adj=1000)
            == be_req.config.linux.resources
        )
        assert (
            cri.LinuxContainerResources(
                cpu_period=100_000,
                cpu_quota=-1,
                cpu_shares=512,
                memory_limit_in_bytes=256 << 20,
                oom_score_adj=900,
                cpuset_cpus="0-1",
            )
            == ls_req.config.linux.resources
        )
        assert {"FROM_KUBELET": b"1", "OMP_NUM_THREADS": b"2"} == {
            kv.key: kv.value for kv in be_req.config.envs
        }
        assert {"FROM_KUBELET": b"1"} == {kv.key: kv.value for kv in ls_req.config.envs}
        # The pods themselves went through unmodified (the SDK only echoes labels etc.).
        (be_run, ls_run) = (r.message for r in fake.requests("RunPodSandbox"))
        assert isinstance(be_run, cri.RunPodSandboxRequest) and be_run.config is not None
        assert BE.sandbox_config() == pb.PodSandboxConfig.FromString(be_run.config.SerializeToString())
        assert isinstance(ls_run, cri.RunPodSandboxRequest) and ls_run.config is not None
        assert LS.sandbox_config() == pb.PodSandboxConfig.FromString(ls_run.config.SerializeToString())


async def test_policy_change_reapplies_to_existing_pods(
    fake_containerd: tuple[FakeContainerd, str],
    short_tmp: pathlib.Path,
    cri_client: Callable[[str], CriClient],
) -> None:
    """Editing the policy file rewrites the running pods' files, with no CRI call at all."""
    fake = fake_containerd[0]
    async with be_and_ls_through_proxy(fake_containerd, short_tmp, cri_client) as (node, policy, be, ls):
        ids = {be.container_id: "be-app", ls.container_id: "ls-app"}
        before, calls = tree(node, ids), cri_call_counts(fake)
        assert ("-1", "200000 100000") == pod_files(node, BE)

        write_policy(policy, EDITED_POLICY)
        expected = dict(before)
        expected["cgroup/kubepods/besteffort/poduid-be/cpu.bvt_warp_ns"] = "0"
        expected["cgroup/kubepods/besteffort/poduid-be/cpu.max"] = "400000 100000"  # 8 × 75 % − 2
        expected["resctrl/BE/schemata"] = "L3:0=3f\nMB:0=60"
        await converge(lambda: tree(node, ids), expected)
        assert calls == cri_call_counts(fake)


async def test_standalone_converges_to_the_same_tree(
    fake_containerd: tuple[FakeContainerd, str],
    short_tmp: pathlib.Path,
    cri_client: Callable[[str], CriClient],
) -> None:
    """The same pods, created directly on a second fake containerd and reconciled by standalone
    mode (no proxy), end with the same cgroup and resctrl files as proxy mode."""
    fake, runtime = fake_containerd
    policy = short_tmp / "policy.yaml"
    write_policy(policy, POLICY)
    proxy_node = FakeNode(short_tmp / "a").create()
    alone_node = FakeNode(short_tmp / "b").create()
    proxy_app, alone_app = make_app(proxy_node), make_app(alone_node)
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            daemon, _ = await proxy_and_hookserver(
                nursery, proxy_app, runtime, short_tmp, policy_path=str(policy)
            )
            prime_cpu_suppress(proxy_app)
            client = cri_client(daemon.config.listen)
            started = {pod.name: await start_pod(client, fake, proxy_node, pod) for pod in (BE, LS)}
            proxy_tree = tree(proxy_node, {s.container_id: f"{n}-app" for n, s in started.items()})

            # No proxy: the pods are created on the runtime itself, which applies kubelet's values.
            fake2 = FakeContainerd(RuntimeState(clock=stepping_clock(), new_id=sequential_ids("other")))
            runtime2 = str(short_tmp / "c2.sock")
            await nursery.start(run_fake_containerd, runtime2, fake2)
            direct = cri_client(runtime2)
            started2 = {pod.name: await start_pod(direct, fake2, alone_node, pod) for pod in (BE, LS)}
            rename2 = {s.container_id: f"{n}-app" for n, s in started2.items()}
            assert ("0", "max 100000") == pod_files(alone_node, BE)  # nothing applied yet
            # The fake's verbose PodSandboxStatus carries the pod's config, cgroup parent included, as
            # containerd's does: standalone reads where each pod cgroup is from it.
            status = await direct.call(
                direct.runtime.PodSandboxStatus,
                pb.PodSandboxStatusRequest(pod_sandbox_id=started2["be"].sandbox_id, verbose=True),
            )
            assert "cgroup_parent" in json.loads(status.info["info"])["config"]["linux"]

            await nursery.start(
                functools.partial(run_standalone, alone_app, runtime2, interval=0.1, policy_path=str(policy))
            )
            # Standalone is asynchronous: the BE quota needs CPU suppress's first sample (1 s tick).
            await converge(lambda: tree(alone_node, rename2), proxy_tree)
            # The container-level CRI settings it wrote are what the proxy put into CreateContainer.
            ls_dir = f"{LS.cgroup_parent}/{started2['ls'].container_id}"
            assert ("0-1", "max 100000") == (
                alone_node.read(ls_dir, CgroupFile.CPUSET_CPUS),
                alone_node.read(ls_dir, CgroupFile.CFS_QUOTA),
            )
            nursery.cancel_scope.cancel()
