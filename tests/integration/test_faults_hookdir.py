"""Churn in the hook directory under a running proxy: rapid rewrites, partial writes, symlinks, entries that
cannot be read, the directory deleted and recreated.

Files are written the careless way here (``open("w")`` in place, not write-and-rename), as an operator's
editor or a config-management tool may. In every case the proxy must not crash, must end in the state the
directory finally describes, and must keep serving.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
from typing import Any

import pytest
import trio

from krproxy.fakes.plugin import Changes, FakePlugin, registration_document, run_fake_plugin
from krproxy.hooks import watcher
from krproxy.hooks.points import HookPoint
from tests.integration.faults_support import Usage, assert_no_leak, version_ok
from tests.integration.hooks_support import REGISTRATION_LIMIT, Node, container_config, make_node
from tests.integration.support import LIVENESS_LIMIT, in_thread, wait_until

CREATE = HookPoint.PRE_CREATE_CONTAINER


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


async def serve_plugins(node: Node, quotas: dict[str, int]) -> dict[str, FakePlugin]:
    """Serve one plugin per name (not registered), each setting its own cpu_quota."""
    plugins = {}
    for name, quota in quotas.items():
        plugins[name] = await node.nursery.start(
            run_fake_plugin, node.plugin_socket(name), FakePlugin(Changes(cpu_quota=quota))
        )
    return plugins


def document(node: Node, plugin: str) -> bytes:
    return json.dumps(
        registration_document(node.plugin_socket(plugin), [CREATE], failure_policy="Fail")
    ).encode()


def write_in_place(path: str, content: bytes) -> None:
    """Overwrite a file in place (truncate, write), as a careless editor does."""
    with open(path, "wb") as f:
        f.write(content)


def endpoint_of(node: Node, file: str) -> str | None:
    plugin = node.proxy.hooks.dispatcher.registry.plugins.get(file)
    return None if plugin is None else plugin.endpoint


def error_of(node: Node, file: str) -> str | None:
    return node.proxy.hooks.dispatcher.registry.error_for(file)


async def create_quota(node: Node, pod_id: str, name: str) -> int:
    """Create a container through the proxy; the cpu_quota the runtime got (set by the plugin in force)."""
    await node.create_container(pod_id, container_config(name))
    return int(node.received("CreateContainer")[-1].config.linux.resources.cpu_quota)


async def still_serving(node: Node) -> bool:
    return bool(await in_thread(version_ok, node.proxy_socket))


async def registered_as_a(node: Node) -> tuple[str, str]:
    """Plugins "a" (cpu_quota 1) and "b" (2) served; p.json registers "a" before the proxy starts;
    a pod. The path of p.json and the pod's id."""
    await serve_plugins(node, {"a": 1, "b": 2})
    path = os.path.join(node.hook_dir, "p.json")
    os.makedirs(node.hook_dir)
    write_in_place(path, document(node, "a"))
    await node.start_proxy()
    return path, await node.run_pod()


class TestRewrites:
    async def test_rapid_rewrites_final_content_wins(self, node: Node) -> None:
        """80 in-place rewrites of one file within ~1 s (endpoints, half documents, garbage): the proxy
        ends with the last content, and the hooked call goes to the last plugin named."""
        await serve_plugins(node, {"a": 1, "b": 2, "c": 3})
        path = os.path.join(node.hook_dir, "p.json")
        os.makedirs(node.hook_dir)
        write_in_place(path, document(node, "a"))
        await node.start_proxy()
        pod_id = await node.run_pod()
        before = Usage.now()
        rng = random.Random(9)

        for _ in range(80):
            content = document(node, rng.choice("ab"))
            content = rng.choice([content, content[: rng.randrange(len(content))], b"\x00garbage"])
            write_in_place(path, content)
            await trio.sleep(rng.uniform(0, 0.025))
        write_in_place(path, document(node, "c"))

        await wait_until(lambda: endpoint_of(node, "p.json") == node.plugin_socket("c"), REGISTRATION_LIMIT)
        assert None is error_of(node, "p.json")
        assert 3 == await create_quota(node, pod_id, "after")
        assert await still_serving(node)
        await assert_no_leak(before)

    async def test_partial_write_then_rest(self, node: Node) -> None:
        """A file left half-written for two polls is reported invalid while the previous version stays in
        force; once the rest is written, the new version is."""
        path, pod_id = await registered_as_a(node)
        new = document(node, "b")

        with open(path, "wb") as f:  # noqa: ASYNC230 - held open, half-written, across awaits
            f.write(new[: len(new) // 2])
            f.flush()
            await wait_until(lambda: error_of(node, "p.json") is not None, REGISTRATION_LIMIT)
            assert node.plugin_socket("a") == endpoint_of(node, "p.json")
            assert 1 == await create_quota(node, pod_id, "half")
            f.write(new[len(new) // 2 :])

        await wait_until(lambda: endpoint_of(node, "p.json") == node.plugin_socket("b"), REGISTRATION_LIMIT)
        assert None is error_of(node, "p.json")
        assert 2 == await create_quota(node, pod_id, "whole")

    async def test_new_file_half_written_is_not_registered(self, node: Node) -> None:
        """A new file seen half-written registers nothing (and the other plugins keep working) until it is
        complete."""
        await serve_plugins(node, {"a": 1, "b": 2})
        await node.start_proxy()
        pod_id = await node.run_pod()
        os.makedirs(node.hook_dir, exist_ok=True)
        content = document(node, "b")

        with open(os.path.join(node.hook_dir, "new.json"), "wb") as f:  # noqa: ASYNC230 - as above
            f.write(content[:10])
            f.flush()
            await wait_until(lambda: error_of(node, "new.json") is not None, REGISTRATION_LIMIT)
            assert [] == node.registered()
            f.write(content[10:])

        await wait_until(lambda: ["new.json"] == node.registered(), REGISTRATION_LIMIT)
        assert 2 == await create_quota(node, pod_id, "c")


class TestSymlinks:
    async def test_symlinked_file_followed_through_changes(self, node: Node, sockdir: str) -> None:
        """A registration file that is a symlink (as from a ConfigMap mount) is read through the link;
        rewriting its target, re-pointing the link, and a link left dangling all take effect."""
        await serve_plugins(node, {"a": 1, "b": 2, "c": 3})
        elsewhere = os.path.join(sockdir, "elsewhere")
        os.makedirs(elsewhere)
        os.makedirs(node.hook_dir)
        first, second = os.path.join(elsewhere, "first.json"), os.path.join(elsewhere, "second.json")
        write_in_place(first, document(node, "a"))
        write_in_place(second, document(node, "c"))
        link = os.path.join(node.hook_dir, "p.json")
        os.symlink(first, link)
        await node.start_proxy()
        pod_id = await node.run_pod()
        assert 1 == await create_quota(node, pod_id, "one")

        write_in_place(first, document(node, "b"))
        await wait_until(lambda: endpoint_of(node, "p.json") == node.plugin_socket("b"), REGISTRATION_LIMIT)
        assert 2 == await create_quota(node, pod_id, "two")

        os.symlink(second, link + ".new")
        os.replace(link + ".new", link)  # ".json.new" is not a registration file name
        await wait_until(lambda: endpoint_of(node, "p.json") == node.plugin_socket("c"), REGISTRATION_LIMIT)
        assert 3 == await create_quota(node, pod_id, "three")

        os.unlink(second)
        await wait_until(lambda: [] == node.registered(), REGISTRATION_LIMIT)
        assert 0 < await create_quota(node, pod_id, "four") != 3  # kubelet's own value again
        assert await still_serving(node)


class TestUnreadable:
    async def test_entries_that_are_not_files(self, node: Node, sockdir: str) -> None:
        """A dangling symlink, a directory, a FIFO and a unix socket named ``*.json`` beside a good file:
        the good plugin works, nothing stalls or crashes the proxy (present at start-up and added later)."""
        await serve_plugins(node, {"good": 7})
        os.makedirs(node.hook_dir)
        write_in_place(os.path.join(node.hook_dir, "good.json"), document(node, "good"))

        def add_odd_entries(prefix: str) -> socket.socket:
            os.symlink(
                os.path.join(sockdir, "missing.json"), os.path.join(node.hook_dir, f"{prefix}-dangling.json")
            )
            os.mkdir(os.path.join(node.hook_dir, f"{prefix}-dir.json"))
            os.mkfifo(os.path.join(node.hook_dir, f"{prefix}-fifo.json"))
            sock = socket.socket(socket.AF_UNIX)
            sock.bind(os.path.join(node.hook_dir, f"{prefix}-sock.json"))
            return sock

        with add_odd_entries("early"):
            with trio.fail_after(LIVENESS_LIMIT):
                await node.start_proxy()
            pod_id = await node.run_pod()
            assert 7 == await create_quota(node, pod_id, "one")
            with add_odd_entries("late"):
                await trio.sleep(2 * watcher.POLL_INTERVAL + 0.1)  # the watcher has looked at them
                with trio.fail_after(LIVENESS_LIMIT):
                    assert 7 == await create_quota(node, pod_id, "two")

        assert ["good.json"] == node.registered()
        assert await still_serving(node)

    async def test_read_error_keeps_previous_version(
        self, node: Node, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A file that cannot be read (EACCES; the tests run as root, so reading is made to fail) is
        reported, and its last good version stays in force until it can be read again."""
        path, pod_id = await registered_as_a(node)
        real_read = watcher.read_file

        def read_file(target: str, **kwargs: Any) -> bytes | None:
            if target == path:
                raise PermissionError(13, "Permission denied")
            return real_read(target, **kwargs)

        monkeypatch.setattr(watcher, "read_file", read_file)
        write_in_place(path, document(node, "b"))
        await wait_until(lambda: error_of(node, "p.json") is not None, REGISTRATION_LIMIT)

        assert "p.json: cannot read: Permission denied" == error_of(node, "p.json")
        assert 1 == await create_quota(node, pod_id, "denied")
        monkeypatch.undo()
        os.utime(path)  # a change the watcher notices
        await wait_until(lambda: endpoint_of(node, "p.json") == node.plugin_socket("b"), REGISTRATION_LIMIT)
        assert 2 == await create_quota(node, pod_id, "readable")


class TestDirectoryReplaced:
    async def test_deleted_and_recreated(self, node: Node, sockdir: str) -> None:
        """The hook directory is deleted (its plugins are dropped), then a new one is moved into its place
        (as a ConfigMap update does): the new directory's plugins load."""
        await serve_plugins(node, {"a": 1, "b": 2})
        os.makedirs(node.hook_dir)
        write_in_place(os.path.join(node.hook_dir, "a.json"), document(node, "a"))
        await node.start_proxy()
        pod_id = await node.run_pod()
        assert 1 == await create_quota(node, pod_id, "one")

        shutil.rmtree(node.hook_dir)
        await wait_until(lambda: [] == node.registered(), REGISTRATION_LIMIT)
        staged = os.path.join(sockdir, "staged")
        os.makedirs(staged)
        write_in_place(os.path.join(staged, "b.json"), document(node, "b"))
        if await trio.Path(node.hook_dir).is_dir():  # the proxy recreates a missing directory itself
            os.rmdir(node.hook_dir)
        os.rename(staged, node.hook_dir)

        await wait_until(lambda: ["b.json"] == node.registered(), REGISTRATION_LIMIT)
        assert 2 == await create_quota(node, pod_id, "two")
        assert await still_serving(node)
