"""Required hook servers in ``krproxy nri``, against the fake NRI runtime: CreateContainer (and
UpdateContainer) fail while a required server is missing, and succeed with its changes once it answers.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import trio

from krproxy import admin
from krproxy.fakes.nri import FakeNriRuntime, NriError
from krproxy.fakes.plugin import Changes, FakePlugin, Misbehaviour, run_fake_plugin, write_registration
from krproxy.hooks.points import HookPoint
from krproxy.hooks.required import Requirements, parse_required_server
from krproxy.nri import plugin as nri_plugin
from krproxy.nri.plugin import NriConfig, NriPlugin
from krproxy.proto.nri.pkg.api import v1alpha1 as api
from tests.integration.support import LIVENESS_LIMIT, wait_until

CREATE = HookPoint.PRE_CREATE_CONTAINER
KEY = "required-plugins.noderesource.dev"


def pod(annotations: dict[str, str] | None = None) -> api.PodSandbox:
    return api.PodSandbox(
        id="pod-web", name="web", uid="uid-web", namespace="prod", annotations=dict(annotations or {})
    )


def container(name: str = "app") -> api.Container:
    return api.Container(
        id=f"ctr-{name}",
        pod_sandbox_id="pod-web",
        name=name,
        linux=api.LinuxContainer(
            resources=api.LinuxResources(cpu=api.LinuxCpu(shares=api.OptionalUInt64(value=1024)))
        ),
    )


@pytest.fixture
async def runtime(nursery: trio.Nursery, short_tmp: object) -> FakeNriRuntime:
    runtime = FakeNriRuntime(os.path.join(str(short_tmp), "nri.sock"), request_timeout=10.0)
    await nursery.start(runtime.serve)
    return runtime


def hook_dir(runtime: FakeNriRuntime) -> str:
    return os.path.join(os.path.dirname(runtime.socket_path), "hooks")


async def start_krproxy(nursery: trio.Nursery, runtime: FakeNriRuntime, *flags: str) -> NriPlugin:
    os.makedirs(hook_dir(runtime), exist_ok=True)
    requirements = Requirements(tuple(parse_required_server(f) for f in flags), startup_grace=0.0)
    config = NriConfig(
        socket=runtime.socket_path,
        hook_dir=hook_dir(runtime),
        insecure_registration_files=True,
        requirements=requirements,
    )
    plugin: NriPlugin = await nursery.start(nri_plugin.serve, config)
    await runtime.wait_for_plugins(1)
    return plugin


async def add_server(
    nursery: trio.Nursery,
    runtime: FakeNriRuntime,
    name: str,
    plugin: FakePlugin,
    hooks: tuple[HookPoint, ...] = (CREATE,),
) -> None:
    endpoint = os.path.join(os.path.dirname(runtime.socket_path), f"{name}.sock")
    await nursery.start(run_fake_plugin, endpoint, plugin)
    write_registration(hook_dir(runtime), name, endpoint, list(hooks), timeout="10s")


async def test_create_container_fails_until_required_server_answers(
    nursery: trio.Nursery, runtime: FakeNriRuntime
) -> None:
    """Create container fails until the required server answers."""
    with trio.fail_after(LIVENESS_LIMIT):
        plugin = await start_krproxy(nursery, runtime, "limits")
        assert plugin.subscribed & (1 << (api.Event.CREATE_CONTAINER - 1))  # even with no hook server
        await runtime.run_pod(pod())

        with pytest.raises(NriError, match="required hook server limits is not registered"):
            await runtime.create_container(container())
        assert 1 == len(runtime.plugins)  # answered in time: NRI keeps krproxy

        await add_server(nursery, runtime, "limits", FakePlugin(Changes(cpu_shares=4096)))
        await wait_until(lambda: "limits.json" in plugin.dispatcher.registry.plugins)
        created = await runtime.create_container(container())

    assert created.linux is not None and created.linux.resources is not None
    assert created.linux.resources.cpu is not None
    assert 4096 == created.linux.resources.cpu.shares.value


async def test_container_annotation_names_a_hook_server(
    nursery: trio.Nursery, runtime: FakeNriRuntime
) -> None:
    with trio.fail_after(LIVENESS_LIMIT):
        await start_krproxy(nursery, runtime)
        await runtime.run_pod(
            pod({f"{KEY}/container.app": json.dumps(["gpu"]), f"{KEY}/container.db": '["krproxy"]'})
        )

        with pytest.raises(NriError, match="required hook server gpu is not registered"):
            await runtime.create_container(container("app"))
        await runtime.create_container(container("sidecar"))  # not annotated
        await runtime.create_container(container("db"))  # krproxy itself: present by definition


async def test_points_nri_cannot_hold_are_named_at_start(
    nursery: trio.Nursery, runtime: FakeNriRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="krproxy.nri")
    with trio.fail_after(LIVENESS_LIMIT):
        await start_krproxy(nursery, runtime, "net=PreRunPodSandbox", "limits")

    records = [r for r in caplog.records if r.getMessage() == "required_points_not_held"]
    fields = [r.krproxy_fields for r in records]  # type: ignore[attr-defined]
    assert [("net", "PreRunPodSandbox"), "limits"] == [
        (f["server"], f["points"]) if f["server"] == "net" else f["server"] for f in fields
    ]
    assert "PreCreateContainer" not in fields[1]["points"]
    assert [logging.WARNING, logging.INFO] == [r.levelno for r in records]


async def test_a_server_not_hooking_create_container_does_not_meet_it(
    nursery: trio.Nursery, runtime: FakeNriRuntime
) -> None:
    """Annotated for a container, registered and answering, but for PreRunPodSandbox only: it would not
    process the creation, so the container is refused (krproxy called no hook server at all before)."""
    with trio.fail_after(LIVENESS_LIMIT):
        plugin = await start_krproxy(nursery, runtime)
        await add_server(nursery, runtime, "gpu", FakePlugin(), (HookPoint.PRE_RUN_POD_SANDBOX,))
        await wait_until(lambda: "gpu.json" in plugin.dispatcher.registry.plugins)
        # A PreRunPodSandbox server adds RUN_POD_SANDBOX to krproxy's events: wait for the re-registration
        # (a CreateContainer meeting it goes on without krproxy, and nothing would be refused).
        await wait_until(
            lambda: bool(runtime.plugins) and runtime.plugins[0].subscribed(api.Event.RUN_POD_SANDBOX)
        )
        await runtime.run_pod(pod({f"{KEY}/container.app": json.dumps(["gpu"])}))

        with pytest.raises(NriError, match="required hook server gpu is registered, but not for this hook"):
            await runtime.create_container(container("app"))


async def test_update_pod_sandbox_fails_until_required_server_answers(
    nursery: trio.Nursery, runtime: FakeNriRuntime
) -> None:
    """NRI 0.12's UpdatePodSandbox (a pod-level resize): held while a server required there is missing,
    even with no hook server registered for it; once the server answers, the resize goes through it."""
    resize = HookPoint.PRE_UPDATE_POD_SANDBOX_RESOURCES
    resources = api.LinuxResources(cpu=api.LinuxCpu(shares=api.OptionalUInt64(value=2048)))
    with trio.fail_after(LIVENESS_LIMIT):
        plugin = await start_krproxy(nursery, runtime, "quota=PreUpdatePodSandboxResources")
        assert plugin.subscribed & (1 << (api.Event.UPDATE_POD_SANDBOX - 1))
        await runtime.run_pod(pod())

        with pytest.raises(NriError, match="required hook server quota is not registered"):
            await runtime.update_pod("pod-web", resources)
        assert 1 == len(runtime.plugins)

        server = FakePlugin()
        await add_server(nursery, runtime, "quota", server, (resize,))
        await wait_until(lambda: "quota.json" in plugin.dispatcher.registry.plugins)
        await runtime.update_pod("pod-web", resources)

    assert [resize] == server.hooks_called()


async def test_update_pod_sandbox_is_not_subscribed_before_nri_0_12(
    nursery: trio.Nursery, short_tmp: object, caplog: pytest.LogCaptureFixture
) -> None:
    """A runtime before NRI 0.12 has no UpdatePodSandbox: nothing is subscribed for it (the runtime would
    refuse krproxy), and the log says the point is not held there."""
    caplog.set_level(logging.INFO, logger="krproxy.nri")
    old = FakeNriRuntime(os.path.join(str(short_tmp), "nri.sock"), request_timeout=10.0, nri_version="")
    await nursery.start(old.serve)
    with trio.fail_after(LIVENESS_LIMIT):
        plugin = await start_krproxy(nursery, old, "quota=PreUpdatePodSandboxResources")
        await wait_until(lambda: plugin.subscribed != 0)

    assert not plugin.subscribed & (1 << (api.Event.UPDATE_POD_SANDBOX - 1))
    said = [r.krproxy_fields for r in caplog.records if r.getMessage() == "required_points_not_held"]  # type: ignore[attr-defined]
    assert [("quota", "PreUpdatePodSandboxResources")] == [(f["server"], f["points"]) for f in said]


@pytest.mark.parametrize(
    ("required_plugins", "said", "level"),
    [("['50-krproxy']", "yes", logging.INFO), ("['other']", "no", logging.WARNING)],
)
async def test_says_whether_containerd_requires_it(
    nursery: trio.Nursery,
    runtime: FakeNriRuntime,
    caplog: pytest.LogCaptureFixture,
    required_plugins: str,
    said: str,
    level: int,
) -> None:
    """``--containerd-config``: at start the log and ``krproxy status`` say whether containerd's NRI
    validator requires krproxy's own registration."""
    caplog.set_level(logging.INFO, logger="krproxy.nri")
    config_file = os.path.join(os.path.dirname(runtime.socket_path), "config.toml")
    await trio.Path(config_file).write_text(
        "version = 3\n[plugins.'io.containerd.nri.v1.nri'.default_validator]\n"
        f"enable = true\nrequired_plugins = {required_plugins}\n"
    )
    os.makedirs(hook_dir(runtime), exist_ok=True)
    config = NriConfig(
        socket=runtime.socket_path,
        hook_dir=hook_dir(runtime),
        insecure_registration_files=True,
        containerd_config=config_file,
    )
    with trio.fail_after(LIVENESS_LIMIT):
        plugin: NriPlugin = await nursery.start(nri_plugin.serve, config)

    [record] = [r for r in caplog.records if r.getMessage() == "nri_runtime_validator"]
    assert said == record.krproxy_fields["required"]  # type: ignore[attr-defined]
    assert level == record.levelno
    status = nri_plugin.NriView(plugin, plugin.metrics).status()
    assert (said == "yes") is status["nri"]["runtime_requires_plugin"]
    report = admin.render_status(status)
    assert (
        f"containerd's validator: krproxy nri is {'required' if said == 'yes' else 'not required'}" in report
    )


async def test_a_required_server_wait_leaves_the_hook_what_is_left(
    nursery: trio.Nursery, short_tmp: object
) -> None:
    """A CreateContainer that waited (start-up grace) for its required server has only the rest of the
    runtime's request timeout for the hook call, not a new one: past it NRI drops the plugin. (The bound is
    the request's ttrpc deadline, which the chain's budget is also held to.)"""
    runtime = FakeNriRuntime(os.path.join(str(short_tmp), "nri.sock"), request_timeout=3.0)
    await nursery.start(runtime.serve)
    os.makedirs(hook_dir(runtime), exist_ok=True)
    config = NriConfig(
        socket=runtime.socket_path,
        hook_dir=hook_dir(runtime),
        insecure_registration_files=True,
        requirements=Requirements((parse_required_server("limits"),), startup_grace=LIVENESS_LIMIT),
    )
    with trio.fail_after(LIVENESS_LIMIT):
        await nursery.start(nri_plugin.serve, config)
        await runtime.wait_for_plugins(1)
        await runtime.run_pod(pod())
        slow = FakePlugin(Changes(cpu_shares=4096))
        slow.misbehave(Misbehaviour(delay=2.0))

        async def server_comes_up() -> None:
            await trio.sleep(1.5)  # the call waits for it, within the grace
            await add_server(nursery, runtime, "limits", slow)

        nursery.start_soon(server_comes_up)
        with pytest.raises(NriError, match="no answer within"):  # ran out of the time left: refused in time
            await runtime.create_container(container())
        assert 1 == len(runtime.plugins)  # answered within the request timeout: NRI keeps krproxy
