"""NRI sample "hook-injector": OCI hooks for every container, as the runtime's hook files would add.

Here one prestart and one poststop hook, from ``HOOK_PATH`` (default /usr/local/bin/nri-hook), skipped
for containers annotated ``hook-injector.krproxy.dev/skip: "true"`` in their pod.
"""

from __future__ import annotations

import os

from krproxy.hookserver.nri import NriStub
from krproxy.proto.nri.pkg.api import v1alpha1 as api

stub = NriStub.from_environment("hook-injector", "20")
HOOK = os.environ.get("HOOK_PATH", "/usr/local/bin/nri-hook")


@stub.create_container
def inject(pod: api.PodSandbox, container: api.Container) -> api.ContainerAdjustment | None:
    if pod.annotations.get("hook-injector.krproxy.dev/skip") == "true":
        return None
    return api.ContainerAdjustment(
        hooks=api.Hooks(
            prestart=[api.Hook(path=HOOK, args=[HOOK, "prestart", container.name])],
            poststop=[api.Hook(path=HOOK, args=[HOOK, "poststop", container.name])],
        )
    )


if __name__ == "__main__":
    raise SystemExit(stub.main())  # until the runtime closes, or Ctrl-C / SIGTERM
