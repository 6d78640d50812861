"""Standalone mode against the fake containerd: the same policies converge without a proxy.

Pods are created in the fake runtime directly (its state machine); their cgroups live in a
fake node tree. The fake's sandbox status has no verbose info, so the pod cgroup is found
where kubelet puts it (``/kubepods/<qos>/pod<uid>``) under the fake root.
"""

from __future__ import annotations

import functools
import json
import pathlib

import pytest
import trio

from krproxy.fakes.containerd import FakeContainerd
from krproxy.hookserver import (
    CgroupFile,
    HookServer,
    NodePolicy,
    PodSelector,
    Stage,
    run_standalone,
)
from krproxy.hookserver.policies import cpuset, cpusuppress, groupidentity, resctrl
from krproxy.hookserver.testing import FakeNode, container_request, pod_request
from krproxy.proto.runtime import v1 as cri
from tests.integration.support import LIVENESS_LIMIT, wait_until
from tests.integration.test_hookserver_through_proxy import POLICY, meter

PODS = {
    # name: (qos label, cgroup parent, annotations)
    "be": ("BE", "/kubepods/besteffort/poduid-be", {}),
    "ls": ("LS", "/kubepods/burstable/poduid-ls", {cpuset.ANNOTATION: json.dumps({"cpuset": "0-1"})}),
}


def make_app(node: FakeNode) -> HookServer:
    app = HookServer(executor=node.executor())
    groupidentity.install(app)
    cpuset.install(app)
    cpusuppress.install(app, meter, interval=0.05)
    resctrl.install(app)
    return app


def policy_file(tmp: pathlib.Path) -> pathlib.Path:
    """:data:`POLICY` written to ``tmp/policy.yaml``."""
    policy = tmp / "policy.yaml"
    policy.write_text(POLICY)
    return policy


async def start_standalone(
    nursery: trio.Nursery, app: HookServer, runtime: str, policy: pathlib.Path, **options: object
) -> None:
    """Standalone mode for ``app`` against ``runtime`` with the policy file ``policy``, a pass every
    50 ms; ``options`` go to :func:`run_standalone`."""
    await nursery.start(
        functools.partial(run_standalone, app, runtime, interval=0.05, policy_path=str(policy), **options)
    )


def start_pod(fake: FakeContainerd, name: str, *, namespace: str = "default", labelled: bool = True) -> str:
    """RunPodSandbox + CreateContainer + StartContainer in the fake; returns the container id."""
    qos, _parent, annotations = PODS[name]
    sandbox_id = fake.state.run_pod_sandbox(
        cri.RunPodSandboxRequest(
            config=cri.PodSandboxConfig(
                metadata=cri.PodSandboxMetadata(name=name, uid=f"uid-{name}", namespace=namespace),
                labels={"koordinator.sh/qosClass": qos} if labelled else {"app": name},
                annotations=annotations,
            )
        )
    ).pod_sandbox_id
    container_id = fake.state.create_container(
        cri.CreateContainerRequest(
            pod_sandbox_id=sandbox_id,
            config=cri.ContainerConfig(
                metadata=cri.ContainerMetadata(name="app"), image=cri.ImageSpec(image="x")
            ),
        )
    ).container_id
    fake.state.start_container(cri.StartContainerRequest(container_id=container_id))
    return container_id


def snapshot(node: FakeNode) -> dict[str, str | None]:
    """The pod-level and resctrl files the policies own."""
    files: dict[str, str | None] = {}
    for name, (_qos, parent, _ann) in PODS.items():
        for file in (CgroupFile.CPU_BVT, CgroupFile.CFS_QUOTA):
            files[f"{name}:{file.name}"] = node.read(parent, file)
    for group in ("BE", "LS"):
        files[group] = node.read_resctrl(f"{group}/schemata")
    return files


async def test_standalone_converges_like_proxy_mode(
    fake_containerd: tuple[FakeContainerd, str], short_tmp: pathlib.Path
) -> None:
    """Standalone writes the same pod/resctrl files as proxy mode, and the CRI-level cpuset/quota
    the proxy mode answers with land in the container cgroup; later pods and policy edits follow."""
    fake, socket = fake_containerd
    ids = {name: start_pod(fake, name) for name in PODS}

    standalone_node = FakeNode(short_tmp / "a").create()
    proxy_node = FakeNode(short_tmp / "b").create()
    for node in (standalone_node, proxy_node):
        for i, (name, (_q, parent, _a)) in enumerate(PODS.items()):
            node.add_cgroup(parent)
            node.add_cgroup(f"{parent}/{ids[name]}", pids=[100 + i])

    # Proxy mode, driven directly: the hook calls kubelet's pod start would cause.
    proxy_app = make_app(proxy_node)
    policy = policy_file(short_tmp)
    proxy_app.set_policy(NodePolicy.load(policy))
    proxy_app.tick(proxy_app.tickers[0])
    create_answers = {}
    for name, (qos, parent, pod_annotations) in PODS.items():
        pod = pod_request(name, qos=qos, cgroup_parent=parent, annotations=pod_annotations)
        proxy_app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod)
        create_answers[name] = proxy_app.handle_container(
            Stage.PRE_CREATE_CONTAINER, container_request(pod, "app")
        )
        proxy_app.handle_container(Stage.POST_START_CONTAINER, container_request(pod, "app", id=ids[name]))

    app = make_app(standalone_node)
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await start_standalone(nursery, app, f"unix://{socket}", policy)
            expected = snapshot(proxy_node)
            assert expected["be:CFS_QUOTA"] == "200000 100000"  # 8 × 50% − 2 LS
            await wait_until(lambda: snapshot(standalone_node) == expected)

            ls_dir = f"{PODS['ls'][1]}/{ids['ls']}"
            ls_answer = create_answers["ls"].container_resources
            assert ls_answer is not None and ("0-1", -1) == (ls_answer.cpuset_cpus, ls_answer.cpu_quota)
            assert "0-1" == standalone_node.read(ls_dir, CgroupFile.CPUSET_CPUS)
            assert "max 100000" == standalone_node.read(ls_dir, CgroupFile.CFS_QUOTA)
            assert "100" == standalone_node.read_resctrl("BE/tasks")
            assert "101" == standalone_node.read_resctrl("LS/tasks")

            # The policy file changes: BE group identity follows without any CRI event.
            policy.write_text(POLICY.replace("groupIdentity: -1", "groupIdentity: 0"))
            await wait_until(lambda: standalone_node.read(PODS["be"][1], CgroupFile.CPU_BVT) == "0")
            nursery.cancel_scope.cancel()


async def test_later_pod_is_picked_up_at_next_pass(
    fake_containerd: tuple[FakeContainerd, str], short_tmp: pathlib.Path
) -> None:
    """Asynchronous by design: a pod started after a pass gets its settings at a later pass."""
    fake, socket = fake_containerd
    node = FakeNode(short_tmp / "n").create()
    app = make_app(node)
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await start_standalone(nursery, app, socket, policy_file(short_tmp))
            assert () == app.pods.targets()
            parent = PODS["be"][1]
            node.add_cgroup(parent)
            node.add_cgroup(f"{parent}/{start_pod(fake, 'be')}", pids=[7])
            await wait_until(lambda: node.read(parent, CgroupFile.CPU_BVT) == "-1")
            await wait_until(lambda: node.read_resctrl("BE/tasks") == "7")
            nursery.cancel_scope.cancel()


async def test_runtime_outage_is_logged_and_retried(
    short_tmp: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No runtime at the socket: each pass logs the failure and the loop keeps going."""
    app = make_app(FakeNode(short_tmp / "n").create())
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(run_standalone, app, str(short_tmp / "missing.sock"), interval=0.02)
            )
            await wait_until(lambda: caplog.text.count("cri_list_failed") >= 3)
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("selector", "touched"),
    [
        (None, {"be"}),  # default: only Koordinator-QoS-labelled pods
        (PodSelector(frozenset({"tenant"}), qos_labelled=False), {"ls"}),
        (PodSelector(labels={"app": "ls"}, qos_labelled=False), {"ls"}),
        (PodSelector(frozenset({"tenant"})), set()),
    ],
)
async def test_only_selected_pods_are_touched(
    fake_containerd: tuple[FakeContainerd, str],
    short_tmp: pathlib.Path,
    selector: PodSelector | None,
    touched: set[str],
) -> None:
    """On a shared node: a QoS-labelled BE pod in ``default`` and another tenant's unlabelled pod;
    standalone changes only the pods its selector selects."""
    fake, socket = fake_containerd
    node = FakeNode(short_tmp / "n").create()
    ids = {"be": start_pod(fake, "be"), "ls": start_pod(fake, "ls", namespace="tenant", labelled=False)}
    for name, cid in ids.items():
        node.add_cgroup(PODS[name][1])
        node.add_cgroup(f"{PODS[name][1]}/{cid}")
    app = make_app(node)
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            await start_standalone(nursery, app, socket, policy_file(short_tmp), selector=selector)
            assert touched == {t.pod.meta.name for t in app.pods.targets()}
            nursery.cancel_scope.cancel()
    bvt = {name: node.read(PODS[name][1], CgroupFile.CPU_BVT) for name in ids}
    assert {"be": "-1" if "be" in touched else "0", "ls": "2" if "ls" in touched else "0"} == bvt


class TestPodSelector:
    def test_parse(self) -> None:
        """--namespace and --selector values become a selector; --all-pods drops the QoS label rule."""
        selector = PodSelector.parse(["a", "b"], ["app=x,tier = batch", "team=t"], all_pods=True)
        assert (
            PodSelector(frozenset({"a", "b"}), {"app": "x", "tier": "batch", "team": "t"}, False) == selector
        )
        assert PodSelector() == PodSelector.parse([], [])

    @pytest.mark.parametrize("bad", ["app", "=x", "app=x,oops"])
    def test_bad_selector(self, bad: str) -> None:
        """A term that is not key=value is refused, saying what is expected."""
        with pytest.raises(ValueError, match="is not key=value"):
            PodSelector.parse([], [bad])
