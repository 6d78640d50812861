"""NRI sample "template": a handler for every kind of event, each saying what it got.

Run as ``python examples/nri/template.py`` on a node with NRI enabled (the runtime's socket:
/var/run/nri/nri.sock), or let the runtime start it as a pre-registered plugin.
"""

from __future__ import annotations

import logging

from krproxy.hookserver.nri import NriStub
from krproxy.proto.nri.pkg.api import v1alpha1 as api

LOGGER = logging.getLogger("template")
stub = NriStub.from_environment("template", "10")


@stub.synchronize
def synchronize(pods: list[api.PodSandbox], containers: list[api.Container]) -> None:
    LOGGER.info("synchronized: %d pods, %d containers", len(pods), len(containers))


@stub.create_container
def create_container(pod: api.PodSandbox, container: api.Container) -> api.ContainerAdjustment | None:
    LOGGER.info("CreateContainer %s/%s", pod.name, container.name)
    return None  # no change


@stub.update_container
def update_container(
    pod: api.PodSandbox, container: api.Container, resources: api.LinuxResources
) -> list[api.ContainerUpdate]:
    LOGGER.info("UpdateContainer %s/%s", pod.name, container.name)
    return []


@stub.stop_container
def stop_container(pod: api.PodSandbox, container: api.Container) -> None:
    LOGGER.info("StopContainer %s/%s", pod.name, container.name)


@stub.on(api.Event.RUN_POD_SANDBOX)
def run_pod_sandbox(pod: api.PodSandbox) -> None:
    LOGGER.info("RunPodSandbox %s/%s", pod.namespace, pod.name)


@stub.on(api.Event.REMOVE_CONTAINER)
def remove_container(pod: api.PodSandbox, container: api.Container) -> None:
    LOGGER.info("RemoveContainer %s/%s", pod.name, container.name)


if __name__ == "__main__":
    raise SystemExit(stub.main())  # until the runtime closes, or Ctrl-C / SIGTERM
