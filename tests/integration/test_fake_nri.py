"""The fake NRI runtime is as strict as NRI's own adaptation: registration, split sync, ownership of fields."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import trio

from krproxy.fakes.nri import FakeNriRuntime, NriError
from krproxy.grpcstatus import Status
from krproxy.nri import PLUGIN_SERVICE, RUNTIME_SERVICE, _mux
from krproxy.nri._session import Session, TtrpcError
from krproxy.proto.nri.pkg.api import v1alpha1 as api
from tests.integration.nri_support import fake_runtime, whole_lifecycle
from tests.integration.support import LIVENESS_LIMIT, wait_until

LIMIT = LIVENESS_LIMIT


async def connect(
    nursery: trio.Nursery,
    runtime: FakeNriRuntime,
    handlers: dict[str, Callable[[bytes], Awaitable[bytes]]],
    *,
    name: str = "test",
    index: str = "10",
) -> Session:
    """A hand-made plugin: serves ``handlers`` (Configure/Synchronize defaulted) and registers."""

    async def configure(payload: bytes) -> bytes:
        return bytes(api.ConfigureResponse(events=0))

    async def synchronize(payload: bytes) -> bytes:
        return bytes(api.SynchronizeResponse(more=api.SynchronizeRequest.parse(payload).more))

    async def state_change(payload: bytes) -> bytes:
        return bytes(api.Empty())

    async def validate(payload: bytes) -> bytes:  # a mask of 0 makes a validator too, as in NRI 0.12
        return bytes(api.ValidateContainerAdjustmentResponse())

    table = {
        "Configure": configure,
        "Synchronize": synchronize,
        "StateChange": state_change,
        "ValidateContainerAdjustment": validate,
        **handlers,
    }
    stream = await trio.open_unix_socket(runtime.socket_path)
    session = Session(
        stream,
        _mux.PLUGIN_SERVICE_CONN,
        _mux.RUNTIME_SERVICE_CONN,
        {(PLUGIN_SERVICE, method): handler for method, handler in table.items()},
    )
    nursery.start_soon(session.run)
    await session.call(
        RUNTIME_SERVICE,
        "RegisterPlugin",
        bytes(api.RegisterPluginRequest(plugin_name=name, plugin_idx=index)),
    )
    return session


@pytest.fixture
async def runtime(nursery: trio.Nursery, short_tmp: object) -> FakeNriRuntime:
    # Generous: a plugin that registers must not be dropped because a loaded machine was slow.
    return await fake_runtime(nursery, short_tmp, registration_timeout=10.0)


@pytest.mark.parametrize(
    ("name", "index", "error"),
    [
        ("", "10", "invalid (empty) plugin name"),
        ("p", "7", 'invalid plugin index "7", must be 2 digits'),
        # Go counts bytes and takes 0-9 only: two Arabic-Indic digits are four bytes, not an index
        ("p", "\u0661\u0662", "must be 2 digits"),
        ("p", "\u00b2\u00b3", "must be 2 digits"),
    ],
)
async def test_registration_refused(
    runtime: FakeNriRuntime, nursery: trio.Nursery, name: str, index: str, error: str
) -> None:
    """A registration without a name or with an index that is not two digits is refused."""
    with trio.fail_after(LIMIT), pytest.raises(TtrpcError) as info:
        await connect(nursery, runtime, {}, name=name, index=index)
    assert Status.UNKNOWN == info.value.code and error in info.value.message
    assert [] == runtime.plugins


async def test_silent_plugin_times_out(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """A connection that never registers is given up after the registration timeout."""
    runtime.registration_timeout = 0.5  # short: it is meant to fire (nothing registers)
    with trio.fail_after(LIMIT):
        stream = await trio.open_unix_socket(runtime.socket_path)
        await wait_until(lambda: bool(runtime.dropped), LIMIT)
    assert [("?", "plugin registration timed out")] == runtime.dropped
    await stream.aclose()


async def test_split_sync_needs_more_echoed(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """A plugin that answers a part of a split Synchronize without ``more`` is dropped, as NRI 0.8 does."""
    runtime.sync_chunk = 1
    runtime.pods = {"a": api.PodSandbox(id="a"), "b": api.PodSandbox(id="b")}

    async def naive(payload: bytes) -> bytes:
        return bytes(api.SynchronizeResponse())

    with trio.fail_after(LIMIT):
        await connect(nursery, runtime, {"Synchronize": naive})
        await wait_until(lambda: bool(runtime.dropped), LIMIT)
    assert [("10-test", "NriError: plugin does not handle split sync requests")] == runtime.dropped


async def test_two_plugins_claiming_one_field(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """Two plugins setting the same field fails the creation, naming both (NRI's ownership rule)."""

    async def set_shares(payload: bytes) -> bytes:
        cpu = api.LinuxCpu(shares=api.OptionalUInt64(value=2))
        adjust = api.ContainerAdjustment(
            linux=api.LinuxContainerAdjustment(resources=api.LinuxResources(cpu=cpu))
        )
        return bytes(api.CreateContainerResponse(adjust=adjust))

    with trio.fail_after(LIMIT):
        await connect(nursery, runtime, {"CreateContainer": set_shares}, name="one", index="10")
        await connect(nursery, runtime, {"CreateContainer": set_shares}, name="two", index="20")
        await runtime.wait_for_plugins(2)
        await runtime.run_pod(api.PodSandbox(id="p"))
        with pytest.raises(NriError, match=r"plugins '10-one' and '20-two' both tried to set cpu\.shares"):
            await runtime.create_container(api.Container(id="c", pod_sandbox_id="p"))


async def test_env_removal_spares_runtime_env(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """``-NAME`` takes out what a plugin before set and hides the runtime's own variable from the plugins
    after, but the runtime keeps its own (NRI passes no env removal on; containerd 1.7 and 2.1 measured)."""
    shown: list[list[str]] = []

    def show(payload: bytes) -> None:
        asked = api.CreateContainerRequest.parse(payload).container
        assert asked is not None
        shown.append(list(asked.env))

    async def add(payload: bytes) -> bytes:
        env = [api.KeyValue(key="ADDED", value="1"), api.KeyValue(key="CHANGED", value="new")]
        return bytes(api.CreateContainerResponse(adjust=api.ContainerAdjustment(env=env)))

    async def remove(payload: bytes) -> bytes:
        show(payload)
        env = [api.KeyValue(key="-ADDED"), api.KeyValue(key="-OWN")]
        return bytes(api.CreateContainerResponse(adjust=api.ContainerAdjustment(env=env)))

    async def last(payload: bytes) -> bytes:
        show(payload)
        return bytes(api.CreateContainerResponse())

    with trio.fail_after(LIMIT):
        await connect(nursery, runtime, {"CreateContainer": add}, name="add", index="10")
        await connect(nursery, runtime, {"CreateContainer": remove}, name="remove", index="20")
        await connect(nursery, runtime, {"CreateContainer": last}, name="last", index="30")
        await runtime.wait_for_plugins(3)
        await runtime.run_pod(api.PodSandbox(id="p"))
        asked = api.Container(id="c", pod_sandbox_id="p", env=["OWN=1", "CHANGED=old", "PATH=/bin"])
        created = await runtime.create_container(asked)
    assert shown == [["OWN=1", "PATH=/bin", "ADDED=1", "CHANGED=new"], ["PATH=/bin", "CHANGED=new"]]
    assert created.env == ["OWN=1", "CHANGED=new", "PATH=/bin"]
    assert runtime.containers["c"].env == created.env


async def test_plugin_error_fails_the_operation(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """An error answered by a plugin fails the operation; the plugin stays registered."""

    async def refuse(payload: bytes) -> bytes:
        raise TtrpcError(Status.FAILED_PRECONDITION, "not on my node")

    with trio.fail_after(LIMIT):
        await connect(nursery, runtime, {"CreateContainer": refuse})
        await runtime.wait_for_plugins(1)
        await runtime.run_pod(api.PodSandbox(id="p"))
        with pytest.raises(NriError, match="plugin 10-test: FAILED_PRECONDITION: not on my node"):
            await runtime.create_container(api.Container(id="c", pod_sandbox_id="p"))
    assert 1 == len(runtime.plugins)


async def _lifecycle(runtime: FakeNriRuntime) -> None:
    """A pod with one container through every event."""
    await whole_lifecycle(runtime, api.PodSandbox(id="p"), api.Container(id="c", pod_sandbox_id="p"))


#: The events without an answer of their own, as the lifecycle above raises them.
EVENTS = [
    "RUN_POD_SANDBOX",
    "POST_CREATE_CONTAINER",
    "START_CONTAINER",
    "POST_START_CONTAINER",
    "POST_UPDATE_CONTAINER",
    "REMOVE_CONTAINER",
    "STOP_POD_SANDBOX",
    "REMOVE_POD_SANDBOX",
]
DEDICATED = [
    "RunPodSandbox",
    "PostCreateContainer",
    "StartContainer",
    "PostStartContainer",
    "PostUpdateContainer",
    "RemoveContainer",
    "StopPodSandbox",
    "RemovePodSandbox",
]


async def _empty(payload: bytes) -> bytes:
    return b""


#: The methods with answers of their own, answered with no change.
ANSWERING = {"CreateContainer": _empty, "UpdateContainer": _empty, "StopContainer": _empty}


def _recorder(seen: list[str], name: str) -> Callable[[bytes], Awaitable[bytes]]:
    async def handle(payload: bytes) -> bytes:
        seen.append(name)
        return b""

    return handle


class TestEventMethods:
    async def test_nri_0_12_calls_the_dedicated_methods(
        self, runtime: FakeNriRuntime, nursery: trio.Nursery
    ) -> None:
        """Playing NRI 0.12, each event goes to its own method; Configure says the version; no deprecation."""
        seen: list[str] = []
        configured: list[api.ConfigureRequest] = []

        async def configure(payload: bytes) -> bytes:
            configured.append(api.ConfigureRequest.parse(payload))
            return bytes(api.ConfigureResponse())

        handlers = {name: _recorder(seen, name) for name in DEDICATED}
        with trio.fail_after(LIMIT):
            await connect(nursery, runtime, {"Configure": configure, **ANSWERING, **handlers})
            await runtime.wait_for_plugins(1)
            await _lifecycle(runtime)
        assert "v0.12.2" == configured[0].NRI_version
        assert DEDICATED == seen
        assert [] == [what for _, what in runtime.log if what.startswith("StateChange")]
        assert [] == runtime.deprecations

    async def test_nri_0_12_falls_back_to_state_change_on_unimplemented(
        self, runtime: FakeNriRuntime, nursery: trio.Nursery
    ) -> None:
        """A plugin without the dedicated methods answers the first one Unimplemented: that event and all
        later ones go to StateChange (one failed call, not one per event) and a deprecation is recorded."""
        events: list[str] = []

        async def state_change(payload: bytes) -> bytes:
            events.append(api.StateChangeEvent.parse(payload).event.name)
            return b""

        with trio.fail_after(LIMIT):
            await connect(nursery, runtime, {"StateChange": state_change, **ANSWERING})
            await runtime.wait_for_plugins(1)
            await _lifecycle(runtime)
        assert EVENTS == events
        assert [("10-test", "does not implement RunPodSandbox")] == runtime.deprecations
        tried = [what for _, what in runtime.log if what in DEDICATED]
        assert ["RunPodSandbox"] == tried

    async def test_older_nri_calls_state_change_only(
        self, runtime: FakeNriRuntime, nursery: trio.Nursery
    ) -> None:
        """Playing NRI before 0.12 (containerd 1.7 to 2.2): StateChange for every such event, even for a
        plugin that has the dedicated methods; no version in Configure."""
        runtime.nri_version = ""
        seen: list[str] = []
        configured: list[api.ConfigureRequest] = []

        async def configure(payload: bytes) -> bytes:
            configured.append(api.ConfigureRequest.parse(payload))
            return bytes(api.ConfigureResponse())

        async def state_change(payload: bytes) -> bytes:
            seen.append(api.StateChangeEvent.parse(payload).event.name)
            return b""

        handlers = {name: _recorder(seen, name) for name in DEDICATED}
        with trio.fail_after(LIMIT):
            await connect(
                nursery,
                runtime,
                {"Configure": configure, "StateChange": state_change, **ANSWERING, **handlers},
            )
            await runtime.wait_for_plugins(1)
            await _lifecycle(runtime)
        assert "" == configured[0].NRI_version
        assert EVENTS == seen
        assert [] == runtime.deprecations

    @pytest.mark.parametrize(("version", "accepted"), [("v0.12.2", True), ("", False)])
    async def test_events_an_older_nri_lacks_are_refused(
        self, runtime: FakeNriRuntime, nursery: trio.Nursery, version: str, accepted: bool
    ) -> None:
        """UPDATE_POD_SANDBOX is an event of NRI 0.12: an older runtime refuses a plugin subscribing to it."""
        runtime.nri_version = version

        async def configure(payload: bytes) -> bytes:
            return bytes(api.ConfigureResponse(events=1 << (api.Event.UPDATE_POD_SANDBOX - 1)))

        with trio.fail_after(LIMIT):
            await connect(nursery, runtime, {"Configure": configure})
            await wait_until(lambda: bool(runtime.plugins or runtime.dropped), LIMIT)
        if accepted:
            assert 1 == len(runtime.plugins)
        else:
            assert [("10-test", "NriError: invalid plugin events: 0x800")] == runtime.dropped
