"""systemd slice names and the cgroup paths they stand for: one rule for every part of krproxy.

With the systemd cgroup driver a cgroup parent may be given as a slice *name* instead of a path.
systemd places slice ``a-b-c.slice`` inside ``a-b.slice``, inside ``a.slice``: each dash opens a
level (systemd.slice(5)). So ``kubepods-burstable-pod1.slice`` is the cgroup
``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice``, ``koordinator-x.slice``
is ``/koordinator.slice/koordinator-x.slice`` and ``x.slice`` is ``/x.slice`` — the same expansion
as koord-runtime-proxy's ``ToCriCgroupPath``. As in runc's ``ExpandSlice``, ``-.slice`` is systemd's
root slice, the cgroup ``/``, and a name with an empty component (``a--b.slice``) is no slice name.

Users: answer validation (is a container's cgroup below its pod's, :mod:`krproxy.hooks.validate`),
the SDK's cgroup files (:mod:`krproxy.hookserver._cgroups`) and Docker mode's ``CgroupParent``
(:mod:`krproxy.docker.convert`). Pure: no I/O.
"""

from __future__ import annotations

__all__ = ["ROOT", "SUFFIX", "is_slice_name", "slice_path"]

SUFFIX = ".slice"


#: systemd's root slice: the root cgroup itself.
ROOT = "-" + SUFFIX


def is_slice_name(value: str) -> bool:
    """Whether *value* is a slice name rather than a cgroup path (or nothing usable).

    As runc's ``ExpandSlice``: ``<name>.slice`` without ``/``, either the root slice ``-.slice`` or a
    name whose dash-separated components are all non-empty (``a--b.slice``, ``-a.slice``,
    ``a-.slice`` and ``.slice`` are not slice names: runc refuses them).
    """
    if not value.endswith(SUFFIX) or "/" in value:
        return False
    return value == ROOT or all(value.removesuffix(SUFFIX).split("-"))


def slice_path(name: str) -> str:
    """The absolute cgroup path of slice *name*: ``a-b-c.slice`` → ``/a.slice/a-b.slice/a-b-c.slice``,
    ``-.slice`` → ``/``.

    A name without the ``.slice`` suffix is read as if it had one; one that is no slice name
    (:func:`is_slice_name`) is still expanded dash by dash, so the result is always a path.
    """
    if name == ROOT:
        return "/"
    parts = name.removesuffix(SUFFIX).split("-")
    return "".join("/" + "-".join(parts[: i + 1]) + SUFFIX for i in range(len(parts)))
