"""The fake NRI runtime is as strict as NRI's own adaptation: registration, split sync, ownership of fields."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable

import pytest
import trio

from fakes.nri import FakeNriRuntime, NriError
from krproxy.grpcstatus import Status
from krproxy.nri import PLUGIN_SERVICE, RUNTIME_SERVICE, _mux
from krproxy.nri._session import Session, TtrpcError
from krproxy.proto.nri.pkg.api import v1alpha1 as api
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

    table = {"Configure": configure, "Synchronize": synchronize, "StateChange": state_change, **handlers}
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
    fake = FakeNriRuntime(os.path.join(str(short_tmp), "nri.sock"), registration_timeout=10.0)
    await nursery.start(fake.serve)
    return fake


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
