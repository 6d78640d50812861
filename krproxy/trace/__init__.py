"""Recording CRI traces in the daemon and reading, replaying and serving them offline.

- :mod:`krproxy.trace.format`: the file format (pure; docs/trace-format.md).
- :mod:`krproxy.trace.recorder`: :class:`Recorder`, the daemon's observer and writer task.
- :mod:`krproxy.trace.messages`: decoding, IDs, normalisation and differences (offline).
- :mod:`krproxy.trace.show`, :mod:`krproxy.trace.replay`, :mod:`krproxy.trace.backend`: the
  ``krproxy trace show|replay|serve`` commands (:mod:`krproxy.trace.cli`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from krproxy.trace.files import Loaded as Loaded
from krproxy.trace.files import TraceFileError as TraceFileError
from krproxy.trace.files import load as load
from krproxy.trace.format import CorruptRecordError as CorruptRecordError
from krproxy.trace.format import TraceError as TraceError
from krproxy.trace.format import TraceFormatError as TraceFormatError
from krproxy.trace.format import TraceRecord as TraceRecord

if TYPE_CHECKING:
    from krproxy.trace.recorder import Recorder as Recorder


def __getattr__(name: str) -> Any:
    # The recorder runs on trio; reading a trace file (format, files) needs no event loop.
    if name == "Recorder":
        from krproxy.trace.recorder import Recorder

        return Recorder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CorruptRecordError",
    "Loaded",
    "Recorder",
    "TraceError",
    "TraceFileError",
    "TraceFormatError",
    "TraceRecord",
    "load",
]
