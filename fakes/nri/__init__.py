"""A fake NRI runtime (the runtime side of containerd's Node Resource Interface) for tests without root.

:class:`FakeNriRuntime` listens for external plugins on a unix socket, registers, configures and
synchronizes them, and drives pod and container lifecycle events through them, applying their
adjustments and updates to its own state (see :mod:`fakes.nri.runtime`).
"""

from __future__ import annotations

from fakes.nri.adjust import NriError as NriError
from fakes.nri.events import all_events as all_events
from fakes.nri.events import event_mask as event_mask
from fakes.nri.runtime import ConnectedPlugin as ConnectedPlugin
from fakes.nri.runtime import FakeNriRuntime as FakeNriRuntime

__all__ = ["ConnectedPlugin", "FakeNriRuntime", "NriError", "all_events", "event_mask"]
