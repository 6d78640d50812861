"""NRI sample "ulimit-adjuster": rlimits from ``ulimits.noderesource.dev/container.NAME`` (or the older
``ulimits.nri.containerd.io/...``), a YAML list of ``type`` (``RLIMIT_NOFILE`` or ``nofile``), ``soft``
and ``hard``. An unknown type or soft above hard fails the creation with a message saying which.
"""

from __future__ import annotations

import yaml

from krproxy.hookserver.nri import NriStub
from krproxy.proto.nri.pkg.api import v1alpha1 as api

stub = NriStub.from_environment("ulimit-adjuster", "30")
VALID = {
    "AS", "CORE", "CPU", "DATA", "FSIZE", "LOCKS", "MEMLOCK", "MSGQUEUE",
    "NICE", "NOFILE", "NPROC", "RSS", "RTPRIO", "RTTIME", "SIGPENDING", "STACK",
}  # fmt: skip


@stub.create_container
def adjust(pod: api.PodSandbox, container: api.Container) -> api.ContainerAdjustment | None:
    value = None
    for prefix in ("ulimits.noderesource.dev", "ulimits.nri.containerd.io"):
        value = pod.annotations.get(f"{prefix}/container.{container.name}", value)
    if value is None:
        return None
    rlimits = []
    for entry in yaml.safe_load(value) or []:
        name = str(entry["type"]).upper().removeprefix("RLIMIT_")
        if name not in VALID:
            raise ValueError(
                f"unknown rlimit type {entry['type']!r}: use one of setrlimit(2)'s, e.g. RLIMIT_NOFILE"
            )
        soft, hard = int(entry["soft"]), int(entry["hard"])
        if soft > hard:
            raise ValueError(f"RLIMIT_{name}: soft {soft} is above hard {hard}")
        rlimits.append(api.PosixRlimit(type=f"RLIMIT_{name}", soft=soft, hard=hard))
    return api.ContainerAdjustment(rlimits=rlimits)


if __name__ == "__main__":
    raise SystemExit(stub.main())  # until the runtime closes, or Ctrl-C / SIGTERM
