"""NRI sample "differ": what the plugins before it changed in a container, as a validator sees it.

NRI 0.12 shows validators the container as asked for and the final adjustment of all plugins: this
plugin logs (and keeps, for the tests) the fields each adjustment sets, and never refuses.
"""

from __future__ import annotations

import logging

from krproxy.hookserver.nri import NriStub
from krproxy.proto.nri.pkg.api import v1alpha1 as api

LOGGER = logging.getLogger("differ")
stub = NriStub.from_environment("differ", "99")
#: (container name, changes) per validated container.
diffs: list[tuple[str, list[str]]] = []


def changes(container: api.Container, adjust: api.ContainerAdjustment) -> list[str]:
    found = [f"annotations[{k}]" for k in adjust.annotations]
    before = {e.split("=", 1)[0]: e for e in container.env}
    for kv in adjust.env:
        key = kv.key.removeprefix("-")
        found.append(
            f"env[{key}] removed"
            if kv.key.startswith("-")
            else f"env[{key}]" + (" changed" if key in before else " added")
        )
    found += [f"mounts[{m.destination}]" for m in adjust.mounts]
    found += [f"rlimits[{r.type}]" for r in adjust.rlimits]
    if adjust.hooks is not None:
        found += [
            f"hooks.{stage}"
            for stage in (
                "prestart",
                "create_runtime",
                "create_container",
                "start_container",
                "poststart",
                "poststop",
            )
            if getattr(adjust.hooks, stage)
        ]
    if adjust.linux is not None:
        found += [f"devices[{d.path}]" for d in adjust.linux.devices]
    return found


@stub.validate_container_adjustment
def differ(request: api.ValidateContainerAdjustmentRequest) -> None:
    assert request.container is not None
    found = changes(request.container, request.adjust or api.ContainerAdjustment())
    diffs.append((request.container.name, found))
    LOGGER.info("container %s: %s", request.container.name, ", ".join(found) or "unchanged")


if __name__ == "__main__":
    raise SystemExit(stub.main())  # until the runtime closes, or Ctrl-C / SIGTERM
