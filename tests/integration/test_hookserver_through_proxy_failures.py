"""The SDK hook server behind the real proxy, in front of the fake containerd, when things go
wrong: a plugin's error under each pair of failure policies (the plugin's and its registration's),
and a removed pod forgotten by the hook server.
"""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Callable

import attrs
import grpc
import pytest
import trio
from cri_api.v1 import api_pb2 as pb

from krproxy.fakes.containerd import (
    FakeContainerd,
)
from krproxy.hookserver import (
    ContainerContext,
    FailurePolicy,
    PodContext,
    Stage,
)
from krproxy.hookserver.testing import FakeNode
from tests.conftest import CriClient
from tests.integration.support import LIVENESS_LIMIT
from tests.integration.test_hookserver_through_proxy import (
    BE,
    LS,
    POLICY,
    created,
    make_app,
    pod_files,
    prime_cpu_suppress,
    proxy_and_hookserver,
    sdk_behind_proxy,
    start_pod,
    write_policy,
)

REFUSE = "test.krproxy.io/refuse"


@pytest.mark.parametrize(
    ("plugin_policy", "registration_policy"),
    [
        (FailurePolicy.FAIL, FailurePolicy.FAIL),
        (FailurePolicy.IGNORE, FailurePolicy.FAIL),
        (FailurePolicy.FAIL, FailurePolicy.IGNORE),
    ],
    ids=[
        "plugin-Fail/registration-Fail",
        "plugin-Ignore/registration-Fail",
        "plugin-Fail/registration-Ignore",
    ],
)
async def test_plugin_error_under_failure_policies(
    fake_containerd: tuple[FakeContainerd, str],
    short_tmp: pathlib.Path,
    cri_client: Callable[[str], CriClient],
    plugin_policy: FailurePolicy,
    registration_policy: FailurePolicy,
) -> None:
    """A custom hook ``strict-check`` raises for marked pods and containers, next to the built-ins.

    - plugin Fail, registration Fail: the CRI call fails (UNKNOWN, naming the server and the
      plugin), nothing is forwarded and nothing is written — not even what plugins that ran
      before it in the stage asked for;
    - plugin Ignore: the call succeeds and the other plugins' changes apply;
    - plugin Fail, registration Ignore: the proxy drops the failed answer and forwards the
      request unmodified (no SDK change at all for that call).
    """
    fake, runtime = fake_containerd
    node = FakeNode(short_tmp / "node").create()
    app = make_app(node, plugin_policy)

    # Sorts after groupidentity/cpusuppress (pod stage) and cpuset/envinject (container stage).
    @app.hook(Stage.PRE_RUN_POD_SANDBOX, name="strict-check")
    @app.hook(Stage.PRE_CREATE_CONTAINER, name="strict-check")
    def strict_check(ctx: PodContext | ContainerContext) -> None:
        marks = ctx.request.labels if isinstance(ctx, PodContext) else ctx.request.annotations
        if REFUSE in marks:
            raise ValueError("refused by policy")

    policy = short_tmp / "policy.yaml"
    write_policy(policy, POLICY)
    refused = plugin_policy is FailurePolicy.FAIL and registration_policy is FailurePolicy.FAIL
    sdk_applied = plugin_policy is FailurePolicy.IGNORE
    with trio.fail_after(LIVENESS_LIMIT):
        async with trio.open_nursery() as nursery:
            daemon, _ = await proxy_and_hookserver(
                nursery,
                app,
                runtime,
                short_tmp,
                policy_path=str(policy),
                failure_policy=registration_policy,
            )
            prime_cpu_suppress(app)
            client = cri_client(daemon.config.listen)

            # Pod level: a BE pod marked for refusal.
            marked_pod = attrs.evolve(BE, labels={REFUSE: "true"})
            node.add_cgroup(marked_pod.cgroup_parent)
            run = pb.RunPodSandboxRequest(config=marked_pod.sandbox_config())
            if refused:
                with pytest.raises(grpc.RpcError) as info:
                    await client.call(client.runtime.RunPodSandbox, run)
                assert grpc.StatusCode.UNKNOWN == info.value.code()
                details = info.value.details()
                assert details.startswith(
                    "hook server err: hook server krproxy-hookserver failed PreRunPodSandbox"
                )
                assert "hook plugin 'strict-check' failed at PreRunPodSandbox: refused by policy" in details
                assert [] == fake.requests("RunPodSandbox")
            else:
                await client.call(client.runtime.RunPodSandbox, run)
                assert 1 == len(fake.requests("RunPodSandbox"))
            expected_pod = ("-1", "200000 100000") if sdk_applied else ("0", "max 100000")
            assert expected_pod == pod_files(node, marked_pod)

            # Container level: an unmarked LS pod whose container is marked.
            node.add_cgroup(LS.cgroup_parent)
            ls_config = LS.sandbox_config()
            sandbox = await client.call(
                client.runtime.RunPodSandbox, pb.RunPodSandboxRequest(config=ls_config)
            )
            assert ("2", "max 100000") == pod_files(node, LS)
            container = LS.container_config()
            container.annotations[REFUSE] = "true"
            create = pb.CreateContainerRequest(
                pod_sandbox_id=sandbox.pod_sandbox_id, config=container, sandbox_config=ls_config
            )
            if refused:
                with pytest.raises(grpc.RpcError) as info:
                    await client.call(client.runtime.CreateContainer, create)
                assert grpc.StatusCode.UNKNOWN == info.value.code()
                assert "hook plugin 'strict-check' failed at PreCreateContainer" in info.value.details()
                assert [] == fake.requests("CreateContainer")
            else:
                await client.call(client.runtime.CreateContainer, create)
                received = created(fake, sandbox.pod_sandbox_id)
                assert received.config is not None and received.config.linux is not None
                resources = received.config.linux.resources
                assert resources is not None
                expected = ("0-1", -1) if sdk_applied else ("", 50_000)
                assert expected == (resources.cpuset_cpus, resources.cpu_quota)
            nursery.cancel_scope.cancel()


async def test_removed_pod_is_forgotten_by_the_hook_server(
    fake_containerd: tuple[FakeContainerd, str],
    short_tmp: pathlib.Path,
    cri_client: Callable[[str], CriClient],
) -> None:
    """After kubelet stops and removes a pod through the proxy, re-apply no longer targets it."""
    fake, runtime = fake_containerd
    async with sdk_behind_proxy(runtime, short_tmp) as (node, app, daemon, _):
        client = cri_client(daemon.config.listen)
        be = await start_pod(client, fake, node, BE)
        assert [1] == [len(t.containers) for t in app.pods.targets()]
        for method, request in (
            (client.runtime.StopContainer, pb.StopContainerRequest(container_id=be.container_id)),
            (client.runtime.RemoveContainer, pb.RemoveContainerRequest(container_id=be.container_id)),
            (client.runtime.StopPodSandbox, pb.StopPodSandboxRequest(pod_sandbox_id=be.sandbox_id)),
            (client.runtime.RemovePodSandbox, pb.RemovePodSandboxRequest(pod_sandbox_id=be.sandbox_id)),
        ):
            await client.call(method, request)
        shutil.rmtree(node.cgroup_root / BE.cgroup_parent.strip("/"))  # kubelet removes the cgroup
        assert {} == daemon.hooks.store.pods()  # the proxy forgot it
        app.reconcile()  # a re-apply (policy change, CPU suppress tick) …
        assert () == app.pods.targets()  # … should not target it any more
