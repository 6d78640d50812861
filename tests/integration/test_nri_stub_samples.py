"""The NRI sample plugins of examples/nri, each run against the fake NRI runtime speaking 0.12."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
from types import ModuleType

import pytest
import trio

from krproxy.fakes.nri import FakeNriRuntime, NriError
from krproxy.proto.nri.pkg.api import v1alpha1 as api
from tests.integration.nri_support import container, fake_runtime, pod
from tests.integration.support import LIVENESS_LIMIT

LIMIT = LIVENESS_LIMIT
SAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "nri"


def sample(name: str) -> ModuleType:
    """A fresh import of examples/nri/NAME.py (each test gets its own stub)."""
    spec = importlib.util.spec_from_file_location(f"nri_sample_{name}", SAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.pop(spec.name, None)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
async def runtime(nursery: trio.Nursery, short_tmp: object) -> FakeNriRuntime:
    return await fake_runtime(nursery, short_tmp, request_timeout=10.0)


async def attach(nursery: trio.Nursery, runtime: FakeNriRuntime, *modules: ModuleType) -> None:
    for module in modules:
        module.stub.socket = runtime.socket_path
        await nursery.start(module.stub.run)
        await runtime.wait_for_plugins(len(runtime.plugins) + 1)


def annotated(**annotations: str) -> api.PodSandbox:
    p = pod()
    p.annotations.update(annotations)
    return p


async def test_template_sees_each_event(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """The template answers every event it subscribes and changes nothing."""
    with trio.fail_after(LIMIT):
        await attach(nursery, runtime, sample("template"))
        await runtime.run_pod(pod())
        created = await runtime.create_container(container())
        await runtime.update_container("ctr-app", api.LinuxResources())
        await runtime.stop_container("ctr-app")
        await runtime.remove_container("ctr-app")
    assert created.env == ["PATH=/bin", "MODE=a"]
    calls = [what for direction, what in runtime.log if direction == "call"]
    for method in ("RunPodSandbox", "CreateContainer", "UpdateContainer", "StopContainer", "RemoveContainer"):
        assert method in calls


async def test_logger_logs_lifecycle(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """The logger is sent every event of a container's life and records each in order."""
    logger = sample("logger")
    with trio.fail_after(LIMIT):
        await attach(nursery, runtime, logger)
        await runtime.run_pod(pod())
        await runtime.create_container(container())
        await runtime.start_container("ctr-app")
        await runtime.remove_container("ctr-app")
        await runtime.stop_pod("pod-web")
        await runtime.remove_pod("pod-web")
    assert [event for event, _, _ in logger.seen] == [
        "RUN_POD_SANDBOX",
        "CREATE_CONTAINER",
        "POST_CREATE_CONTAINER",
        "START_CONTAINER",
        "POST_START_CONTAINER",
        "REMOVE_CONTAINER",
        "STOP_POD_SANDBOX",
        "REMOVE_POD_SANDBOX",
    ]


async def test_device_injector_adds_devices(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """Devices and mounts annotated for a container are injected into it, not into others."""
    devices = json.dumps([{"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229, "file_mode": 0o666}])
    mounts = json.dumps([{"source": "/srv/x", "destination": "/x", "options": ["rbind"]}])
    p = annotated(
        **{"devices.noderesource.dev/container.app": devices, "mounts.nri.io/container.app": mounts}
    )
    with trio.fail_after(LIMIT):
        await attach(nursery, runtime, sample("device_injector"))
        await runtime.run_pod(p)
        app = await runtime.create_container(container("app"))
        other = await runtime.create_container(container("other"))
    assert app.linux is not None and [(d.path, d.major, d.minor) for d in app.linux.devices] == [
        ("/dev/fuse", 10, 229)
    ]
    assert [(m.source, m.destination) for m in app.mounts] == [("/srv/x", "/x")]
    assert other.linux is not None and other.linux.devices == [] and other.mounts == []


async def test_hook_injector_adds_hooks(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """Every container gets the prestart and poststop hooks unless its pod says skip."""
    with trio.fail_after(LIMIT):
        await attach(nursery, runtime, sample("hook_injector"))
        await runtime.run_pod(pod())
        await runtime.run_pod(
            api.PodSandbox(id="pod-skip", name="skip", annotations={"hook-injector.krproxy.dev/skip": "true"})
        )
        hooked = await runtime.create_container(container())
        skipped = await runtime.create_container(container("s", pod_id="pod-skip"))
    assert hooked.hooks is not None
    assert [h.args for h in hooked.hooks.prestart] == [["/usr/local/bin/nri-hook", "prestart", "app"]]
    assert [h.args for h in hooked.hooks.poststop] == [["/usr/local/bin/nri-hook", "poststop", "app"]]
    assert skipped.hooks is None


async def test_ulimit_adjuster_sets_rlimits(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """Annotated ulimits become rlimits; a bad one fails that container's creation, saying why."""
    good = "- type: nofile\n  soft: 1024\n  hard: 4096\n"
    bad = "- type: RLIMIT_NOFILE\n  soft: 9\n  hard: 1\n"
    p = annotated(
        **{"ulimits.nri.containerd.io/container.app": good, "ulimits.noderesource.dev/container.bad": bad}
    )
    with trio.fail_after(LIMIT):
        await attach(nursery, runtime, sample("ulimit_adjuster"))
        await runtime.run_pod(p)
        app = await runtime.create_container(container())
        with pytest.raises(
            NriError, match="30-ulimit-adjuster: adjust failed: RLIMIT_NOFILE: soft 9 is above hard 1"
        ):
            await runtime.create_container(container("bad"))
    assert [(r.type, r.soft, r.hard) for r in app.rlimits] == [("RLIMIT_NOFILE", 1024, 4096)]


async def test_differ_and_validator(runtime: FakeNriRuntime, nursery: trio.Nursery) -> None:
    """The differ sees the other plugins' changes; the validator refuses hooks, naming its reason."""
    differ, validator = sample("differ"), sample("validator")
    ulimits = "- {type: RLIMIT_NOFILE, soft: 1, hard: 2}\n"
    with trio.fail_after(LIMIT):
        await attach(nursery, runtime, sample("ulimit_adjuster"), differ)
        await runtime.run_pod(annotated(**{"ulimits.noderesource.dev/container.app": ulimits}))
        await runtime.create_container(container())
        await attach(nursery, runtime, sample("hook_injector"), validator)
        with pytest.raises(NriError, match=r'validator "90-validator" rejected .* OCI hooks are not allowed'):
            await runtime.create_container(container("hooked"))
    assert differ.diffs[0] == ("app", ["rlimits[RLIMIT_NOFILE]"])
    assert differ.diffs[1] == ("hooked", ["hooks.prestart", "hooks.poststop"])


@pytest.mark.parametrize("fd", ["", "x"], ids=["absent-socket", "not-a-descriptor"])
def test_main_names_a_socket_it_cannot_use(
    short_tmp: pathlib.Path, fd: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``stub.main()`` (the samples' entry) on a socket path that is absent, or an NRI_PLUGIN_SOCKET that is
    no descriptor: one ``nri_stub_failed`` line naming it, exit 1, no traceback (it raised an
    exception group)."""
    module = sample("logger")
    module.stub.socket = str(short_tmp / "absent.sock")
    monkeypatch.setenv("NRI_PLUGIN_SOCKET", fd)
    assert 1 == module.stub.main(log_level=None)
    [failed] = [r.krproxy_fields for r in caplog.records if "nri_stub_failed" == r.getMessage()]
    assert (f"NRI_PLUGIN_SOCKET={fd}" if fd else module.stub.socket) == failed["socket"], failed
