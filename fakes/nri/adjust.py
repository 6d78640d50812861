"""The fake NRI runtime's adjustment rules: a ``ContainerAdjustment`` applied to a container,
resources merged, and NRI's ownership of each field (two plugins setting one is an error naming
both), for :class:`krproxy.fakes.nri.runtime.FakeNriRuntime`."""

from __future__ import annotations

from typing import Any

from krproxy.proto.nri.pkg.api import v1alpha1 as api


class NriError(Exception):
    """A lifecycle operation failed because of a plugin (its error, or conflicting adjustments)."""


def claim(owners: dict[str, str], field: str, plugin: str) -> None:
    if not plugin:
        return
    owner = owners.get(field)
    if owner is not None and owner != plugin:
        raise NriError(f"plugins {owner!r} and {plugin!r} both tried to set {field}")
    owners[field] = plugin


def resources_of(container: api.Container) -> api.LinuxResources:
    if container.linux is None:
        container.linux = api.LinuxContainer()
    if container.linux.resources is None:
        container.linux.resources = api.LinuxResources()
    return container.linux.resources


def merge_resources(
    target: api.LinuxResources, change: api.LinuxResources, plugin: str, owners: dict[str, str]
) -> None:
    """Set every field ``change`` sets (Optional* present, strings non-empty, map keys) in ``target``."""
    for group in ("memory", "cpu"):
        source = getattr(change, group)
        if source is None:
            continue
        if getattr(target, group) is None:
            setattr(target, group, api.LinuxMemory() if group == "memory" else api.LinuxCpu())
        dest = getattr(target, group)
        for field in attrs_fields(source):
            value = getattr(source, field)
            if value is None or value == "":
                continue
            claim(owners, f"{group}.{field}", plugin)
            setattr(dest, field, value)
    for key, value in change.unified.items():
        claim(owners, f"unified[{key}]", plugin)
        target.unified[key] = value
    for limit in change.hugepage_limits:
        claim(owners, f"hugepage_limits[{limit.page_size}]", plugin)
        target.hugepage_limits = [h for h in target.hugepage_limits if h.page_size != limit.page_size] + [
            limit
        ]
    for field in ("blockio_class", "rdt_class", "pids"):
        if getattr(change, field) is not None:
            claim(owners, field, plugin)
            setattr(target, field, getattr(change, field))


def attrs_fields(message: Any) -> list[str]:
    """The field names of a betterproto2 message, in declaration order."""
    return [f.name for f in message.__dataclass_fields__.values()]


def created_env(asked: list[str], shown: list[str], owners: dict[str, str]) -> list[str]:
    """The env the runtime creates a container with: its own (``asked``), with what plugins set and still
    own (from ``shown``, the container as the last plugin left it) changed in place or appended.

    A removal (``-NAME``) takes out what a plugin before had set, and hides the variable from the plugins
    after; it never reaches the runtime: NRI's adaptation (``pkg/adaptation`` adjustEnv, 0.6.1 to 0.12)
    puts no removal into the adjustment it answers, so the runtime keeps its own variable (measured on
    containerd 1.7.24 and 2.1.9: tests/e2e/test_nri_stub_containerd.py).
    """
    set_by_plugins = {}
    for entry in shown:
        name = entry.split("=", 1)[0]
        if f"env[{name}]" in owners:
            set_by_plugins[name] = entry
    created = [set_by_plugins.pop(entry.split("=", 1)[0], entry) for entry in asked]
    return created + list(set_by_plugins.values())


def adjust(
    container: api.Container,
    adjust: api.ContainerAdjustment,
    plugin: str,
    owners: dict[str, str],
    *,
    nri_0_6: bool = False,
) -> None:
    for key, value in adjust.annotations.items():
        name, remove = (key[1:], True) if key.startswith("-") else (key, False)
        if remove:
            container.annotations.pop(name, None)
            owners.pop(f"annotations[{name}]", None)
            continue
        claim(owners, f"annotations[{name}]", plugin)
        container.annotations[name] = value
    for kv in adjust.env:
        name, remove = (kv.key[1:], True) if kv.key.startswith("-") else (kv.key, False)
        container.env = [e for e in container.env if e.split("=", 1)[0] != name]
        if remove:
            owners.pop(f"env[{name}]", None)
            continue
        claim(owners, f"env[{name}]", plugin)
        container.env.append(f"{name}={kv.value}")
    for mount in adjust.mounts:
        claim(owners, f"mounts[{mount.destination}]", plugin)
        container.mounts = [m for m in container.mounts if m.destination != mount.destination] + [mount]
    if adjust.hooks is not None:
        if container.hooks is None:
            container.hooks = api.Hooks()
        for stage in attrs_fields(adjust.hooks):
            getattr(container.hooks, stage).extend(getattr(adjust.hooks, stage))
    for rlimit in adjust.rlimits:
        claim(owners, f"rlimits[{rlimit.type}]", plugin)
        container.rlimits = [r for r in container.rlimits if r.type != rlimit.type] + [rlimit]
    linux = adjust.linux
    if linux is not None:
        assert container.linux is not None
        for device in linux.devices:  # keyed by path; "-path" removes, as NRI's adjustment does
            path, remove = (device.path[1:], True) if device.path.startswith("-") else (device.path, False)
            container.linux.devices = [d for d in container.linux.devices if d.path != path]
            if remove:
                owners.pop(f"devices[{path}]", None)
                continue
            claim(owners, f"devices[{path}]", plugin)
            container.linux.devices.append(device)
        if linux.resources is not None:
            merge_resources(resources_of(container), linux.resources, plugin, owners)
        if linux.cgroups_path:
            claim(owners, "cgroups_path", plugin)
            container.linux.cgroups_path = linux.cgroups_path
        if linux.oom_score_adj is not None and not nri_0_6:  # 0.6.1's schema has no such field: Go drops it
            claim(owners, "oom_score_adj", plugin)
            container.linux.oom_score_adj = linux.oom_score_adj
