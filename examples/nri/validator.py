"""NRI sample "validator": refuses adjustments a node's policy does not allow (NRI 0.12).

Refused: OCI hooks unless the pod is annotated ``validator.krproxy.dev/allow-hooks: "true"``, and
mounts of host paths outside ``ALLOWED_MOUNT_ROOTS``. The refusal's reason is what the creation fails with.
"""

from __future__ import annotations

from krproxy.hookserver.nri import NriStub
from krproxy.proto.nri.pkg.api import v1alpha1 as api

stub = NriStub.from_environment("validator", "90")
ALLOWED_MOUNT_ROOTS = ("/var/lib/shared/", "/srv/")


@stub.validate_container_adjustment
def validate(request: api.ValidateContainerAdjustmentRequest) -> str | None:
    adjust = request.adjust or api.ContainerAdjustment()
    pod = request.pod or api.PodSandbox()
    hooks = adjust.hooks
    if (
        hooks is not None
        and any(bytes(hooks))
        and pod.annotations.get("validator.krproxy.dev/allow-hooks") != "true"
    ):
        return 'OCI hooks are not allowed in this pod (annotate validator.krproxy.dev/allow-hooks: "true")'
    for mount in adjust.mounts:
        if mount.source.startswith("/") and not mount.source.startswith(ALLOWED_MOUNT_ROOTS):
            return f"mount of {mount.source} is outside {', '.join(ALLOWED_MOUNT_ROOTS)}"
    return None


if __name__ == "__main__":
    raise SystemExit(stub.main())  # until the runtime closes, or Ctrl-C / SIGTERM
