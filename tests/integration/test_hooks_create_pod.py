"""Which pod a CreateContainer names: its ``pod_sandbox_id`` and the ``sandbox_config`` it carries must agree.

containerd creates the container in the sandbox the id names but writes the config's pod name and namespace
into its OCI spec (``tests/e2e/test_containerd_fields.py`` measures it on 1.6, 1.7 and 2.1), while the hooks
are shown the stored pod: a config naming another pod is refused before any hook, a config naming none goes on.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import trio

from krproxy.hooks.points import HookPoint
from tests.integration.hooks_support import Node, container_config, make_node, pod_config, refused


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


@pytest.mark.parametrize("field", ["name", "namespace", "uid"])
async def test_another_pod_s_config_is_refused(node: Node, field: str) -> None:
    """A create whose sandbox_config differs from its sandbox's in the pod's name, namespace or uid is refused
    INVALID_ARGUMENT, naming both pods; no hook runs and the runtime gets nothing."""
    plugin = await node.add_plugin("limits", hooks=[HookPoint.PRE_CREATE_CONTAINER])
    await node.start_proxy()
    pod_id = await node.run_pod(pod_config("web"))
    request = node.create_request(pod_id, container_config("app"))
    setattr(request.sandbox_config.metadata, field, "other")

    details = await refused(node, "CreateContainer", request, grpc.StatusCode.INVALID_ARGUMENT)

    assert "carries the sandbox_config of" in details and "prod/web" in details, details
    assert [] == plugin.requests(HookPoint.PRE_CREATE_CONTAINER)


@pytest.mark.parametrize("skipped", [False, True])
async def test_refused_with_no_hook_to_run(node: Node, skipped: bool) -> None:
    """With no hook server for PreCreateContainer, or a pod that skips hooks (the creates krproxy forwards
    as a watched call, without its interceptor), another pod's config is refused as well: the store would
    keep the container under the pod its later hooks are shown."""
    if skipped:
        await node.add_plugin("limits", hooks=[HookPoint.PRE_CREATE_CONTAINER])
    await node.start_proxy()
    labels = {"runtimeproxy.koordinator.sh/skip-hookserver": "true"} if skipped else None
    pod_id = await node.run_pod(pod_config("web", labels=labels))
    request = node.create_request(pod_id, container_config("app"))
    request.sandbox_config.metadata.name = "other"

    details = await refused(node, "CreateContainer", request, grpc.StatusCode.INVALID_ARGUMENT)

    assert "carries the sandbox_config of prod/other" in details, details


async def test_own_or_no_config_goes_on(node: Node) -> None:
    """The sandbox's own config (another attempt, other labels: only the pod's identity counts) and a config
    with no metadata are hooked and forwarded."""
    plugin = await node.add_plugin("limits", hooks=[HookPoint.PRE_CREATE_CONTAINER])
    await node.start_proxy()
    pod_id = await node.run_pod(pod_config("web"))
    own = node.create_request(pod_id, container_config("own"))
    own.sandbox_config.CopyFrom(pod_config("web", labels={"tier": "changed"}, attempt=2))
    bare = node.create_request(pod_id, container_config("bare"))
    bare.sandbox_config.ClearField("metadata")

    for request in (own, bare):
        await node.call("CreateContainer", request)

    assert ["own", "bare"] == [r.config.metadata.name for r in node.received("CreateContainer")]
    shown = plugin.requests(HookPoint.PRE_CREATE_CONTAINER)
    assert [("web", "prod"), ("web", "prod")] == [(r.pod_meta.name, r.pod_meta.namespace) for r in shown]
