"""Watching the hook directory: registration files take effect without a restart.

The directory is polled (every :data:`POLL_INTERVAL` seconds) rather than watched with
inotify: polling needs no C extension, sees files behind symlinks and on any filesystem,
and survives the directory itself being deleted and recreated — the cases where
fsnotify-based watchers (the reference's) lose track. A scan costs one ``scandir`` and a
``stat`` per file, a few microseconds for the handful of files a node has.

Change detection is pure (:func:`changed_files` compares two :data:`Snapshot` values); the
I/O is :func:`take_snapshot`, :func:`read_file` and the loop in :func:`watch`, which every
daemon (CRI, Docker and NRI mode) starts through :func:`watch_hook_dir`, with its flags.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable, Mapping
from typing import Protocol

import attrs
import trio

from krproxy import log
from krproxy.hooks.registration import Registry, is_registration_file

LOGGER = logging.getLogger("krproxy.hooks.watcher")

#: Seconds between scans. Changes take effect within one interval (the issue asks for < 1 s).
POLL_INTERVAL = 0.5

#: Largest registration file read; a real one is a few hundred bytes.
MAX_FILE_SIZE = 64 * 1024


@attrs.frozen
class FileState:
    """What identifies one version of a file: rewriting or replacing it changes at least one field."""

    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int


#: File name -> state, for the registration files present in the directory.
Snapshot = Mapping[str, FileState]


def changed_files(before: Snapshot, after: Snapshot) -> list[str]:
    """Names added, removed or changed between two snapshots, sorted."""
    return sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))


def take_snapshot(directory: str) -> Snapshot | None:
    """State of every registration file in ``directory``; None if the directory is missing.

    Symlinks are followed (a file may be a link into a ConfigMap mount); sub-directories
    and files that vanish mid-scan are skipped.
    """
    snapshot: dict[str, FileState] = {}
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return None
    for entry in entries:
        if not is_registration_file(entry.name):
            continue
        try:
            st = entry.stat()  # follows symlinks
        except OSError:
            continue
        if not os.path.isdir(entry.path):
            snapshot[entry.name] = FileState(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return snapshot


class UntrustedFile(Exception):
    """A registration file that someone other than root could have written; refused unread."""


def untrusted_reason(st: os.stat_result, *, uid: int | None = None, gid: int | None = None) -> str | None:
    """Why a file with status *st* must not be trusted as a registration file, or None.

    A registration file tells the daemon (root) which socket to hand every pod's spec to and
    whose answers to apply, so it must be as hard to write as the daemon itself: owned by root
    (or by the daemon's own user, the same thing in production) and not writable by others:
    not by everyone, nor by a group other than root's (or the daemon's own).

    *uid* and *gid* are the daemon's (default: this process's): a hook server asks as the root daemon
    that will read its file (``uid=0, gid=0``).
    """
    uid = os.geteuid() if uid is None else uid
    gid = os.getegid() if gid is None else gid
    if st.st_uid not in (0, uid):
        return f"owned by uid {st.st_uid}, not root"
    if st.st_mode & stat.S_IWOTH:
        return f"world-writable (mode {stat.S_IMODE(st.st_mode):04o})"
    if st.st_mode & stat.S_IWGRP and st.st_gid not in (0, gid):
        return f"writable by group {st.st_gid} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def read_file(path: str, *, trusted_only: bool = True) -> bytes | None:
    """The file's bytes (at most :data:`MAX_FILE_SIZE` + 1), or None if it is gone.

    With *trusted_only*, the file actually opened (a symlink's target) must pass
    :func:`untrusted_reason`, checked on the open descriptor so that it cannot be swapped
    between the check and the read; otherwise :class:`UntrustedFile` is raised. The file is
    opened non-blocking and must not be a FIFO, socket or device, so nothing dropped into the
    directory can stall the daemon.

    Other errors (no permission, a directory) propagate as OSError for the caller to report.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise UntrustedFile("not a regular file")
        problem = untrusted_reason(st) if trusted_only else None
        if problem is not None:
            raise UntrustedFile(problem)
        return f.read(MAX_FILE_SIZE + 1)  # a directory raises IsADirectoryError here


def ensure_directory(directory: str) -> bool:
    """Create ``directory`` (mode 0755, like the reference) if missing; False if we cannot."""
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
    except OSError as err:
        log.warning(LOGGER, "hook_dir_unavailable", dir=directory, error=os.strerror(err.errno or errno.EIO))
        return False
    return True


def load_changes(
    directory: str, registry: Registry, names: list[str], *, trusted_only: bool = True
) -> Registry:
    """Apply the current content of each named file to ``registry``, logging every outcome.

    A file refused by :func:`read_file` (untrusted owner or mode) counts as invalid: its
    previous valid version, if any, stays in force.
    """
    for name in names:
        path = os.path.join(directory, name)
        problem: str | None = None
        try:
            content = read_file(path, trusted_only=trusted_only)
        except UntrustedFile as err:
            content = b""
            problem = (
                f"refused: {err}; registration files must be owned by root and not writable by others "
                "(--insecure-registration-files relaxes this)"
            )
        except OSError as err:
            content = b""  # unreadable: reported below as a registration error
            problem = f"cannot read: {err.strerror or err}"
        else:
            if content is not None and len(content) > MAX_FILE_SIZE:
                problem = f"larger than {MAX_FILE_SIZE} bytes"
        if problem is not None:
            registry = registry.record_error(name, problem)
        else:
            registry = registry.apply(name, content)
        _report(directory, name, registry, content is None)
    return registry


def _report(directory: str, name: str, registry: Registry, removed: bool) -> None:
    error = registry.error_for(name)
    plugin = registry.plugins.get(name)
    if error is not None:
        log.error(
            LOGGER,
            "registration_invalid",
            file=os.path.join(directory, name),
            error=error,
            kept_previous=plugin is not None,
        )
    elif removed:
        log.event(LOGGER, "plugin_unregistered", file=os.path.join(directory, name))
    elif plugin is not None:
        log.event(
            LOGGER,
            "plugin_registered",
            file=os.path.join(directory, name),
            endpoint=plugin.endpoint,
            hooks=",".join(p.value for p in plugin.hooks),
            failure_policy=plugin.failure_policy.value,
            timeout=plugin.timeout,
            order=plugin.order,
        )
        for warning in plugin.warnings:
            log.warning(LOGGER, "registration_warning", file=name, warning=warning)


async def watch(
    directory: str,
    publish: Callable[[Registry], None],
    *,
    on_error: Callable[[str], None] = lambda name: None,
    interval: float = POLL_INTERVAL,
    trusted_only: bool = True,
    task_status: trio.TaskStatus[Registry] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep ``publish``-ing the registry of ``directory`` as its files change; runs until cancelled.

    The first scan completes before ``task_status.started(registry)``, so a daemon serves
    only once the plugins present at start-up are loaded. ``on_error(name)`` is called for
    each file found invalid (for the metric). A missing directory is created, or waited
    for when it cannot be; one that cannot be read keeps the current plugins (logged once
    per distinct error); neither is ever fatal. ``trusted_only=False`` reads files whatever
    their owner and mode (``--insecure-registration-files``, for tests and development).
    """
    registry = Registry()
    before: Snapshot = {}
    started = False
    scan_error = ""
    while True:
        try:
            after = take_snapshot(directory)
            if after is None:
                if ensure_directory(directory):
                    after = take_snapshot(directory)
                after = after or {}
        except OSError as err:
            # Not a directory, unreadable, I/O error: keep the plugins we have and look again.
            if str(err) != scan_error:
                scan_error = str(err)
                log.error(LOGGER, "hook_dir_unreadable", dir=directory, error=scan_error)
            after = before
        else:
            scan_error = ""
        names = changed_files(before, after)
        if names:
            registry = load_changes(directory, registry, names, trusted_only=trusted_only)
            for name in names:
                if registry.error_for(name) is not None:
                    on_error(name)
            publish(registry)
        before = after
        if not started:
            started = True
            task_status.started(registry)
        await trio.sleep(interval)


class HookDirSettings(Protocol):
    """What a daemon's configuration says about its hook directory (``ProxyConfig``, ``NriConfig``)."""

    @property
    def hook_dir(self) -> str: ...

    @property
    def insecure_registration_files(self) -> bool: ...


async def watch_hook_dir(
    settings: HookDirSettings,
    publish: Callable[[Registry], None],
    on_error: Callable[[str], None],
    *,
    task_status: trio.TaskStatus[Registry] = trio.TASK_STATUS_IGNORED,
) -> None:
    """:func:`watch` the daemon's hook directory as its flags say: registration files must be
    owned by root and writable by nobody else unless ``--insecure-registration-files`` is given.
    The one way CRI, Docker and NRI mode start their watcher, so that no mode reads the flags
    otherwise (Docker mode ignored ``--insecure-registration-files``)."""
    await watch(
        settings.hook_dir,
        publish,
        on_error=on_error,
        trusted_only=not settings.insecure_registration_files,
        task_status=task_status,
    )
