"""Eviction answers of a Python NRI plugin (NRI's ``evict`` in CreateContainer and UpdateContainer
responses), against the fake NRI runtime, which, as NRI's adaptation, receives them and acts on none."""

from __future__ import annotations

import logging

import pytest
import trio

from krproxy.fakes.nri import FakeNriRuntime, NriError
from krproxy.hookserver.nri import NriStub
from krproxy.proto.nri.pkg.api import v1alpha1 as api
from tests.integration.nri_support import container, fake_runtime, pod
from tests.integration.support import LIVENESS_LIMIT

LIMIT = LIVENESS_LIMIT


@pytest.fixture
async def runtime(nursery: trio.Nursery, short_tmp: object) -> FakeNriRuntime:
    return await fake_runtime(nursery, short_tmp, request_timeout=10.0)


async def attach(nursery: trio.Nursery, runtime: FakeNriRuntime, stub: NriStub) -> None:
    stub.socket = runtime.socket_path
    await nursery.start(stub.run)
    await runtime.wait_for_plugins(1)


async def test_evictions_reach_the_runtime(
    runtime: FakeNriRuntime, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """Evictions answered with an adjustment or an update reach the runtime with their reasons, and the
    stub warns that NRI acts on none: the container stays, the adjustment is applied."""
    stub = NriStub("evictor", "44")

    @stub.create_container
    def adjust(pod_: api.PodSandbox, ctr: api.Container) -> api.CreateContainerResponse:
        return api.CreateContainerResponse(
            adjust=api.ContainerAdjustment(env=[api.KeyValue(key="PLACED", value="yes")]),
            evict=[api.ContainerEviction(container_id="ctr-old", reason="make room for app")],
        )

    @stub.update_container
    def update(
        pod_: api.PodSandbox, ctr: api.Container, res: api.LinuxResources
    ) -> api.UpdateContainerResponse:
        return api.UpdateContainerResponse(
            evict=[api.ContainerEviction(container_id="ctr-old", reason=f"{ctr.name} grew")]
        )

    with trio.fail_after(LIMIT):
        await attach(nursery, runtime, stub)
        await runtime.run_pod(pod())
        runtime.containers["ctr-old"] = container("old")
        with caplog.at_level(logging.WARNING, "krproxy.hookserver.nri"):
            created = await runtime.create_container(container())
            await runtime.update_container("ctr-app", api.LinuxResources())
    assert runtime.evictions == [
        ("44-evictor", "ctr-old", "make room for app"),
        ("44-evictor", "ctr-old", "app grew"),
    ]
    assert "PLACED=yes" in created.env
    assert "ctr-old" in runtime.containers
    warnings = [r for r in caplog.records if r.getMessage() == "nri_stub_evictions_not_applied"]
    assert len(warnings) == 2
    assert "ctr-old (make room for app)" in warnings[0].krproxy_fields["containers"]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("eviction", "error"),
    [
        (api.ContainerEviction(reason="no id"), "adjust asked to evict a container without naming it"),
        (
            api.ContainerEviction(container_id="ctr-app", reason="self"),
            "adjust asked to evict ctr-app, the container being created: raise to refuse it",
        ),
    ],
    ids=["no container id", "the container being created"],
)
async def test_bad_eviction_fails_own_event(
    runtime: FakeNriRuntime, nursery: trio.Nursery, eviction: api.ContainerEviction, error: str
) -> None:
    """An eviction NRI could not name is refused as a wrong answer: that creation fails, saying why,
    and nothing is sent; the plugin stays connected."""
    stub = NriStub("evictor", "45")

    @stub.create_container
    def adjust(pod_: api.PodSandbox, ctr: api.Container) -> api.CreateContainerResponse:
        if ctr.name == "fine":
            return api.CreateContainerResponse()
        return api.CreateContainerResponse(evict=[eviction])

    with trio.fail_after(LIMIT):
        await attach(nursery, runtime, stub)
        await runtime.run_pod(pod())
        with pytest.raises(NriError, match=f"plugin 45-evictor: {error}"):
            await runtime.create_container(container())
        await runtime.create_container(container("fine"))
    assert runtime.evictions == []
    assert len(runtime.plugins) == 1
