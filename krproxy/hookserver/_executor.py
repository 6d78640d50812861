"""Writes cgroup and resctrl files under a root, and reports what it changed.

The only module of the SDK that writes files on the node. Every path is resolved (symlinks
and ``..``) and must stay inside its root, so a crafted cgroup parent cannot make the hook
server write elsewhere. Directories are never created in the cgroup tree (that would create
cgroups); resctrl group directories are created on demand, as the resctrl ABI expects.
A write that would not change the file is skipped.
"""

from __future__ import annotations

import errno
import logging
import os
import pathlib
from collections.abc import Callable, Iterable

import attrs

from krproxy import log

from ._cgroups import DEFAULT_CFS_PERIOD, CgroupFile, format_value, parse_cfs_period, parse_cpus

LOGGER = logging.getLogger("krproxy.hookserver.executor")

#: The kernel's list of online CPUs (``0-3,6``): CPUs that are offline (hot-unplugged, or
#: ``maxcpus=``) are missing from it.
SYSFS_CPU_ONLINE = "/sys/devices/system/cpu/online"


class PathOutsideRootError(PermissionError):
    """The path resolves to somewhere outside the executor's root."""


class CgroupWriteError(OSError):
    """The kernel refused a cgroup write; the message names the file, the value and the reason."""

    def __init__(self, path: pathlib.Path | str, value: str, cause: OSError, *, pod: str = "") -> None:
        self.path, self.value, self.cause, self.pod = str(path), value, cause, pod
        hint = ""
        if cause.errno == errno.EINVAL and str(path).endswith("cpu.cfs_quota_us"):
            hint = " (cgroup v1 refuses a quota above the parent's, or a parent's below a child's)"
        who = f"pod {pod}: " if pod else ""
        super().__init__(
            cause.errno, f"{who}cannot write {value!r} to {path}: {cause.strerror or cause}{hint}"
        )

    def for_pod(self, pod: str) -> CgroupWriteError:
        """The same error, naming ``pod``."""
        return CgroupWriteError(self.path, self.value, self.cause, pod=pod)


@attrs.frozen
class Change:
    """One file the executor changed: ``old`` is ``None`` when the file was created."""

    path: str
    old: str | None
    new: str


def _resolve(root: pathlib.Path, rel: str) -> pathlib.Path:
    base = pathlib.Path(os.path.realpath(root))
    target = pathlib.Path(os.path.realpath(base / rel.lstrip("/")))
    if target != base and base not in target.parents:
        raise PathOutsideRootError(f"{rel!r} resolves to {str(target)!r}, outside {str(base)!r}")
    return target


def _read(path: pathlib.Path) -> str | None:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return None


def _write(path: pathlib.Path, text: str, *, append: bool = False) -> None:
    with open(path, "a" if append else "w") as f:
        f.write(text)


def write_cgroup_file(path: pathlib.Path, text: str) -> None:
    """Write *text* to the cgroup file *path*, as :class:`Executor` does unless given another writer."""
    _write(path, text)


@attrs.define
class Executor:
    """Applies settings under ``cgroup_root`` (v1 or v2) and ``resctrl_root``.

    Attributes:
        cgroup_version: 1 (one hierarchy per controller) or 2 (unified).
        write_cgroup: the one writer of cgroup files (:func:`write_cgroup_file`); a test's may apply a
            kernel's rules first, or watch the writes.
    """

    cgroup_root: pathlib.Path = attrs.field(converter=pathlib.Path)
    resctrl_root: pathlib.Path = attrs.field(converter=pathlib.Path)
    cgroup_version: int = 2
    write_cgroup: Callable[[pathlib.Path, str], None] = attrs.field(
        default=write_cgroup_file, kw_only=True, repr=False
    )

    @classmethod
    def for_roots(cls, cgroup_root: str | os.PathLike[str], resctrl_root: str | os.PathLike[str]) -> Executor:
        """Detect the cgroup version: v2 has ``cgroup.controllers`` at the root."""
        version = 2 if (pathlib.Path(cgroup_root) / "cgroup.controllers").exists() else 1
        return cls(pathlib.Path(cgroup_root), pathlib.Path(resctrl_root), version)

    # -- cgroups ---------------------------------------------------------------------------

    def cgroup_path(self, cgroup_dir: str, file: CgroupFile) -> pathlib.Path:
        return _resolve(self.cgroup_root, file.path(cgroup_dir, self.cgroup_version))

    def cgroup_exists(self, cgroup_dir: str) -> bool:
        """Whether ``cgroup_dir`` exists (v1: in the ``cpu`` hierarchy)."""
        prefix = "cpu/" if self.cgroup_version == 1 else ""
        return _resolve(self.cgroup_root, prefix + cgroup_dir.strip("/")).is_dir()

    def has(self, cgroup_dir: str, file: CgroupFile) -> bool:
        """Whether the kernel offers ``file`` for ``cgroup_dir`` (the file exists)."""
        return self.cgroup_path(cgroup_dir, file).is_file()

    def read(self, cgroup_dir: str, file: CgroupFile) -> str | None:
        return _read(self.cgroup_path(cgroup_dir, file))

    def cfs_period(self, cgroup_dir: str) -> int:
        """The CFS period (µs) of ``cgroup_dir``: v1 ``cpu.cfs_period_us``, v2 the second field of
        ``cpu.max``; :data:`DEFAULT_CFS_PERIOD` only when the cgroup shows none (absent, unreadable)."""
        try:
            text = self.read(cgroup_dir, CgroupFile.CFS_PERIOD)
        except OSError:
            text = None
        period = parse_cfs_period(text, self.cgroup_version)
        return DEFAULT_CFS_PERIOD if period is None else period

    def set(self, cgroup_dir: str, file: CgroupFile, value: int | str) -> Change | None:
        """Write ``value`` (converted for the cgroup version) unless the file already holds it, or
        the value means "unset" (``cpu.shares`` 0, see :func:`format_value`).

        Raises:
            FileNotFoundError: the cgroup or the file does not exist (not created on purpose).
            CgroupWriteError: the kernel refused the value, or no cgroup file can hold it.
            PathOutsideRootError: ``cgroup_dir`` escapes the root.
        """
        path = self.cgroup_path(cgroup_dir, file)
        old = _read(path)
        if old is None:
            raise FileNotFoundError(f"no cgroup file {path}")
        try:
            new = format_value(file, value, self.cgroup_version, old)
        except ValueError as exc:
            raise CgroupWriteError(path, str(value), OSError(errno.EINVAL, str(exc))) from exc
        if new is None or old == new:  # None: the value means "unset", nothing to write
            return None
        try:
            self.write_cgroup(path, new)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise CgroupWriteError(path, new, exc) from exc
        log.event(LOGGER, "cgroup_write", path=str(path), old=old, new=new)
        return Change(str(path), old, new)

    def root_cpus(self) -> frozenset[int]:
        """The CPUs the root cgroup can use, which the kernel keeps equal to the online ones: v2
        ``cpuset.cpus.effective``, v1 ``cpuset.effective_cpus`` (else ``cpuset.cpus``); empty when
        the root shows none (no cpuset controller there)."""
        for file in (CgroupFile.CPUSET_EFFECTIVE, CgroupFile.CPUSET_CPUS):
            try:
                text = self.read("", file)
            except OSError:
                continue
            cpus = parse_cpus(text or "")
            if cpus:
                return cpus
        return frozenset()

    def pids(self, cgroup_dir: str) -> tuple[int, ...]:
        text = self.read(cgroup_dir, CgroupFile.PROCS) or ""
        return tuple(int(tok) for tok in text.split())

    # -- resctrl ---------------------------------------------------------------------------

    def resctrl_path(self, rel: str) -> pathlib.Path:
        return _resolve(self.resctrl_root, rel)

    def resctrl_group(self, name: str, schemata: Iterable[str]) -> list[Change]:
        """Create the group ``name`` if needed and make its schemata hold ``schemata`` lines."""
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"bad resctrl group name {name!r}")
        changes: list[Change] = []
        group = self.resctrl_path(name)
        if not group.is_dir():
            group.mkdir()
            changes.append(Change(str(group), None, "<dir>"))
        path = group / "schemata"
        old = _read(path)
        have = {line.strip() for line in (old or "").splitlines()}
        wanted = [line for line in schemata if line not in have]
        if wanted:
            new = "\n".join(wanted) + "\n"
            _write(path, new)
            changes.append(Change(str(path), old, new.strip()))
        return changes

    def resctrl_add_tasks(self, name: str, pids: Iterable[int]) -> list[Change]:
        """Move ``pids`` into the resctrl group ``name`` (one write per task, like the kernel wants)."""
        path = self.resctrl_path(f"{name}/tasks")
        changes: list[Change] = []
        for pid in pids:
            old = _read(path) or ""
            if str(pid) in old.split():
                continue
            _write(path, f"{pid}\n", append=True)
            changes.append(Change(str(path), old or None, str(pid)))
        return changes


def online_cpus(executor: Executor, sysfs_online: str = SYSFS_CPU_ONLINE) -> frozenset[int]:
    """The node's usable CPUs by number: the root cgroup's (:meth:`Executor.root_cpus`), else the
    kernel's online list ``sysfs_online``; never ``0..N-1`` from a count, which names offline CPUs
    (a cpuset with one is refused) and misses the high numbers. Empty when neither can be read."""
    cpus = executor.root_cpus()
    if cpus:
        return cpus
    try:
        with open(sysfs_online) as f:
            return parse_cpus(f.read().strip())
    except OSError:
        return frozenset()
