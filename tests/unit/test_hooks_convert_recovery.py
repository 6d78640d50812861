"""Conversions between CRI messages and hook records for recovery (krproxy.hooks.convert): the
records rebuilt from what the runtime lists and reports of each sandbox and container."""

from __future__ import annotations

import json
from typing import Any

import attrs
import betterproto2
import pytest

from krproxy.hooks import wire
from krproxy.hooks.convert import (
    container_from_wire_list,
    container_from_wire_status,
    pod_from_wire_sandbox,
    pod_from_wire_status,
)
from krproxy.hooks.model import (
    Resources,
    resource_scalar,
)
from krproxy.hooks.writeback import resources_to_cri
from krproxy.proto.runtime import v1
from tests.unit.test_hooks_convert import CONTAINER, POD, RESOURCES, _with_id


def _wire(message: betterproto2.Message) -> Any:
    """``message`` as recovery reads it: its bytes decoded by the upb class of the same name."""
    return wire.message_class(type(message).__name__).FromString(bytes(message))


#: The fields a ListPodSandbox item and a PodSandboxStatus share, for :data:`POD` but its cgroup parent.
SANDBOX_FIELDS: dict[str, Any] = {
    "id": "sb1",
    "metadata": v1.PodSandboxMetadata(name="web", uid="u1", namespace="default", attempt=2),
    "labels": {"app": "web"},
    "annotations": {"a": "1"},
    "runtime_handler": "runc",
}


class TestRecovery:
    def test_pod_from_sandbox(self) -> None:
        """A ListPodSandbox item gives everything but the cgroup parent."""
        sandbox = v1.PodSandbox(**SANDBOX_FIELDS)

        assert attrs.evolve(POD, cgroup_parent="") == pod_from_wire_sandbox(_wire(sandbox))

    @pytest.mark.parametrize(
        ("info", "expected"),
        [
            (
                {"info": json.dumps({"config": {"linux": {"cgroup_parent": "/kubepods/podu1"}}})},
                "/kubepods/podu1",
            ),
            (
                {"info": json.dumps({"runtimeSpec": {"linux": {"cgroupsPath": "/kubepods/podu1/sb1"}}})},
                "/kubepods/podu1",
            ),
            (
                {
                    "info": json.dumps(
                        {"runtimeSpec": {"linux": {"cgroupsPath": "kubepods-podu1.slice:cri-containerd:sb1"}}}
                    )
                },
                "kubepods-podu1.slice",
            ),
            ({"info": json.dumps({"runtimeSpec": {"linux": {"cgroupsPath": "/elsewhere/x"}}})}, ""),
            ({"info": "not json"}, ""),
            ({"info": "[1]"}, ""),
            ({"info": json.dumps({"config": {"linux": {"cgroup_parent": 5}}})}, ""),
            ({}, ""),
            (None, ""),
        ],
    )
    def test_pod_from_status(self, info: dict[str, str] | None, expected: str) -> None:
        """The cgroup parent is recovered from verbose info where the runtime reports it, else empty."""
        status = v1.PodSandboxStatus(**SANDBOX_FIELDS)

        assert attrs.evolve(POD, cgroup_parent=expected) == pod_from_wire_status(_wire(status), info)

    def test_pod_resources_from_status(self) -> None:
        """containerd 2.3 reports the last pod-level resize (resources.linux, overhead.linux): recovered."""
        status = v1.PodSandboxStatus(
            id="sb1", metadata=v1.PodSandboxMetadata(name="web", uid="u1", namespace="default")
        )
        document = {
            "resources": {
                "linux": {"cpu_period": 100000, "cpu_quota": 123456, "memory_limit_in_bytes": 1024}
            },
            "overhead": {"linux": {"cpu_shares": 25}},
        }

        pod = pod_from_wire_status(_wire(status), {"info": json.dumps(document)})

        assert Resources(cpu_period=100000, cpu_quota=123456, memory_limit_in_bytes=1024) == pod.resources
        assert Resources(cpu_shares=25) == pod.overhead
        assert (None, None) == (
            pod_from_wire_status(_wire(status), {"info": "{}"}).resources,
            pod_from_wire_status(_wire(status), None).overhead,
        )

    def test_container_from_list(self) -> None:
        """A ListContainers item gives meta, id and annotations; resources unknown, envs empty."""
        item = v1.Container(
            id="c1",
            pod_sandbox_id="sb1",
            metadata=v1.ContainerMetadata(name="app", attempt=1),
            annotations={"c": "1"},
        )

        expected = attrs.evolve(_with_id(CONTAINER, "c1"), resources=None, envs={})
        assert expected == container_from_wire_list(_wire(item), POD)

    def _status(self, resources: v1.LinuxContainerResources | None) -> Any:
        return _wire(
            v1.ContainerStatus(
                id="c1",
                metadata=v1.ContainerMetadata(name="app", attempt=1),
                annotations={"c": "1"},
                resources=v1.ContainerResources(linux=resources) if resources is not None else None,
            )
        )

    def test_container_from_status_reported_resources(self) -> None:
        """Resources reported in ContainerStatus.resources.linux win over verbose info, except swap, which
        is taken from the requested config (absent there: 0)."""
        info = {"info": json.dumps({"config": {"linux": {"resources": {"cpu_shares": 7}}}})}

        actual = container_from_wire_status(self._status(resources_to_cri(RESOURCES)), "sb1", POD, info)

        assert attrs.evolve(RESOURCES, memory_swap_limit_in_bytes=0) == actual.resources

    def test_container_from_status_derived_swap_ignored(self) -> None:
        """containerd 1.6 reports swap = memory limit when none was requested; the requested value is kept."""
        reported = attrs.evolve(
            RESOURCES, memory_limit_in_bytes=64 << 20, memory_swap_limit_in_bytes=64 << 20
        )
        requested = {"memory_limit_in_bytes": 64 << 20, "memory_swap_limit_in_bytes": 0}
        info = {"info": json.dumps({"config": {"linux": {"resources": requested}}})}

        actual = container_from_wire_status(self._status(resources_to_cri(reported)), "sb1", POD, info)

        assert actual.resources is not None
        assert (64 << 20, 0) == (
            actual.resources.memory_limit_in_bytes,
            actual.resources.memory_swap_limit_in_bytes,
        )

    def test_container_from_status_verbose(self) -> None:
        """containerd 1.6: resources and envs come from the verbose creation config."""
        config = {
            "envs": [{"key": "A", "value": "1"}, {"key": "A", "value": "3"}, {"key": "B", "value": "2"}],
            "linux": {
                "resources": {
                    "cpu_period": 100000,
                    "cpu_quota": -1,
                    "cpu_shares": 1024,
                    "memory_limit_in_bytes": 1 << 30,
                    "oom_score_adj": -997,
                    "cpuset_cpus": "0-3",
                    "cpuset_mems": "0",
                    "hugepage_limits": [{"page_size": "2MB", "limit": 1 << 21}],
                    "unified": {"memory.high": "max"},
                    "memory_swap_limit_in_bytes": 2 << 30,
                }
            },
        }

        actual = container_from_wire_status(
            self._status(None), "sb1", POD, {"info": json.dumps({"config": config})}
        )

        assert _with_id(CONTAINER, "c1") == actual

    @pytest.mark.parametrize(
        ("name", "value", "expected"),
        [
            ("cpu_quota", -1, -1),
            ("cpu_shares", None, 0),
            ("cpu_shares", "1024", 0),
            ("cpu_shares", True, 0),
            ("memory_limit_in_bytes", 1.5, 0),
            ("cpuset_cpus", "0-3", "0-3"),
            ("cpuset_cpus", 3, ""),
            ("cpuset_mems", None, ""),
        ],
    )
    def test_a_json_scalar_of_another_type_reads_as_zero(self, name: str, value: Any, expected: Any) -> None:
        """A JSON value becomes the field's type or its zero (a bool is not an int here, as in Go)."""
        assert expected == resource_scalar(name, value)
        document = {"linux": {"resources": {name: value}}}
        recovered = container_from_wire_status(
            self._status(None), "sb1", POD, {"info": json.dumps({"config": document})}
        )
        assert recovered.resources is not None
        assert expected == getattr(recovered.resources, name)

    def test_container_from_status_nothing_reported(self) -> None:
        """Without reported resources or verbose info, resources are unknown and envs empty."""
        actual = container_from_wire_status(self._status(None), "sb1", POD)

        assert (None, {}) == (actual.resources, dict(actual.envs))
