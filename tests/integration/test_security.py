"""Security checks of a real daemon: untrusted registration files are refused, invalid plugin answers
are failures under the plugin's policy.

The registration-file tests change owners with chown, so they need root (the test suite's normal
environment); as another user they are skipped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import trio
from cri_api.v1 import api_pb2

from krproxy.fakes.plugin import Changes, FakePlugin, registration_document
from krproxy.hooks.points import HookPoint
from krproxy.proto.runtime import v1alpha1 as hookapi
from tests.integration.hooks_support import (
    CGROUP_PARENT,
    REGISTRATION_LIMIT,
    Node,
    make_node,
    pod_config,
    refused,
    rejection,
)
from tests.integration.support import LIVENESS_LIMIT, wait_until
from tests.integration.test_docker_support import make_node as make_docker_node

CREATE = HookPoint.PRE_CREATE_CONTAINER
RUN_POD = HookPoint.PRE_RUN_POD_SANDBOX
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")


#: Ways to make a registration file one that someone other than root could have written.
UNTRUSTED = pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda path: os.chown(path, 1000, 1000), "owned by uid 1000, not root"),
        (lambda path: (os.chown(path, 0, 1000), os.chmod(path, 0o664)), "writable by group 1000 (mode 0664)"),
        (lambda path: os.chmod(path, 0o646), "world-writable (mode 0646)"),
    ],
    ids=["not-root", "group-writable", "world-writable"],
)


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


def registration(node: Node, name: str = "p") -> bytes:
    return json.dumps(registration_document(node.plugin_socket(name), [CREATE])).encode()


def error_count(node: Node, file: str) -> float:
    value = node.proxy.metrics.registry.get_sample_value("krproxy_registration_errors_total", {"file": file})
    return value or 0.0


async def wait_error(node: Node, file: str) -> str:
    registry = node.proxy.hooks.dispatcher
    await wait_until(lambda: registry.registry.error_for(file) is not None, REGISTRATION_LIMIT)
    error = registry.registry.error_for(file)
    assert error is not None
    return error


class TestRegistrationFiles:
    async def test_world_writable_file_is_refused_and_counted(self, node: Node) -> None:
        """Mode 0666: not registered, reported with the reason, counted; fixing the mode registers it."""
        await node.start_proxy()
        node.write_file("p.json", registration(node))
        await node.wait_registered("p.json")
        path = os.path.join(node.hook_dir, "p.json")

        os.chmod(path, 0o666)
        error = await wait_error(node, "p.json")
        kept = node.registered()
        os.chmod(path, 0o644)
        await wait_until(lambda: node.proxy.hooks.dispatcher.registry.error_for("p.json") is None)

        assert error.startswith("p.json: refused: world-writable (mode 0666)")
        assert ["p.json"] == kept  # the previous valid version stays in force
        assert 1.0 == error_count(node, "p.json")
        assert ["p.json"] == node.registered()

    async def test_new_world_writable_file_never_registers(self, node: Node) -> None:
        """A file that is world-writable from the start is never used."""
        await node.start_proxy()
        os.makedirs(node.hook_dir, exist_ok=True)
        path = os.path.join(node.hook_dir, "p.json")
        with open(path, "wb") as f:  # noqa: ASYNC230 - a small local file
            f.write(registration(node))
        os.chmod(path, 0o646)

        error = await wait_error(node, "p.json")

        assert ([], "world-writable (mode 0646)") == (node.registered(), error.split("refused: ")[1][:26])

    @as_root
    @UNTRUSTED
    async def test_file_others_could_write_is_refused(
        self, node: Node, change: Callable[[str], object], reason: str
    ) -> None:
        """A file owned by another user, or writable by a group other than root's, is refused,
        naming why, and counted."""
        node.write_file("p.json", registration(node))
        change(os.path.join(node.hook_dir, "p.json"))
        await node.start_proxy()

        error = await wait_error(node, "p.json")

        assert ([], True) == (node.registered(), f"refused: {reason}" in error)
        assert 1.0 == error_count(node, "p.json")

    @as_root
    async def test_insecure_flag_relaxes_the_check(self, node: Node) -> None:
        """With insecure_registration_files, files of any owner and mode are used."""
        node.write_file("p.json", registration(node))
        path = os.path.join(node.hook_dir, "p.json")
        os.chown(path, 1000, 1000)
        os.chmod(path, 0o666)

        await node.start_proxy(insecure_registration_files=True)

        assert ["p.json"] == node.registered()

    @as_root
    @UNTRUSTED
    @pytest.mark.parametrize("insecure", [False, True])
    async def test_docker_mode_judges_files_as_cri_mode_does(
        self,
        nursery: trio.Nursery,
        sockdir: str,
        change: Callable[[str], object],
        reason: str,
        insecure: bool,
    ) -> None:
        """Docker mode refuses a registration file not owned by root, world-writable or writable by
        a group other than root's, naming why and counting it, unless --insecure-registration-files
        is given; then it uses it. (It ignored the flag and refused such files whatever it said.)"""
        docker = await make_docker_node(nursery, sockdir)
        await docker.add_plugin("p")
        change(os.path.join(docker.hook_dir, "p.json"))

        daemon = await docker.start_proxy(insecure_registration_files=insecure)

        registry = daemon.dispatcher.registry
        errors = daemon.metrics.registry.get_sample_value(
            "krproxy_registration_errors_total", {"file": "p.json"}
        )
        if insecure:
            assert (["p.json"], None, None) == (
                [p.file for p in registry.ordered()],
                registry.error_for("p.json"),
                errors,
            )
        else:
            assert ([], 1.0) == ([p.file for p in registry.ordered()], errors)
            assert f"refused: {reason}" in (registry.error_for("p.json") or "")

    async def test_symlink_is_judged_by_its_target(self, node: Node, sockdir: str) -> None:
        """A symlink (root-owned, as every symlink may be) to a world-writable file is refused;
        to a safe file, accepted."""
        unsafe, safe = os.path.join(sockdir, "unsafe.json"), os.path.join(sockdir, "safe.json")
        for target, mode in ((unsafe, 0o666), (safe, 0o644)):
            with open(target, "wb") as f:  # noqa: ASYNC230 - a small local file
                f.write(registration(node))
            os.chmod(target, mode)
        os.makedirs(node.hook_dir, exist_ok=True)
        os.symlink(unsafe, os.path.join(node.hook_dir, "a.json"))
        os.symlink(safe, os.path.join(node.hook_dir, "b.json"))

        await node.start_proxy()

        assert ["b.json"] == node.registered()
        assert "world-writable" in (node.proxy.hooks.dispatcher.registry.error_for("a.json") or "")

    async def test_fifo_does_not_stall_the_daemon(self, node: Node) -> None:
        """A FIFO named like a registration file is refused without blocking the watcher."""
        os.makedirs(node.hook_dir, exist_ok=True)
        os.mkfifo(os.path.join(node.hook_dir, "pipe.json"))
        node.write_file("p.json", registration(node))

        with trio.fail_after(LIVENESS_LIMIT):
            await node.start_proxy()

        error = node.proxy.hooks.dispatcher.registry.error_for("pipe.json") or ""
        assert (["p.json"], True) == (node.registered(), "not a regular file" in error)


def invalid_count(node: Node, plugin: str, hook: HookPoint) -> float:
    labels = {"plugin": plugin, "hook": hook.value}
    return node.proxy.metrics.registry.get_sample_value("krproxy_hook_answers_invalid_total", labels) or 0.0


class TestInvalidAnswers:
    async def test_fail_plugin_with_absurd_resources_rejects_the_call(self, node: Node) -> None:
        """Fail: an answer with cpu_shares=1 rejects CreateContainer naming plugin, hook and violation."""
        await node.add_plugin("bad", FakePlugin(Changes(cpu_shares=1)), [CREATE], failure_policy="Fail")
        await node.start_proxy()
        pod_id = await node.run_pod()

        details = await refused(node, "CreateContainer", node.create_request(pod_id), grpc.StatusCode.UNKNOWN)

        assert (
            "hook server err: hook server bad failed PreCreateContainer: invalid answer: "
            "container_resources.cpu_shares=1 is not 0 or 2..262144"
        ) == details
        assert 1.0 == invalid_count(node, "bad", CREATE)
        labels = {"plugin": "bad", "hook": CREATE.value, "result": "rejected"}
        assert 1.0 == node.proxy.metrics.registry.get_sample_value("krproxy_hook_calls_total", labels)

    async def test_ignore_plugin_answer_is_dropped(self, node: Node) -> None:
        """Ignore: the bad answer is dropped whole (its valid changes too), and the next plugin's applies."""
        bad = FakePlugin(Changes(memory_limit=-5, envs={"GOOD": "1", "BAD=NAME": "x"}))
        await node.add_plugin("10-bad", bad, [CREATE])
        await node.add_plugin("20-good", FakePlugin(Changes(cpu_shares=512)), [CREATE])
        await node.start_proxy()
        pod_id = await node.run_pod()

        await node.create_container(pod_id)

        [received] = node.received("CreateContainer")
        assert 512 == received.config.linux.resources.cpu_shares
        assert 1 << 30 == received.config.linux.resources.memory_limit_in_bytes
        assert {"PATH", "MODE"} == {kv.key for kv in received.config.envs}
        assert 1.0 == invalid_count(node, "10-bad", CREATE)

    async def test_pod_cgroup_parent_with_dotdot_rejects_run_pod(self, node: Node) -> None:
        """A PreRunPodSandbox answer climbing out with '..' rejects RunPodSandbox under Fail."""
        plugin = FakePlugin(Changes(cgroup_parent="/kubepods/../../system.slice"))
        await node.add_plugin("mover", plugin, [RUN_POD], failure_policy="Fail")
        await node.start_proxy()

        request = api_pb2.RunPodSandboxRequest(config=pod_config(), runtime_handler="runc")
        details = await refused(node, "RunPodSandbox", request, grpc.StatusCode.UNKNOWN)

        assert "hook server mover failed PreRunPodSandbox: invalid answer: cgroup_parent" in details
        assert "not a clean path" in details

    async def test_container_escaping_its_pod_cgroup_is_rejected(self, node: Node) -> None:
        """A container answer moving the container out of its pod's cgroup is a violation;
        a sub-cgroup of the pod is fine."""
        plugin = FakePlugin()
        plugin.answer(CREATE, hookapi.ContainerResourceHookResponse(pod_cgroup_parent="/kubepods"))
        await node.add_plugin("escape", plugin, [CREATE], failure_policy="Fail")
        await node.start_proxy()
        pod_id = await node.run_pod()

        error = await rejection(node, "CreateContainer", node.create_request(pod_id))
        plugin.answer(CREATE, hookapi.ContainerResourceHookResponse(pod_cgroup_parent=CGROUP_PARENT + "/sub"))
        await node.create_container(pod_id)

        assert f"pod_cgroup_parent '/kubepods': outside the pod's cgroup '{CGROUP_PARENT}'" in error.details()
        [received] = node.received("CreateContainer")
        assert CGROUP_PARENT + "/sub" == received.sandbox_config.linux.cgroup_parent

    async def test_post_hook_answers_are_not_validated(self, node: Node) -> None:
        """Post hooks' answers are never applied, so garbage values in them change nothing."""
        plugin = FakePlugin(Changes(cpu_shares=1))
        await node.add_plugin("p", plugin, [HookPoint.POST_START_CONTAINER], failure_policy="Fail")
        await node.start_proxy()
        _, container_id = await node.pod_with_container()

        await node.start(container_id)

        assert 0.0 == invalid_count(node, "p", HookPoint.POST_START_CONTAINER)
        assert 1 == len(node.fake.requests("StartContainer"))
