"""A fake containerd: a stateful CRI runtime and image service on a unix socket, for tests.

The pure state machine is :class:`RuntimeState`; :class:`FakeContainerd` puts it on the wire with a
request log and fault injection; :func:`run_fake_containerd` serves it as a trio task.
"""

from __future__ import annotations

from krproxy.fakes.containerd.records import Code as Code
from krproxy.fakes.containerd.records import CriError as CriError
from krproxy.fakes.containerd.records import ExecResult as ExecResult
from krproxy.fakes.containerd.records import sequential_ids as sequential_ids
from krproxy.fakes.containerd.records import stepping_clock as stepping_clock
from krproxy.fakes.containerd.server import FakeContainerd as FakeContainerd
from krproxy.fakes.containerd.server import Fault as Fault
from krproxy.fakes.containerd.server import RecordedRequest as RecordedRequest
from krproxy.fakes.containerd.server import run_fake_containerd as run_fake_containerd
from krproxy.fakes.containerd.state import RuntimeState as RuntimeState
from krproxy.fakes.containerd.versions import IMITATIONS as IMITATIONS
from krproxy.fakes.containerd.versions import Imitation as Imitation

__all__ = [
    "IMITATIONS",
    "Code",
    "CriError",
    "ExecResult",
    "FakeContainerd",
    "Fault",
    "Imitation",
    "RecordedRequest",
    "RuntimeState",
    "run_fake_containerd",
    "sequential_ids",
    "stepping_clock",
]
