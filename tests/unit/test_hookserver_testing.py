"""krproxy.hookserver.testing's NriEvents: an NRI stub's handlers tested without a runtime."""

from __future__ import annotations

import pytest

from krproxy.hookserver.nri import NriStub, PluginError
from krproxy.hookserver.testing import NriEvents
from krproxy.proto.nri.pkg.api import v1alpha1 as api

POD = api.PodSandbox(id="p1", name="web", namespace="prod")
CONTAINER = api.Container(id="c1", pod_sandbox_id="p1", name="app", env=["A=1"])


def make_stub() -> tuple[NriStub, list[str]]:
    stub, seen = NriStub("unit", "10"), []

    @stub.create_container
    def adjust(pod: api.PodSandbox, container: api.Container) -> api.ContainerAdjustment:
        if container.name == "bad":
            raise ValueError("no bad containers")
        return api.ContainerAdjustment(env=[api.KeyValue(key="B", value=pod.name)])

    @stub.on(api.Event.START_CONTAINER)
    async def started(pod: api.PodSandbox, container: api.Container) -> None:
        seen.append(container.name)

    @stub.update_pod_sandbox
    def resize(pod: api.PodSandbox, resources: api.LinuxResources, overhead: api.LinuxResources) -> None:
        seen.append("resize")

    return stub, seen


@pytest.mark.parametrize("nri_version", ["v0.12.2", ""])
async def test_events_reach_handlers(nri_version: str) -> None:
    """Create, start and the mask reach the handlers, by dedicated method or by StateChange."""
    stub, seen = make_stub()
    events = NriEvents(stub, nri_version=nri_version)
    mask = await events.configure()
    start_and_create = (1 << (api.Event.START_CONTAINER - 1)) | (1 << (api.Event.CREATE_CONTAINER - 1))
    assert mask == start_and_create | ((1 << (api.Event.UPDATE_POD_SANDBOX - 1)) if nri_version else 0)
    answer = await events.create_container(POD, CONTAINER)
    assert answer.adjust is not None and [(kv.key, kv.value) for kv in answer.adjust.env] == [("B", "web")]
    await events.event(api.Event.START_CONTAINER, POD, CONTAINER)
    await events.event(api.Event.REMOVE_CONTAINER, POD, CONTAINER)  # not subscribed: not called
    assert seen == ["app"]


async def test_handler_failure_is_plugin_error() -> None:
    """A handler's exception comes out as PluginError with the runtime's message, naming the plugin."""
    stub, _ = make_stub()
    bad = api.Container(id="c2", pod_sandbox_id="p1", name="bad")
    with pytest.raises(PluginError, match="plugin 10-unit: adjust failed: no bad containers"):
        await NriEvents(stub).create_container(POD, bad)


async def test_unimplemented_method_is_plugin_error() -> None:
    """A call the stub has no handler for says so."""
    stub, _ = make_stub()
    with pytest.raises(PluginError, match="does not implement RunPodSandbox"):
        await NriEvents(stub).call("RunPodSandbox", api.RunPodSandboxRequest(pod=POD), api.Empty)
