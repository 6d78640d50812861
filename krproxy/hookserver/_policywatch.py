"""The node policy file's live watcher: polls the file and hands each new valid policy on (trio).

The file's schema and loader are :mod:`krproxy.hookserver._policy` (pure).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import attrs
import trio

from krproxy import log

from ._policy import NodePolicy, PolicyError

LOGGER = logging.getLogger("krproxy.hookserver.policy")

#: How often the watcher looks at the policy file (s). Cheap: one stat() per poll.
POLL_INTERVAL = 1.0


def _stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


@attrs.define
class PolicyWatcher:
    """Polls the policy file's inode/mtime/size; on a change, parses and calls ``on_change``.

    A bad or missing file keeps the last good policy (and is logged).
    """

    path: str
    on_change: Callable[[NodePolicy], object] = attrs.field(hash=False)
    interval: float = POLL_INTERVAL
    current: NodePolicy | None = None
    _stamp: tuple[int, int, int] | None = None
    #: Whether ``_stamp`` is a look's: a file missing at the first look is news (``policy_missing``), as
    #: is one that disappears later, though both stamps are None.
    _looked: bool = False

    def poll(self) -> bool:
        """Look once; return whether a new policy was taken (and ``on_change`` called)."""
        stamp = _stamp(self.path)
        if self._looked and stamp == self._stamp:
            return False
        self._stamp, self._looked = stamp, True
        kept = self.current is not None
        if stamp is None:
            log.warning(LOGGER, "policy_missing", path=self.path, kept_last_good=kept)
            return False
        try:
            policy = NodePolicy.load(self.path)
        except (OSError, PolicyError) as exc:
            log.error(LOGGER, "policy_invalid", path=self.path, error=str(exc), kept_last_good=kept)
            return False
        if policy == self.current:
            return False
        self.current = policy
        log.event(LOGGER, "policy_loaded", path=self.path)
        self.on_change(policy)
        return True

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Poll forever; ready once the first look is done."""
        self.poll()
        task_status.started()
        while True:
            await trio.sleep(self.interval)
            self.poll()
