"""Watching the hooks.d directories of the proxy: hook files take effect without a restart.

The scan is the plugin-directory watcher's (:func:`krproxy.hooks.watcher.take_snapshot`,
:func:`~krproxy.hooks.watcher.changed_files`, :func:`~krproxy.hooks.watcher.read_file`): polled
every :data:`POLL_INTERVAL` seconds, symlinks followed, ``*.json`` not starting with ``.``. A
missing directory counts as empty and is not created (the default ones belong to the packages
that install hooks). Each change re-parses only the files that changed, then recomputes which
files are in force (:func:`krproxy.ocihooks.model.effective`) and publishes that list.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import trio

from krproxy import log
from krproxy.hooks.watcher import MAX_FILE_SIZE, Snapshot, changed_files, read_file, take_snapshot
from krproxy.ocihooks.model import Entry, HookFile, InvalidHookFile, effective, parse_hook_file

LOGGER = logging.getLogger("krproxy.ocihooks")

#: Seconds between scans, as for plugin registration files.
POLL_INTERVAL = 0.5


def load_entry(directory: str, name: str) -> Entry | None:
    """Parse ``directory/name``: the hook file, the error text, or None if the file is gone."""
    path = os.path.join(directory, name)
    try:
        content = read_file(path)
    except OSError as err:
        return f"cannot read: {err.strerror or err}"
    if content is None:
        return None
    if len(content) > MAX_FILE_SIZE:
        return f"larger than {MAX_FILE_SIZE} bytes"
    try:
        return parse_hook_file(name, content, path)
    except InvalidHookFile as err:
        return str(err)


class HookDirectories:
    """The parsed content of several directories, earliest (least preferred) first; pure bookkeeping."""

    def __init__(self, directories: Sequence[str]) -> None:
        self.directories = list(directories)
        self.layers: list[dict[str, Entry]] = [{} for _ in directories]
        self.snapshots: list[Snapshot] = [{} for _ in directories]
        #: Whether each directory existed at the last scan (None: not scanned yet).
        self.present: list[bool | None] = [None for _ in directories]

    def rescan(self) -> bool:
        """Scan every directory; reload changed files; True if anything changed."""
        changed = False
        for index, directory in enumerate(self.directories):
            found = take_snapshot(directory)
            self._note_presence(index, found is not None)
            after = found or {}
            names = changed_files(self.snapshots[index], after)
            self.snapshots[index] = after
            for name in names:
                entry = load_entry(directory, name)
                if entry is None:
                    self.layers[index].pop(name, None)
                    log.event(LOGGER, "oci_hook_removed", file=os.path.join(directory, name))
                    continue
                self.layers[index][name] = entry
                _report(directory, name, entry, masked=self._masked(index, name))
            changed = changed or bool(names)
        return changed

    def _note_presence(self, index: int, present: bool) -> None:
        """Log a directory missing at start or gone since (a mistyped path runs no hooks), and its return."""
        before, self.present[index] = self.present[index], present
        if present == before or (present and before is None):
            return
        directory = self.directories[index]
        if present:
            log.event(LOGGER, "oci_hooks_dir_found", dir=directory)
        else:
            log.warning(
                LOGGER,
                "oci_hooks_dir_missing",
                dir=directory,
                hint="no hooks from it until it is created; check the --oci-hooks-dir path",
            )

    def _masked(self, index: int, name: str) -> str | None:
        for later in range(index + 1, len(self.directories)):
            if name in self.layers[later]:
                return os.path.join(self.directories[later], name)
        return None

    def in_force(self) -> list[HookFile]:
        return effective(self.layers)


def _report(directory: str, name: str, entry: Entry, masked: str | None) -> None:
    path = os.path.join(directory, name)
    if isinstance(entry, str):
        log.error(LOGGER, "oci_hook_invalid", file=path, error=entry)
        return
    log.event(
        LOGGER,
        "oci_hook_loaded",
        file=path,
        hook=entry.command.path,
        stages=",".join(entry.stages),
        masked_by=masked or "",
    )


async def watch_hook_dirs(
    directories: Sequence[str],
    publish: Callable[[list[HookFile]], None],
    *,
    interval: float = POLL_INTERVAL,
    task_status: trio.TaskStatus[list[HookFile]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep ``publish``-ing the hook files in force as the directories change; runs until cancelled.

    The first scan is published before ``task_status.started``, so the proxy serves only once
    the hooks present at start-up are loaded.
    """
    dirs = HookDirectories(directories)
    dirs.rescan()
    publish(dirs.in_force())
    task_status.started(dirs.in_force())
    while True:
        await trio.sleep(interval)
        if dirs.rescan():
            publish(dirs.in_force())
