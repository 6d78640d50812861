"""NRI sample "device-injector": devices and mounts from the pod's annotations.

``devices.noderesource.dev/container.NAME`` (or the older ``devices.nri.io/...``): a YAML list of devices
(``path``, ``type``, ``major``, ``minor``, optional ``file_mode``, ``uid``, ``gid``) for container NAME;
``mounts.noderesource.dev/container.NAME`` (``mounts.nri.io/...``): a list of mounts (``source``,
``destination``, ``type``, ``options``).
"""

from __future__ import annotations

import yaml

from krproxy.hookserver.nri import NriStub
from krproxy.proto.nri.pkg.api import v1alpha1 as api

stub = NriStub.from_environment("device-injector", "10")


def annotated(pod: api.PodSandbox, kind: str, container: str) -> list[dict]:  # type: ignore[type-arg]
    for prefix in (f"{kind}.noderesource.dev", f"{kind}.nri.io"):
        value = pod.annotations.get(f"{prefix}/container.{container}")
        if value is not None:
            entries = yaml.safe_load(value) or []
            if not isinstance(entries, list):
                raise ValueError(f"{prefix}/container.{container} must be a YAML list, got {value!r}")
            return entries
    return []


@stub.create_container
def inject(pod: api.PodSandbox, container: api.Container) -> api.ContainerAdjustment | None:
    devices = [
        api.LinuxDevice(
            path=d["path"],
            type=d["type"],
            major=int(d["major"]),
            minor=int(d["minor"]),
            file_mode=api.OptionalFileMode(value=int(d["file_mode"])) if "file_mode" in d else None,
            uid=api.OptionalUInt32(value=int(d["uid"])) if "uid" in d else None,
            gid=api.OptionalUInt32(value=int(d["gid"])) if "gid" in d else None,
        )
        for d in annotated(pod, "devices", container.name)
    ]
    mounts = [
        api.Mount(
            source=m["source"],
            destination=m["destination"],
            type=m.get("type", "bind"),
            options=m.get("options", []),
        )
        for m in annotated(pod, "mounts", container.name)
    ]
    if not devices and not mounts:
        return None
    return api.ContainerAdjustment(mounts=mounts, linux=api.LinuxContainerAdjustment(devices=devices))


if __name__ == "__main__":
    raise SystemExit(stub.main())  # until the runtime closes, or Ctrl-C / SIGTERM
