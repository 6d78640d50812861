"""systemd slice names and the cgroup paths they stand for: one rule for every part of krproxy.

With the systemd cgroup driver a cgroup parent may be given as a slice *name* instead of a path.
systemd places slice ``a-b-c.slice`` inside ``a-b.slice``, inside ``a.slice``: each dash opens a
level (systemd.slice(5)). So ``kubepods-burstable-pod1.slice`` is the cgroup
``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice``, ``koordinator-x.slice``
is ``/koordinator.slice/koordinator-x.slice`` and ``x.slice`` is ``/x.slice`` — the same expansion
as koord-runtime-proxy's ``ToCriCgroupPath``.

Users: answer validation (is a container's cgroup below its pod's, :mod:`krproxy.hooks.validate`),
the SDK's cgroup files (:mod:`krproxy.hookserver._cgroups`) and Docker mode's ``CgroupParent``
(:mod:`krproxy.docker.convert`). Pure: no I/O.
"""

from __future__ import annotations

__all__ = ["is_slice_name", "slice_path"]

SUFFIX = ".slice"


def is_slice_name(value: str) -> bool:
    """Whether *value* is a slice name (``<name>.slice`` without ``/``) rather than a cgroup path."""
    return value.endswith(SUFFIX) and "/" not in value


def slice_path(name: str) -> str:
    """The absolute cgroup path of slice *name*: ``a-b-c.slice`` → ``/a.slice/a-b.slice/a-b-c.slice``.

    A name without the ``.slice`` suffix is read as if it had one.
    """
    parts = name.removesuffix(SUFFIX).split("-")
    return "".join("/" + "-".join(parts[: i + 1]) + SUFFIX for i in range(len(parts)))
