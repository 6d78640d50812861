"""Every call is reported to observers with what happened to it (the base of metrics and traces)."""

from __future__ import annotations

import os
from collections.abc import Callable

import attrs
import grpc
import pytest
import trio
from cri_api.v1 import api_pb2 as pb
from cri_api.v1 import api_pb2_grpc as pb_grpc

from krproxy.calls import CallRecord
from krproxy.daemon import Daemon
from krproxy.demo import DemoLimitsPlugin
from krproxy.fakes.containerd import FakeContainerd, Fault
from krproxy.fakes.plugin import write_registration
from krproxy.grpcstatus import Status
from krproxy.hooks.points import HookPoint
from tests.integration.support import ProxiedFake, create_in_new_pod, in_thread, wait_until


@attrs.frozen
class Recorded:
    """The proxy in front of the fake containerd with one PreCreateContainer plugin, its call records
    collected, and a CRI client through it."""

    daemon: Daemon
    records: list[CallRecord]
    fake: FakeContainerd
    runtime: pb_grpc.RuntimeServiceStub


@pytest.fixture
async def recorded(
    proxied_fake: ProxiedFake, nursery: trio.Nursery, sockdir: str, channel_to: Callable[[str], grpc.Channel]
) -> Recorded:
    daemon = proxied_fake.daemon
    plugin_socket = os.path.join(sockdir, "plugin.sock")
    await nursery.start(DemoLimitsPlugin().serve, plugin_socket)
    write_registration(daemon.config.hook_dir, "limits", plugin_socket, [HookPoint.PRE_CREATE_CONTAINER])
    await wait_until(lambda: bool(daemon.hooks.dispatcher.registry.plugins))  # picked up at its next poll
    records: list[CallRecord] = []
    daemon.relay.transport.observers.append(records.append)
    daemon.relay.transport.keep_messages = True  # what --record sets
    return Recorded(
        daemon, records, proxied_fake.fake, pb_grpc.RuntimeServiceStub(channel_to(daemon.config.listen))
    )


def _only(records: list[CallRecord], method: str) -> CallRecord:
    (record,) = [r for r in records if r.path.endswith("/" + method)]
    return record


class TestCallRecords:
    async def test_passthrough_call(self, recorded: Recorded) -> None:
        """A forwarded call is reported with its request, reply, status and timings, and no hooks."""
        records = recorded.records
        reply = await in_thread(recorded.runtime.Version, pb.VersionRequest(version="v1"), timeout=10)
        await wait_until(lambda: any(r.path.endswith("/Version") for r in records))
        record = _only(records, "Version")
        assert pb.VersionRequest(version="v1").SerializeToString() == record.request
        assert reply.SerializeToString() == record.reply
        assert "OK" == record.status.name
        assert None is record.forwarded
        assert () == record.hooks
        assert 0 < record.backend_seconds <= record.seconds

    async def test_hooked_call_reports_plugin_changes(self, recorded: Recorded) -> None:
        """A CreateContainer changed by a plugin is reported with the bytes actually forwarded and the
        plugin's changes, field by field."""
        records = recorded.records
        await create_in_new_pod(recorded.runtime)
        await wait_until(lambda: any(r.path.endswith("/CreateContainer") for r in records))
        record = _only(records, "CreateContainer")
        assert recorded.fake.requests("CreateContainer")[-1].raw == record.forwarded
        (outcome,) = record.hooks
        assert (HookPoint.PRE_CREATE_CONTAINER, "ok", "limits") == (
            outcome.point,
            outcome.result,
            outcome.plugin,
        )
        changed = {c.field: c.new for c in outcome.changes}
        assert 50_000 == changed["resources.cpu_quota"]
        assert "0-1" == changed["resources.cpuset_cpus"]

    async def test_backend_error_reported(self, recorded: Recorded) -> None:
        """A call the backend fails is reported with the backend's status and message, and counted in metrics."""
        records = recorded.records
        recorded.fake.inject("Version", Fault(status=Status.RESOURCE_EXHAUSTED, message="busy"))
        with pytest.raises(grpc.RpcError):
            await in_thread(recorded.runtime.Version, pb.VersionRequest(), timeout=10)
        await wait_until(lambda: any(r.path.endswith("/Version") for r in records))
        record = _only(records, "Version")
        assert ("RESOURCE_EXHAUSTED", "busy") == (record.status.name, record.message)
        samples = recorded.daemon.metrics.registry.get_sample_value(
            "krproxy_calls_total", {"method": "Version", "code": "RESOURCE_EXHAUSTED"}
        )
        assert 1.0 == samples

    async def test_answer_is_written_before_the_record(self, recorded: Recorded) -> None:
        """A forwarded call's record and metrics come after its answer is written to the caller:
        when the observers see the record, nothing the relay queued waits to be sent, so their
        work is not on the answer's path (latency, issue 24)."""
        relay = recorded.daemon.relay
        unsent: list[tuple[int, int]] = []

        def observe(record: CallRecord) -> None:
            if record.path.endswith("/Version"):
                unsent.append(
                    (len(relay.transport.dirty), sum(len(ep.out) for ep in relay.transport._clients))
                )

        relay.transport.observers.insert(0, observe)
        for _ in range(3):
            await in_thread(recorded.runtime.Version, pb.VersionRequest(version="v1"), timeout=10)
        await wait_until(lambda: len(unsent) == 3)
        assert [(0, 0)] * 3 == unsent
        assert 3 == sum(r.path.endswith("/Version") for r in recorded.records)
