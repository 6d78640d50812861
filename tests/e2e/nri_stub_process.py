"""A Python NRI plugin written with the SDK's stub, run as its own process for the e2e tests.

    python -m tests.e2e.nri_stub_process '{"socket": "DIR/run/nri/nri.sock", "plugin": "adjuster", ...}'

``plugin`` is ``adjuster`` or ``remover`` (the plugins below) or ``sample:NAME``, one of NRI's sample
plugins as ported in ``examples/nri/NAME.py``, imported from its file and run as its ``__main__``
would, on ``socket``. For every container whose pod is annotated ``krproxy.e2e/nri-stub``, the
adjuster (index 40) adds a bind mount of ``mount_source``, a device, an rlimit, an OCI hook (``hook``,
run as ``HOOK prestart CONTAINER``) and two env vars, and the remover (index 50, after it) removes
the env vars named in ``remove_env``. Each appends one JSON line per container it is asked about to
``seen`` (the container's name and the env it was shown), before answering.

The log (stderr) is krproxy's JSON lines at INFO; the event ``nri_stub_ready`` is logged once the runtime has
synchronized the plugin, and the process exits 0 when the runtime closes the connection or on
SIGTERM.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import trio

from krproxy import log
from krproxy.hookserver.nri import NriStub
from krproxy.proto.nri.pkg.api import v1alpha1 as api

LOGGER = logging.getLogger("tests.e2e.nri_stub_process")
SAMPLES = Path(__file__).resolve().parents[2] / "examples" / "nri"
#: The pod annotation that asks the adjuster to change the pod's containers.
ANNOTATION = "krproxy.e2e/nri-stub"

#: What the adjuster adds: the env var that stays, the one the remover takes out, the device, the rlimit.
ENV = ("KRPROXY_NRI_STUB", "added")
DROPPED_ENV = ("KRPROXY_DROPPED", "by-remover")
DEVICE = {"path": "/dev/krproxy-null", "type": "c", "major": 1, "minor": 3}
RLIMIT = ("RLIMIT_NOFILE", 1111, 2222)
MOUNT_DESTINATION = "/mnt/krproxy-nri"


def adjuster(config: dict[str, Any]) -> NriStub:
    """The plugin making each kind of change the e2e test looks for in the OCI spec."""
    stub = NriStub("e2e-adjuster", "40", config["socket"])

    @stub.create_container
    def adjust(pod: api.PodSandbox, container: api.Container) -> api.ContainerAdjustment | None:
        record(config, container)
        if ANNOTATION not in pod.annotations:
            return None
        hook = config["hook"]
        return api.ContainerAdjustment(
            mounts=[
                api.Mount(
                    source=config["mount_source"],
                    destination=MOUNT_DESTINATION,
                    type="bind",
                    options=["rbind", "ro"],
                )
            ],
            env=[api.KeyValue(key=key, value=value) for key, value in (ENV, DROPPED_ENV)],
            hooks=api.Hooks(prestart=[api.Hook(path=hook, args=[hook, "prestart", container.name])]),
            rlimits=[api.PosixRlimit(type=RLIMIT[0], soft=RLIMIT[1], hard=RLIMIT[2])],
            linux=api.LinuxContainerAdjustment(
                devices=[
                    api.LinuxDevice(
                        path=DEVICE["path"],
                        type=DEVICE["type"],
                        major=DEVICE["major"],
                        minor=DEVICE["minor"],
                        file_mode=api.OptionalFileMode(value=0o666),
                    )
                ]
            ),
        )

    return stub


def remover(config: dict[str, Any]) -> NriStub:
    """The plugin after the adjuster, removing env vars (NRI's ``-NAME`` key)."""
    stub = NriStub("e2e-remover", "50", config["socket"])

    @stub.create_container
    def remove(pod: api.PodSandbox, container: api.Container) -> api.ContainerAdjustment | None:
        record(config, container)
        if ANNOTATION not in pod.annotations:
            return None
        return api.ContainerAdjustment(env=[api.KeyValue(key=f"-{name}") for name in config["remove_env"]])

    return stub


def record(config: dict[str, Any], container: api.Container) -> None:
    with Path(config["seen"]).open("a") as out:
        out.write(json.dumps({"container": container.name, "env": list(container.env)}) + "\n")


def sample(name: str, socket: str) -> NriStub:
    """``examples/nri/NAME.py``'s stub, pointed at ``socket``."""
    spec = importlib.util.spec_from_file_location(f"nri_sample_{name}", SAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stub: NriStub = module.stub
    stub.socket = socket
    return stub


async def serve(stub: NriStub) -> None:
    async with trio.open_nursery() as nursery:

        async def stop_on_sigterm() -> None:
            with trio.open_signal_receiver(signal.SIGTERM) as signals:
                async for _ in signals:
                    log.event(LOGGER, "nri_stub_sigterm", plugin=stub.full_name)
                    nursery.cancel_scope.cancel()

        async def run_stub(task_status: trio.TaskStatus[None]) -> None:
            await stub.run(task_status=task_status)
            nursery.cancel_scope.cancel()  # the runtime closed the connection

        nursery.start_soon(stop_on_sigterm)
        await nursery.start(run_stub)
        await stub.synchronized.wait()
        log.event(LOGGER, "nri_stub_ready", plugin=stub.full_name, runtime=stub.runtime)


def main(argv: list[str]) -> int:
    config = json.loads(argv[1])
    log.configure("info", "json")
    plugin = config["plugin"]
    own = {"adjuster": adjuster, "remover": remover}
    stub = own[plugin](config) if plugin in own else sample(plugin.removeprefix("sample:"), config["socket"])
    trio.run(serve, stub)
    log.event(LOGGER, "nri_stub_exit", plugin=stub.full_name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
