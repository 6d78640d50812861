"""Python NRI plugins on the SDK's stub, against the fake NRI runtime (0.12 and before)."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import socket

import pytest
import trio

from krproxy.fakes.nri import FakeNriRuntime, NriError
from krproxy.hookserver.nri import NOTICES, NriStub
from krproxy.nri.records import is_frozen
from krproxy.proto.nri.pkg.api import v1alpha1 as api
from tests.integration.nri_support import container, fake_runtime, pod, whole_lifecycle
from tests.integration.support import LIVENESS_LIMIT, wait_until

LIMIT = LIVENESS_LIMIT
ROOT = pathlib.Path(__file__).resolve().parents[2]
#: NRI v0.12.2's schema (as tests/unit/test_descriptors.py finds it).
REFERENCE = (
    pathlib.Path(os.environ.get("KRPROXY_REFERENCE_DIR", ROOT.parent / "shared" / "reference"))
    / "nri-api-v0.12.2.descriptor.json"
)


@pytest.fixture
async def runtime(nursery: trio.Nursery, short_tmp: object) -> FakeNriRuntime:
    return await fake_runtime(nursery, short_tmp, request_timeout=10.0)


async def attach(nursery: trio.Nursery, runtime: FakeNriRuntime, stub: NriStub, count: int = 1) -> None:
    stub.socket = runtime.socket_path
    await nursery.start(stub.run)
    await runtime.wait_for_plugins(count)


ADJUSTMENT = api.ContainerAdjustment(
    mounts=[api.Mount(destination="/data", type="bind", source="/srv/data", options=["rbind", "ro"])],
    env=[api.KeyValue(key="ADDED", value="yes"), api.KeyValue(key="-MODE")],
    rlimits=[api.PosixRlimit(type="RLIMIT_NOFILE", hard=4096, soft=1024)],
    hooks=api.Hooks(prestart=[api.Hook(path="/usr/local/bin/hook", args=["hook", "prestart"])]),
    linux=api.LinuxContainerAdjustment(
        devices=[api.LinuxDevice(path="/dev/fuse", type="c", major=10, minor=229)]
    ),
)


def check_adjusted(created: api.Container) -> None:
    assert [m.destination for m in created.mounts] == ["/data"]
    assert "ADDED=yes" in created.env
    assert "MODE=a" in created.env  # NRI removes no env var of the runtime's own (test_fake_nri.py)
    assert [(r.type, r.hard, r.soft) for r in created.rlimits] == [("RLIMIT_NOFILE", 4096, 1024)]
    assert created.hooks is not None and [h.path for h in created.hooks.prestart] == ["/usr/local/bin/hook"]
    assert created.linux is not None and [d.path for d in created.linux.devices] == ["/dev/fuse"]


@pytest.mark.parametrize("nri_version", ["v0.12.2", ""])
async def test_create_container_adjusted(
    runtime: FakeNriRuntime, nursery: trio.Nursery, nri_version: str
) -> None:
    """A mount, device, rlimit, OCI hook and env added reach the container being created."""
    runtime.nri_version = nri_version
    stub = NriStub("adjuster", "10")
    seen: list[str] = []

    @stub.create_container
    def adjust(pod_: api.PodSandbox, ctr: api.Container) -> api.ContainerAdjustment:
        seen.append(f"{pod_.name}/{ctr.name}")
        return ADJUSTMENT

    @stub.on(api.Event.RUN_POD_SANDBOX)
    async def started(pod_: api.PodSandbox) -> None:
        seen.append(f"run {pod_.name}")

    with trio.fail_after(LIMIT):
        await attach(nursery, runtime, stub)
        await runtime.run_pod(pod())
        created = await runtime.create_container(container())
    check_adjusted(created)
    assert seen == ["run web", "web/app"]
    method = "RunPodSandbox" if nri_version else "StateChange:RUN_POD_SANDBOX"
    assert ("call", method) in runtime.log
    assert runtime.deprecations == []
    # only the events with handlers are subscribed
    assert runtime.plugins[0].events == (1 << (api.Event.RUN_POD_SANDBOX - 1)) | (
        1 << (api.Event.CREATE_CONTAINER - 1)
    )


async def test_synchronize_with_existing_pods(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """A plugin that connects late is given the pods and containers that exist, and may update them."""
    runtime.pods["pod-web"] = pod()
    runtime.containers["ctr-app"] = container()
    stub = NriStub("sync", "20")
    synced: list[tuple[list[str], list[str]]] = []

    @stub.synchronize
    def sync(pods: list[api.PodSandbox], containers: list[api.Container]) -> list[api.ContainerUpdate]:
        synced.append(([p.id for p in pods], [c.id for c in containers]))
        memory = api.LinuxMemory(limit=api.OptionalInt64(value=1 << 28))
        resources = api.LinuxResources(memory=memory)
        return [
            api.ContainerUpdate(container_id="ctr-app", linux=api.LinuxContainerUpdate(resources=resources))
        ]

    with trio.fail_after(LIMIT):
        await attach(nursery, runtime, stub)
    assert synced == [(["pod-web"], ["ctr-app"])]
    assert stub.synchronized.is_set()
    linux = runtime.containers["ctr-app"].linux
    assert linux is not None and linux.resources is not None and linux.resources.memory is not None
    assert linux.resources.memory.limit is not None and linux.resources.memory.limit.value == 1 << 28


async def test_update_pod_sandbox_refused(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """UpdatePodSandbox reaches the handler with the new resources; raising refuses the resize."""
    stub = NriStub("resize", "30")
    seen: list[int] = []

    @stub.update_pod_sandbox
    def resize(pod_: api.PodSandbox, resources: api.LinuxResources, overhead: api.LinuxResources) -> None:
        assert resources.cpu is not None and resources.cpu.shares is not None
        seen.append(resources.cpu.shares.value)
        if resources.cpu.shares.value > 2048:
            raise ValueError("more than 2 CPUs of shares is not allowed here")

    with trio.fail_after(LIMIT):
        await attach(nursery, runtime, stub)
        await runtime.run_pod(pod())
        small = api.LinuxResources(cpu=api.LinuxCpu(shares=api.OptionalUInt64(value=1024)))
        await runtime.update_pod("pod-web", resources=small)
        big = api.LinuxResources(cpu=api.LinuxCpu(shares=api.OptionalUInt64(value=4096)))
        with pytest.raises(NriError, match="plugin 30-resize: resize failed: more than 2 CPUs"):
            await runtime.update_pod("pod-web", resources=big)
    assert seen == [1024, 4096]
    assert ("call", "PostUpdatePodSandbox") not in runtime.log  # nobody subscribed to it


async def test_validator_refusal_fails_creation(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """A validator refusing the final adjustment makes creation fail with its reason."""
    adjuster, validator = NriStub("adjuster", "10"), NriStub("validator", "90")

    @adjuster.create_container
    def adjust(pod_: api.PodSandbox, ctr: api.Container) -> api.ContainerAdjustment:
        return ADJUSTMENT

    @validator.validate_container_adjustment
    def validate(request: api.ValidateContainerAdjustmentRequest) -> str | None:
        assert request.adjust is not None
        if any(m.source.startswith("/srv") for m in request.adjust.mounts):
            return "mounts from /srv are not allowed"
        return None

    with trio.fail_after(LIMIT):
        await attach(nursery, runtime, adjuster)
        await attach(nursery, runtime, validator, 2)
        await runtime.run_pod(pod())
        with pytest.raises(
            NriError, match='validator "90-validator" rejected container adjustment, reason: mounts from /srv'
        ):
            await runtime.create_container(container())
        # an adjustment the validator accepts goes through
        accepted = api.ContainerAdjustment(env=[api.KeyValue(key="OK", value="1")])
        adjuster._handlers[api.Event.CREATE_CONTAINER] = lambda p, c: accepted
        created = await runtime.create_container(container("other"))
    assert "OK=1" in created.env


async def test_handler_error_fails_own_event(
    runtime: FakeNriRuntime, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler's exception fails its event only, named with the plugin; the plugin stays connected."""
    stub = NriStub("flaky", "40")
    calls: list[str] = []

    @stub.create_container
    def adjust(pod_: api.PodSandbox, ctr: api.Container) -> api.ContainerAdjustment | None:
        calls.append(ctr.name)
        if ctr.name == "bad":
            raise RuntimeError("cannot place this one")
        return None

    with trio.fail_after(LIMIT):
        await attach(nursery, runtime, stub)
        await runtime.run_pod(pod())
        with (
            caplog.at_level(logging.ERROR, "krproxy.hookserver.nri"),
            pytest.raises(NriError, match="plugin 40-flaky: adjust failed: cannot place this one"),
        ):
            await runtime.create_container(container("bad"))
        await runtime.create_container(container("good"))
    assert calls == ["bad", "good"]
    assert len(runtime.plugins) == 1 and runtime.dropped == []
    assert "NRI plugin 40-flaky: handler adjust failed" in caplog.text


async def test_garbage_answer_fails_own_event(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """A handler answering what NRI cannot take fails its event with a message saying what to answer."""
    stub = NriStub("garbage", "41")

    @stub.create_container
    def adjust(pod_: api.PodSandbox, ctr: api.Container) -> object:
        return {"env": "not an adjustment"}

    with trio.fail_after(LIMIT):
        await attach(nursery, runtime, stub)
        await runtime.run_pod(pod())
        with pytest.raises(
            NriError, match="plugin 41-garbage: adjust answered dict; it must answer a ContainerAdjustment"
        ):
            await runtime.create_container(container())
    assert len(runtime.plugins) == 1


async def test_records_are_read_only(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """Handlers are shown frozen records of NRI's classes; changing one fails that event, saying what
    to answer instead, and changes nothing in the runtime."""
    runtime.containers["ctr-old"] = container("old")
    stub = NriStub("mutator", "43")
    shown: list[object] = []

    @stub.synchronize
    def sync(pods: tuple[api.PodSandbox, ...], containers: tuple[api.Container, ...]) -> None:
        shown.extend([pods, containers])

    @stub.update_container
    def update(pod_: api.PodSandbox, ctr: api.Container, resources: api.LinuxResources) -> None:
        shown.append(resources)

    @stub.create_container
    def adjust(pod_: api.PodSandbox, ctr: api.Container) -> None:
        shown.extend([pod_, ctr])
        ctr.name = "renamed"

    with trio.fail_after(LIMIT):
        await attach(nursery, runtime, stub)
        await runtime.run_pod(pod())
        with pytest.raises(NriError, match=r"plugin 43-mutator: adjust failed: Container\.name is read-only"):
            await runtime.create_container(container())
        await runtime.update_container("ctr-old", api.LinuxResources())
    pods, containers, pod_, ctr, resources = shown
    assert isinstance(pods, tuple) and isinstance(containers, tuple)
    assert [c.name for c in containers] == ["old"]
    assert isinstance(pod_, api.PodSandbox) and isinstance(ctr, api.Container)
    assert isinstance(resources, api.LinuxResources)
    assert all(is_frozen(record) for record in (*pods, *containers, pod_, ctr, resources))
    assert ctr.name == "app" and "ctr-app" not in runtime.containers


async def test_slow_handler_dropped(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """A handler that outlives the request timeout makes NRI drop the plugin; the creation goes on."""
    runtime.request_timeout = 0.5
    stub = NriStub("slow", "42")

    @stub.create_container
    async def adjust(pod_: api.PodSandbox, ctr: api.Container) -> None:
        await trio.sleep_forever()

    with trio.fail_after(LIMIT):
        await attach(nursery, runtime, stub)
        await runtime.run_pod(pod())
        created = await runtime.create_container(container())
    assert created.state == api.ContainerState.CONTAINER_CREATED
    assert runtime.dropped == [("42-slow", "failed to handle CreateContainer request: timed out")]


async def test_plugin_restart_mid_stream(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """A plugin restarted between events is synchronized with what happened meanwhile and goes on."""
    first, second = NriStub("restart", "50"), NriStub("restart", "50")
    created: list[str] = []
    synced: list[list[str]] = []

    @first.create_container
    def adjust_first(pod_: api.PodSandbox, ctr: api.Container) -> None:
        created.append(f"first {ctr.name}")

    @second.create_container
    def adjust_second(pod_: api.PodSandbox, ctr: api.Container) -> None:
        created.append(f"second {ctr.name}")

    @second.synchronize
    def sync(pods: list[api.PodSandbox], containers: list[api.Container]) -> None:
        synced.append([c.name for c in containers])

    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as lifetime:
            await attach(lifetime, runtime, first)
            await runtime.run_pod(pod())
            await runtime.create_container(container("one"))
            lifetime.cancel_scope.cancel()  # the plugin stops
        await wait_until(lambda: not runtime.plugins, LIMIT)
        await runtime.create_container(container("two"))  # nobody to ask
        await attach(nursery, runtime, second)
        await runtime.create_container(container("three"))
    assert created == ["first one", "second three"]
    assert synced == [["one", "two"]]


async def test_older_runtime_lacks_0_12_events(
    runtime: FakeNriRuntime, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """A runtime before NRI 0.12 is not subscribed to UpdatePodSandbox; the stub says so."""
    runtime.nri_version = ""
    stub = NriStub("resize", "31")

    @stub.update_pod_sandbox
    def resize(pod_: api.PodSandbox, resources: api.LinuxResources, overhead: api.LinuxResources) -> None:
        raise AssertionError("not called before NRI 0.12")

    @stub.on(api.Event.REMOVE_POD_SANDBOX)
    def removed(pod_: api.PodSandbox) -> None:
        pass

    with caplog.at_level(logging.WARNING, "krproxy.hookserver.nri"), trio.fail_after(LIMIT):
        await attach(nursery, runtime, stub)
    assert runtime.plugins[0].events == 1 << (api.Event.REMOVE_POD_SANDBOX - 1)
    (record,) = [r for r in caplog.records if r.getMessage() == "nri_stub_events_unavailable"]
    assert record.krproxy_fields["events"] == "UPDATE_POD_SANDBOX"


async def test_socket_from_environment(
    runtime: FakeNriRuntime, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin started by the runtime uses the socket NRI_PLUGIN_SOCKET names and its name and index."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(runtime.socket_path)
    monkeypatch.setenv("NRI_PLUGIN_SOCKET", str(conn.detach()))
    monkeypatch.setenv("NRI_PLUGIN_NAME", "preregistered")
    monkeypatch.setenv("NRI_PLUGIN_IDX", "05")
    stub = NriStub.from_environment("default", "99", socket="/nonexistent/nri.sock")

    @stub.on(api.Event.REMOVE_POD_SANDBOX)
    def removed(pod_: api.PodSandbox) -> None:
        pass

    with trio.fail_after(LIMIT):
        await nursery.start(stub.run)
        await runtime.wait_for_plugins(1)
    assert runtime.plugins[0].full_name == "05-preregistered"


@pytest.mark.parametrize(
    ("fd", "error"), [("seven", "is not a socket's file descriptor"), ("999", "is not a socket's")]
)
async def test_bad_socket_in_environment(monkeypatch: pytest.MonkeyPatch, fd: str, error: str) -> None:
    """NRI_PLUGIN_SOCKET that is not a socket's descriptor is a clear error."""
    monkeypatch.setenv("NRI_PLUGIN_SOCKET", fd)
    stub = NriStub("p", "10")
    stub.on(api.Event.REMOVE_POD_SANDBOX)(lambda pod_: None)
    with pytest.raises(ValueError, match=error):
        await stub.run()


def test_stub_refuses_bad_definitions() -> None:
    """A bad name or index, two handlers of one event, or on() of an answered event are refused."""
    with pytest.raises(ValueError, match="two digits"):
        NriStub("p", "7")
    with pytest.raises(ValueError, match="without '/'"):
        NriStub("a/b", "10")
    stub = NriStub("p", "10")
    stub.create_container(lambda p, c: None)
    with pytest.raises(ValueError, match="two handlers"):
        stub.create_container(lambda p, c: None)
    with pytest.raises(ValueError, match="has an answer"):
        stub.on(api.Event.CREATE_CONTAINER)


async def test_validator_error_fails_creation(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """A validator whose handler raises fails the creation with NRI's words and the plugin's name."""
    validator = NriStub("strict", "91")

    @validator.validate_container_adjustment
    def validate(request: api.ValidateContainerAdjustmentRequest) -> None:
        raise KeyError("policy")

    with trio.fail_after(LIMIT):
        await attach(nursery, runtime, validator)
        await runtime.run_pod(pod())
        with pytest.raises(NriError, match=r"validator plugin 91-strict failed: .*validate failed: 'policy'"):
            await runtime.create_container(container())
    assert len(runtime.plugins) == 1  # an error, not a fatal one: still connected


def plugin_service_v0_12_2() -> dict[str, tuple[str, str]]:
    """NRI v0.12.2's Plugin service: method -> (input, output) message names."""
    source = REFERENCE
    if not source.exists():
        pytest.skip(f"{source} is not here: set KRPROXY_REFERENCE_DIR to the directory of NRI's schemas")
    (file,) = json.loads(source.read_text())["file"]
    (service,) = [s for s in file["service"] if s["name"] == "Plugin"]
    return {
        m["name"]: (m["inputType"].rsplit(".", 1)[1], m["outputType"].rsplit(".", 1)[1])
        for m in service["method"]
    }


async def test_fake_and_stub_match_schema(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """Each call the fake makes in a whole lifecycle, and each method the stub serves, is v0.12.2's."""
    schema = plugin_service_v0_12_2()
    stub = NriStub("all", "10")
    stub.create_container(lambda p, c: None)
    stub.update_container(lambda p, c, r: None)
    stub.stop_container(lambda p, c: None)
    stub.update_pod_sandbox(lambda p, r, o: None)
    stub.validate_container_adjustment(lambda request: None)
    for event in NOTICES:
        stub.on(event)(lambda *args: None)
    with trio.fail_after(LIMIT):
        await attach(nursery, runtime, stub)
        await runtime.run_pod(api.PodSandbox(id="pod-resized"))
        await runtime.update_pod("pod-resized", resources=api.LinuxResources())
        await whole_lifecycle(runtime, pod(), container())
    called = {what for direction, what in runtime.log if direction == "call"}
    assert called - set(schema) == set()
    assert len(called) == 16  # Configure, Synchronize and the 14 events: every one was sent
    served = {method for _, method in stub._methods()}
    assert served - set(schema) == set()
    assert served == set(schema)  # every Plugin method is served
    for event, (method, request_type) in NOTICES.items():
        assert schema[method][0] == request_type.__name__, event


@pytest.mark.parametrize(
    ("settings", "fields"),
    [
        ({"nri_version": ""}, "args"),
        ({"nri_0_6": True}, "CDI_devices,linux.oom_score_adj,args"),
        ({}, None),
    ],
)
async def test_fields_runtime_cannot_apply(
    runtime: FakeNriRuntime,
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    settings: dict[str, object],
    fields: str | None,
) -> None:
    """Adjustment fields newer than the runtime's NRI are named in a warning (none on 0.12)."""
    for name, value in settings.items():
        setattr(runtime, name, value)
    stub = NriStub("newer", "10")

    @stub.create_container
    def adjust(pod_: api.PodSandbox, ctr: api.Container) -> api.ContainerAdjustment:
        return api.ContainerAdjustment(
            args=["sleep", "1"],
            CDI_devices=[api.CdiDevice(name="vendor.com/gpu=0")],
            linux=api.LinuxContainerAdjustment(oom_score_adj=api.OptionalInt(value=100)),
        )

    with caplog.at_level(logging.WARNING, "krproxy.hookserver.nri"), trio.fail_after(LIMIT):
        await attach(nursery, runtime, stub)
        await runtime.run_pod(pod())
        await runtime.create_container(container())
    said = [
        r.krproxy_fields["fields"] for r in caplog.records if r.getMessage() == "nri_stub_fields_not_applied"
    ]
    assert said == ([fields] if fields else [])


async def test_env_removal_is_said_not_applied(
    runtime: FakeNriRuntime, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """An env var's removal reaches no runtime (only what a plugin before set is removed): it is named in a
    warning with why, as the fields the runtime drops are, and the runtime keeps its own variable."""
    stub = NriStub("remover", "10")

    @stub.create_container
    def remove(pod_: api.PodSandbox, ctr: api.Container) -> api.ContainerAdjustment:
        return api.ContainerAdjustment(env=[api.KeyValue(key="-MODE")])

    with caplog.at_level(logging.WARNING, "krproxy.hookserver.nri"), trio.fail_after(LIMIT):
        await attach(nursery, runtime, stub)
        await runtime.run_pod(pod())
        created = await runtime.create_container(container())
    assert "MODE=a" in created.env
    [said] = [r.krproxy_fields for r in caplog.records if r.getMessage() == "nri_stub_fields_not_applied"]
    assert "env[MODE] removed" == said["fields"]
    assert "passes no env var's removal on to the runtime" in said["reason"]
