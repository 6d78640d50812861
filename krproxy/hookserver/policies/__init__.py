"""Built-in policies. Each module has an ``install(app)`` and documents what it writes.

- :mod:`.groupidentity` — ``cpu.bvt_warp_ns`` (fallback ``cpu.idle``/``cpu.shares``) by QoS class
- :mod:`.cpuset` — container cpuset from ``scheduling.koordinator.sh/resource-status``
- :mod:`.cpusuppress` — BE CFS quota (or cpuset) from measured LS usage
- :mod:`.resctrl` — LLC / memory bandwidth via a resctrl group per QoS class
- :mod:`.envinject` — container env from the ``hookserver.krproxy.io/env`` pod annotation
"""

from __future__ import annotations

from .._app import HookServer
from .._executor import SYSFS_CPU_ONLINE
from . import cpuset, cpusuppress, envinject, groupidentity, resctrl


def install_all(
    app: HookServer,
    *,
    meter: cpusuppress.Meter | None = None,
    proc_stat: str = "/proc/stat",
    cpu_online: str = SYSFS_CPU_ONLINE,
) -> None:
    """Install every built-in policy on ``app``."""
    groupidentity.install(app)
    cpuset.install(app)
    cpusuppress.install(app, meter, proc_stat=proc_stat, cpu_online=cpu_online)
    resctrl.install(app)
    envinject.install(app)


__all__ = ["cpuset", "cpusuppress", "envinject", "groupidentity", "install_all", "resctrl"]
