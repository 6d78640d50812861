"""Fields of a CRI newer than krproxy's protos survive an intercepted call that a hook server changes.

kubelet and containerd move to a new k8s.io/cri-api each Kubernetes release; krproxy's protos follow
the schema in shared/reference (Kubernetes 1.36's). A field a newer kubelet adds anywhere in the
messages krproxy decodes, changes and re-encodes (RunPodSandbox, CreateContainer,
UpdateContainerResources, UpdatePodSandboxResources) must reach the runtime as kubelet sent it,
in the message it was in, even where a plugin changed a neighbour. Each request here carries a field
number beyond the schema (a varint and a length-delimited value) at every level krproxy rewrites,
and a plugin registered for every hook changes something at each point.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
from cri_api.v1 import api_pb2
from google.protobuf import message as pb_message
from google.protobuf import unknown_fields

from krproxy.fakes.plugin import Changes, FakePlugin
from krproxy.hooks.points import HookPoint
from krproxy.proto.runtime import v1alpha1 as hookapi
from krproxy.protowire import varint
from tests.integration.hooks_support import Node, container_config, make_node, pod_config

#: Field numbers no CRI message uses (the schema's highest is below 100); one per wire type.
NEWER_VARINT = 4001
NEWER_BYTES = 4002


def newer_fields(where: str) -> bytes:
    """Two fields of a newer schema, their values naming *where* they were put."""
    text = where.encode()
    number = varint(NEWER_VARINT << 3) + varint(len(text))  # wire type 0, the name's length as its value
    length_delimited = varint(NEWER_BYTES << 3 | 2) + varint(len(text)) + text
    return number + length_delimited


def with_newer(message: pb_message.Message, where: str) -> None:
    """Add :func:`newer_fields` to *message* in place, as unknown fields (what a parser of our schema sees)."""
    message.MergeFromString(newer_fields(where))


def newer_in(message: pb_message.Message) -> list[tuple[int, Any]]:
    """The unknown fields *message* holds (itself, not its sub-messages), as (number, value)."""
    return [(field.field_number, field.data) for field in unknown_fields.UnknownFieldSet(message)]


def expected(where: str) -> list[tuple[int, Any]]:
    return [(NEWER_VARINT, len(where)), (NEWER_BYTES, where.encode())]


def marked_pod_config() -> api_pb2.PodSandboxConfig:
    """pod_config() with newer fields in the config, its linux part, the linux part's security context and
    resources (1.36's pod resources), and the metadata."""
    config = pod_config()
    config.linux.resources.CopyFrom(
        api_pb2.LinuxContainerResources(cpu_shares=512, memory_limit_in_bytes=1 << 28)
    )
    for where, message in parts(config).items():
        with_newer(message, where)
    return config


def parts(config: api_pb2.PodSandboxConfig | api_pb2.ContainerConfig) -> dict[str, pb_message.Message]:
    """The messages of a pod's or a container's config that krproxy decodes and may re-encode."""
    return {
        "config": config,
        "config.metadata": config.metadata,
        "config.linux": config.linux,
        "config.linux.security_context": config.linux.security_context,
        "config.linux.resources": config.linux.resources,
    }


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    node = await make_node(nursery, sockdir, fake_containerd, cri_client)
    # every field a pod or container hook can change: labels, annotations, cgroup parent, resources, envs
    changes = Changes(
        labels={"added": "l"},
        annotations={"added": "a"},
        cgroup_parent="/moved",
        cpu_quota=50_000,
        envs={"ADDED": "1"},
    )
    plugin = FakePlugin(changes)
    plugin.answer(HookPoint.PRE_UPDATE_POD_SANDBOX_RESOURCES, quota_changed)
    await node.add_plugin("changer", plugin)
    await node.start_proxy()
    return node


def quota_changed(request: hookapi.PodSandboxHookRequest) -> hookapi.PodSandboxHookResponse:
    """A pod resize answer: the requested resources with the cpu quota changed."""
    resources = hookapi.LinuxContainerResources.FromString(bytes(request.resources))
    resources.cpu_quota = 50_000
    return hookapi.PodSandboxHookResponse(resources=resources)


class TestNewerFieldsSurviveAChange:
    async def test_run_pod_sandbox(self, node: Node) -> None:
        """RunPodSandbox: the plugin's label and cgroup parent are applied, and every newer field is where
        kubelet put it."""
        request = api_pb2.RunPodSandboxRequest(config=marked_pod_config(), runtime_handler="runc")
        with_newer(request, "request")
        await node.call("RunPodSandbox", request)

        [got] = node.received("RunPodSandbox")
        assert "l" == got.config.labels["added"]
        assert "/moved" == got.config.linux.cgroup_parent
        assert expected("request") == newer_in(got)
        for where, part in parts(got.config).items():
            assert expected(where) == newer_in(part), where

    async def test_create_container(self, node: Node) -> None:
        """CreateContainer: the plugin's env, annotation and cpu quota are applied (config.linux.resources is
        rebuilt from the merged values) and every newer field, in the container's config and in the
        sandbox config beside it, is where kubelet put it."""
        pod_id = await node.run_pod()
        config = container_config()
        for where, message in parts(config).items():
            with_newer(message, where)
        request = api_pb2.CreateContainerRequest(
            pod_sandbox_id=pod_id, config=config, sandbox_config=marked_pod_config()
        )
        with_newer(request, "request")
        await node.call("CreateContainer", request)

        [got] = node.received("CreateContainer")
        assert 50_000 == got.config.linux.resources.cpu_quota
        assert "1" == {env.key: env.value for env in got.config.envs}["ADDED"]
        assert "a" == got.config.annotations["added"]
        assert "/moved" == got.sandbox_config.linux.cgroup_parent
        assert expected("request") == newer_in(got)
        for where, part in parts(got.config).items():
            assert expected(where) == newer_in(part), where
        for where, part in parts(got.sandbox_config).items():
            assert expected(where) == newer_in(part), "sandbox_" + where

    async def test_update_container_resources(self, node: Node) -> None:
        """UpdateContainerResources: the plugin's cpu quota replaces kubelet's, and the newer fields of the
        request and of its linux resources are still there."""
        _, container_id = await node.pod_with_container()
        request = api_pb2.UpdateContainerResourcesRequest(
            container_id=container_id,
            linux=api_pb2.LinuxContainerResources(cpu_quota=10_000, cpu_period=100_000),
        )
        with_newer(request, "request")
        with_newer(request.linux, "linux")
        await node.call("UpdateContainerResources", request)

        [got] = node.received("UpdateContainerResources")
        assert 50_000 == got.linux.cpu_quota
        assert expected("request") == newer_in(got)
        assert expected("linux") == newer_in(got.linux)

    async def test_update_pod_sandbox_resources(self, node: Node) -> None:
        """UpdatePodSandboxResources (pod-level resize): the plugin's cpu quota replaces kubelet's, and the
        newer fields of the request, its resources and its overhead are still there."""
        pod_id = await node.run_pod()
        request = api_pb2.UpdatePodSandboxResourcesRequest(
            pod_sandbox_id=pod_id,
            overhead=api_pb2.LinuxContainerResources(cpu_shares=25),
            resources=api_pb2.LinuxContainerResources(cpu_quota=150_000, cpu_period=100_000),
        )
        for where, message in {
            "request": request,
            "overhead": request.overhead,
            "resources": request.resources,
        }.items():
            with_newer(message, where)
        await node.update_pod(request)

        [got] = node.received("UpdatePodSandboxResources")
        assert 50_000 == got.resources.cpu_quota
        assert expected("request") == newer_in(got)
        assert expected("overhead") == newer_in(got.overhead)
        assert expected("resources") == newer_in(got.resources)
