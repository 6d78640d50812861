"""A fake NRI runtime (the runtime side of containerd's Node Resource Interface) for tests without root.

:class:`FakeNriRuntime` listens for external plugins on a unix socket, registers, configures and
synchronizes them, and drives pod and container lifecycle events through them, applying their
adjustments and updates to its own state (see :mod:`krproxy.fakes.nri.runtime`).
"""

from __future__ import annotations

from krproxy.fakes.nri.adjust import NriError as NriError
from krproxy.fakes.nri.events import all_events as all_events
from krproxy.fakes.nri.events import event_mask as event_mask
from krproxy.fakes.nri.runtime import ConnectedPlugin as ConnectedPlugin
from krproxy.fakes.nri.runtime import FakeNriRuntime as FakeNriRuntime

__all__ = ["ConnectedPlugin", "FakeNriRuntime", "NriError", "all_events", "event_mask"]
