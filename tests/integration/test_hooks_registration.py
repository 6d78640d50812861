"""Registration files change under a running proxy: add, modify, rename, delete, malformed versions.

The proxy polls its hook directory every 0.5 s: every change takes effect at the next poll (shown in virtual
time in tests/unit/test_hooks_watcher.py), with no restart and without disturbing the other plugins. Here
the waits are liveness bounds (:data:`REGISTRATION_LIMIT`): a loaded machine may take longer.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import trio

from krproxy.fakes.plugin import FakePlugin, registration_document
from krproxy.hooks.points import HookPoint
from krproxy.hooks.registration import FailurePolicy
from tests.integration.hooks_support import REGISTRATION_LIMIT, Node, make_node
from tests.integration.support import wait_until

CREATE = HookPoint.PRE_CREATE_CONTAINER


@pytest.fixture
async def node(nursery: trio.Nursery, sockdir: str, fake_containerd: Any, cri_client: Any) -> Node:
    return await make_node(nursery, sockdir, fake_containerd, cri_client)


def errors(node: Node, file: str) -> float:
    value = node.proxy.metrics.registry.get_sample_value("krproxy_registration_errors_total", {"file": file})
    return value or 0.0


class TestLiveChanges:
    async def test_add_takes_effect_without_restart(self, node: Node) -> None:
        """A file written while the proxy runs registers its plugin, with no restart."""
        await node.start_proxy()
        pod_id = await node.run_pod()
        plugin = FakePlugin()

        with trio.fail_after(REGISTRATION_LIMIT):
            await node.add_plugin("late", plugin, [CREATE])
        await node.create_container(pod_id)

        assert [CREATE] == plugin.hooks_called()

    async def test_modify_takes_effect(self, node: Node) -> None:
        """Rewriting a file changes the plugin's hooks and failure policy."""
        plugin = await node.add_plugin("p", hooks=[HookPoint.PRE_RUN_POD_SANDBOX])
        await node.start_proxy()
        pod_id = await node.run_pod()

        node.write_file(
            "p.json", registration_document(node.plugin_socket("p"), [CREATE], failure_policy="Fail")
        )
        await wait_until(lambda: node.proxy.hooks.dispatcher.plugins_for(CREATE) != (), REGISTRATION_LIMIT)
        await node.create_container(pod_id)

        [registration] = node.proxy.hooks.dispatcher.plugins_for(CREATE)
        assert FailurePolicy.FAIL == registration.failure_policy
        assert [HookPoint.PRE_RUN_POD_SANDBOX, CREATE] == plugin.hooks_called()

    async def test_delete_takes_effect(self, node: Node) -> None:
        """A removed file unregisters its plugin: no more calls, and its channel is closed."""
        plugin = await node.add_plugin("p")
        await node.start_proxy()

        os.unlink(os.path.join(node.hook_dir, "p.json"))
        await node.wait_registered("p.json", present=False)
        await node.pod_with_container()

        assert [] == plugin.calls

    async def test_rename_takes_effect(self, node: Node) -> None:
        """Renaming a file re-registers the plugin under its new name, which also sets its place in order."""
        log: list[str] = []
        first = FakePlugin(answers={CREATE: lambda r: log.append("first") or FakePlugin().changes.answer(r)})
        second = FakePlugin(
            answers={CREATE: lambda r: log.append("second") or FakePlugin().changes.answer(r)}
        )
        await node.add_plugin("a", first, [CREATE])
        await node.add_plugin("b", second, [CREATE])
        await node.start_proxy()
        pod_id = await node.run_pod()

        os.rename(os.path.join(node.hook_dir, "a.json"), os.path.join(node.hook_dir, "c.json"))
        await wait_until(lambda: ["b.json", "c.json"] == node.registered(), REGISTRATION_LIMIT)
        await node.create_container(pod_id)

        assert ["second", "first"] == log

    async def test_renaming_to_a_non_json_name_unregisters(self, node: Node) -> None:
        """Only ``*.json`` files count: renaming to ``.disabled`` turns the plugin off."""
        await node.add_plugin("p")
        await node.start_proxy()

        os.rename(os.path.join(node.hook_dir, "p.json"), os.path.join(node.hook_dir, "p.json.disabled"))

        await node.wait_registered("p.json", present=False)

    async def test_missing_hook_dir_is_created(self, node: Node) -> None:
        """The proxy starts without a hook directory, creates it, and picks up files written there later."""
        assert not await trio.Path(node.hook_dir).exists()
        await node.start_proxy()

        assert await trio.Path(node.hook_dir).is_dir()
        await node.add_plugin("p")


class TestMalformed:
    async def test_malformed_file_leaves_the_others_working(self, node: Node) -> None:
        """A file that is not valid JSON is counted in the metric and ignored; other plugins still run."""
        good = await node.add_plugin("good", hooks=[CREATE])
        node.write_file("broken.json", b'{"remote-endpoint": ')
        await node.start_proxy()

        await node.pod_with_container()

        assert [CREATE] == good.hooks_called()
        assert ["good.json"] == node.registered()
        assert 1.0 == errors(node, "broken.json")
        assert "broken.json" in node.proxy.hooks.dispatcher.registry.errors

    @pytest.mark.parametrize(
        "content",
        [
            # Every kind of problem is unit-tested in tests/unit/test_hooks_registration.py.
            b"not json",
            b'{"remote-endpoint": "/x.sock", "runtime-hooks": "PreCreateContainer"}',
        ],
        ids=["syntax", "wrong-type"],
    )
    async def test_malformed_version_keeps_the_previous_one(self, node: Node, content: bytes) -> None:
        """A bad new version of a registered file is counted, and the previous valid version stays in use
        until the file is fixed."""
        plugin = await node.add_plugin("p", hooks=[CREATE], failure_policy="Fail")
        await node.start_proxy()

        node.write_file("p.json", content)
        await wait_until(lambda: errors(node, "p.json") == 1.0, REGISTRATION_LIMIT)
        await node.pod_with_container()

        assert [CREATE] == plugin.hooks_called()
        [registration] = node.proxy.hooks.dispatcher.plugins_for(CREATE)
        assert FailurePolicy.FAIL == registration.failure_policy

        node.write_file(
            "p.json", registration_document(node.plugin_socket("p"), [HookPoint.PRE_RUN_POD_SANDBOX])
        )
        await wait_until(
            lambda: "p.json" not in node.proxy.hooks.dispatcher.registry.errors, REGISTRATION_LIMIT
        )
        assert () == node.proxy.hooks.dispatcher.plugins_for(CREATE)

    async def test_deleting_a_malformed_file_clears_its_error(self, node: Node) -> None:
        """Removing a broken file removes its recorded error (the counter keeps its history)."""
        node.write_file("broken.json", b"[]")
        await node.start_proxy()
        assert "broken.json" in node.proxy.hooks.dispatcher.registry.errors

        os.unlink(os.path.join(node.hook_dir, "broken.json"))

        await wait_until(lambda: not node.proxy.hooks.dispatcher.registry.errors, REGISTRATION_LIMIT)
        assert 1.0 == errors(node, "broken.json")
