"""NRI sample "logger": logs every pod and container event it is sent, with the object's name."""

from __future__ import annotations

import logging

from krproxy.hookserver.nri import NOTICES, NriStub
from krproxy.proto.nri.pkg.api import v1alpha1 as api

LOGGER = logging.getLogger("logger")
stub = NriStub.from_environment("logger", "00")
#: What was logged, for the tests: (event, pod name, container name or "").
seen: list[tuple[str, str, str]] = []


def _log(event: str, pod: api.PodSandbox, container: api.Container | None = None) -> None:
    name = container.name if container is not None else ""
    seen.append((event, pod.name, name))
    LOGGER.info("%s: pod %s/%s %s", event, pod.namespace, pod.name, name)


def _logger(event: api.Event):  # type: ignore[no-untyped-def]
    def handler(pod: api.PodSandbox, container: api.Container | None = None) -> None:
        _log(event.name, pod, container)

    return handler


for _event in NOTICES:
    stub.on(_event)(_logger(_event))


@stub.create_container
def create_container(pod: api.PodSandbox, container: api.Container) -> None:
    _log("CREATE_CONTAINER", pod, container)


if __name__ == "__main__":
    raise SystemExit(stub.main())  # until the runtime closes, or Ctrl-C / SIGTERM
