"""Recording CRI traces in the daemon and reading, replaying and serving them offline.

- :mod:`krproxy.trace.format`: the file format (pure; docs/trace-format.md).
- :mod:`krproxy.trace.recorder`: :class:`Recorder`, the daemon's observer and writer task.
- :mod:`krproxy.trace.messages`: decoding, IDs, normalisation and differences (offline).
- :mod:`krproxy.trace.show`, :mod:`krproxy.trace.replay`, :mod:`krproxy.trace.backend`: the
  ``krproxy trace show|replay|serve`` commands (:mod:`krproxy.trace.cli`).
"""

from __future__ import annotations

from krproxy.trace.files import Loaded as Loaded
from krproxy.trace.files import TraceFileError as TraceFileError
from krproxy.trace.files import load as load
from krproxy.trace.format import CorruptRecordError as CorruptRecordError
from krproxy.trace.format import TraceError as TraceError
from krproxy.trace.format import TraceFormatError as TraceFormatError
from krproxy.trace.format import TraceRecord as TraceRecord
from krproxy.trace.recorder import Recorder as Recorder

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
