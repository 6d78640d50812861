"""Recording every CRI call the proxy handles into a trace file (``krproxy serve --record FILE``).

Two halves, joined by an in-memory list of encoded records:

* :meth:`Recorder.observe` is a :data:`krproxy.calls.Observer`: on the request path it encodes
  the finished call (raw bytes, nothing decoded, see :func:`krproxy.trace.format.encode_call`)
  and appends it to the pending list. It never blocks and never touches the disk.
* :meth:`Recorder.run`, a trio task in the daemon's root nursery, hands the pending records to
  a :class:`TraceWriter` in a thread of its own every :data:`FLUSH_INTERVAL` seconds, or sooner
  once :data:`FLUSH_BYTES` are pending.

Recording can be switched on and off while the daemon runs (:meth:`Recorder.toggle`; the
daemon does it on SIGUSR1, see :func:`watch_toggle_signal`). Each switch logs
``event=recording state=on|off file=...``.

Error handling: the trace must never take the proxy down. If the disk cannot keep up, records
beyond :data:`MAX_PENDING` bytes are dropped and counted (``event=recording_dropped``); if the
file cannot be written, recording turns itself off (``event=recording_failed``) and the proxy
goes on. A crash loses at most the records of the last flush interval; the file stays readable
(a torn last record is skipped by readers and cut off by the next writer).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import logging
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import outcome
import trio

from krproxy import __version__, log
from krproxy.calls import CallRecord
from krproxy.trace.format import TraceError, decode_header, encode_call, encode_header, valid_end

LOGGER = logging.getLogger("krproxy.trace")

T = TypeVar("T")

#: Default size at which the trace file is rotated: large enough for hours of a busy node's
#: lifecycle traffic, small enough to copy off a node.
DEFAULT_MAX_BYTES = 64 << 20
#: Default number of rotated files kept (FILE.1 ... FILE.N) besides the current one.
DEFAULT_KEEP = 3
#: How often pending records are written out: bounds what a crash can lose.
FLUSH_INTERVAL = 0.5
#: Pending bytes that trigger a write before the interval is over.
FLUSH_BYTES = 1 << 20
#: Pending bytes beyond which new records are dropped rather than buffered (a stuck disk must
#: not grow the proxy's memory without bound).
MAX_PENDING = 64 << 20
#: How long the daemon's stop waits for the last trace write: a hung disk (a dead NFS server)
#: must not hold the stop, and with it a socket-activated successor, up for good.
STOP_FLUSH_LIMIT = 5.0


class _InOrder:
    """Blocking calls run one at a time in a thread, in the order they were queued, whether or not
    their callers still wait for them.

    A call is queued before its caller's first checkpoint, so a caller cancelled at any point leaves
    its call to run: a write of records taken from the pending list is never skipped, and a later
    call (the stop's close) returns only after it. trio's own ``to_thread.run_sync`` could be
    cancelled before its thread started, and abandoned calls raced the later ones for a lock: the
    stop's close could win and the daemon exit before a periodic flush's records were written. The
    thread ends when nothing is queued, and the next call starts another.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._queue: collections.deque[Callable[[], None]] = collections.deque()
        self._running = False

    async def run(self, fn: Callable[[], T]) -> T:
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        result: list[outcome.Outcome[T]] = []

        def job() -> None:
            result.append(outcome.capture(fn))
            with contextlib.suppress(trio.RunFinishedError):  # the run ended: no one waits
                token.run_sync_soon(done.set)

        with self._lock:
            self._queue.append(job)
            start = not self._running
            self._running = True
        if start:
            threading.Thread(target=self._work, name=self.name, daemon=True).start()
        await done.wait()
        return result[0].unwrap()

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                job = self._queue.popleft()
            job()


def _rotated(path: str, n: int) -> str:
    return f"{path}.{n}"


class TraceWriter:
    """Appends encoded records to a trace file, rotating it at ``max_bytes``. Blocking I/O.

    Rotation happens between records: ``FILE`` becomes ``FILE.1``, ``FILE.1`` becomes
    ``FILE.2``, ..., files beyond ``keep`` are deleted, and a new ``FILE`` starts with a fresh
    header. A single record larger than ``max_bytes`` still gets written, alone in its file.

    Opening an existing file appends to it, after cutting off a torn last record; a file that
    is not a trace of this version, or has a damaged record, is rotated away untouched. A file
    renamed, deleted or truncated by someone else is noticed at the next write, and the path
    opened again.

    Not thread-safe: use from one thread at a time. Files are created with mode 0600 (traces
    hold whatever kubelet sent: environment variables, secrets mounted as env).
    """

    def __init__(
        self, path: str, *, max_bytes: int, keep: int, meta: Mapping[str, Any] | None = None
    ) -> None:
        if max_bytes < 0 or keep < 0:
            raise ValueError("max_bytes and keep must not be negative")
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self.meta = dict(meta) if meta is not None else default_meta()
        self.size = 0
        self.rotations = 0
        self._header_size = 0
        self._fd: int | None = None

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    def open(self) -> None:
        """Open ``path`` for appending (creating it with a header if needed)."""
        if self._fd is not None:
            return
        try:
            # Non-blocking: a FIFO at the path must not hang the start (or a flush) on its other end.
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            self._create()
            return
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(
                    errno.EINVAL, f"{self.path} is not a regular file; give --record the path of a file"
                )
            data = f.read()
        if not data:
            self._create()
            return
        try:
            header = decode_header(data)
            end = valid_end(data, header.size)
        except TraceError as err:
            log.warning(LOGGER, "recording_set_aside", file=self.path, reason=str(err))
            self._shift()
            self._create()
            return
        if end < len(data):
            log.warning(LOGGER, "recording_torn_tail_cut", file=self.path, bytes=len(data) - end)
            os.truncate(self.path, end)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._header_size, self.size = header.size, end

    def write(self, frames: Sequence[bytes]) -> int:
        """Append encoded records (from :func:`encode_call`); returns the bytes written."""
        self._follow_path()
        self.open()
        written = 0
        batch: list[bytes] = []
        batch_size = 0
        for frame in frames:
            size = self.size + batch_size
            if self.max_bytes and size > self._header_size and size + len(frame) > self.max_bytes:
                written += self._write_all(b"".join(batch))
                batch, batch_size = [], 0
                self.rotate()
            batch.append(frame)
            batch_size += len(frame)
        if batch:
            written += self._write_all(b"".join(batch))
        return written

    def _follow_path(self) -> None:
        """Reopen ``path`` if the open file is no longer there as written: renamed or deleted (logrotate's
        rename, an ``rm`` to free space) or cut short (logrotate's copytruncate). Appending on would put
        records into a file nobody finds, or after no header."""
        if self._fd is None:
            return
        ours = os.fstat(self._fd)
        try:
            there = os.stat(self.path)
        except FileNotFoundError:
            there = None
        if there is None or (there.st_dev, there.st_ino) != (ours.st_dev, ours.st_ino):
            reason = "renamed or deleted"
        elif ours.st_size != self.size:
            reason = f"size changed from {self.size} to {ours.st_size} bytes (truncated?)"
        else:
            return
        log.warning(LOGGER, "recording_reopened", file=self.path, reason=reason)
        self.close()
        self.open()

    def rotate(self) -> None:
        """Start a new file now; the current one becomes ``FILE.1``."""
        self.close()
        self._shift()
        self._create()
        self.rotations += 1

    def close(self) -> None:
        """Write everything to disk and close the file (reopened by the next write)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _shift(self) -> None:
        if self.keep == 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            return
        for n in range(self.keep - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.replace(_rotated(self.path, n), _rotated(self.path, n + 1))
        with contextlib.suppress(FileNotFoundError):
            os.replace(self.path, _rotated(self.path, 1))

    def _create(self) -> None:
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        header = encode_header({**self.meta, "created": time.time()})
        self.size = 0
        self._write_all(header)
        self._header_size = len(header)

    def _write_all(self, data: bytes) -> int:
        assert self._fd is not None
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
                self.size += n
        except OSError:
            # The file may end inside a record now (a full disk): the next write opens it again,
            # which cuts that record off, instead of appending after it.
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        return len(data)


def default_meta() -> dict[str, Any]:
    """Header metadata written by the daemon: which krproxy on which host."""
    return {"writer": f"krproxy {__version__}", "host": socket.gethostname()}


@attrs.frozen
class RecorderStatistics:
    """A snapshot of a :class:`Recorder`'s counters."""

    active: bool
    path: str
    recorded: int
    dropped: int
    pending_bytes: int
    written_bytes: int
    rotations: int


class Recorder:
    """Records finished calls into a trace file; see the module docstring.

    Args:
        path: the trace file (rotated files get ``.1``, ``.2``, ... appended).
        max_bytes: rotate once the file would grow beyond this; 0 means never.
        keep: rotated files to keep.
        active: whether to record from the start (else wait for :meth:`toggle`).
    """

    def __init__(
        self,
        path: str,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        keep: int = DEFAULT_KEEP,
        active: bool = True,
        flush_interval: float = FLUSH_INTERVAL,
        flush_bytes: int = FLUSH_BYTES,
        max_pending: int = MAX_PENDING,
        stop_flush_limit: float = STOP_FLUSH_LIMIT,
    ) -> None:
        self.path = path
        self.active = active
        self.flush_interval = flush_interval
        self.flush_bytes = flush_bytes
        self.max_pending = max_pending
        self.stop_flush_limit = stop_flush_limit
        self._writer = TraceWriter(path, max_bytes=max_bytes, keep=keep)
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._recorded = 0
        self._dropped = 0
        self._written = 0
        self._wake = trio.Event()
        self._lock = trio.Lock()
        self._jobs = _InOrder("krproxy-trace-writer")

    # -- the request path ------------------------------------------------------------------

    def observe(self, record: CallRecord) -> None:
        """Queue ``record`` for the trace (a :data:`krproxy.calls.Observer`; cheap, never blocks)."""
        if not self.active:
            return
        frame = encode_call(record)
        size = self._pending_bytes + len(frame)
        if size > self.max_pending:
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 1000 == 0:
                log.warning(LOGGER, "recording_dropped", file=self.path, dropped=self._dropped)
            return
        self._pending.append(frame)
        self._pending_bytes = size
        self._recorded += 1
        if size >= self.flush_bytes:
            self._wake.set()

    # -- control ---------------------------------------------------------------------------

    def set_active(self, active: bool) -> None:
        """Switch recording on or off; pending records are written out either way."""
        if active != self.active:
            self.active = active
            log.event(LOGGER, "recording", state="on" if active else "off", file=self.path)
        self._wake.set()

    def toggle(self) -> bool:
        """Switch recording to the other state; returns the new state."""
        self.set_active(not self.active)
        return self.active

    def statistics(self) -> RecorderStatistics:
        return RecorderStatistics(
            active=self.active,
            path=self.path,
            recorded=self._recorded,
            dropped=self._dropped,
            pending_bytes=self._pending_bytes,
            written_bytes=self._written,
            rotations=self._writer.rotations,
        )

    # -- the writing task ------------------------------------------------------------------

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        """Run a blocking :class:`TraceWriter` method in the writer's thread (:class:`_InOrder`).
        Cancelling the wait (only the daemon's stop does) leaves the call queued: it still runs, in
        its place, and the stop's last close, queued after it, waits for it."""
        return await self._jobs.run(fn)

    async def flush(self) -> None:
        """Write the pending records now (and close the file if recording is off)."""
        async with self._lock:
            frames, self._pending, self._pending_bytes = self._pending, [], 0
            try:
                if frames:
                    self._written += await self._in_thread(functools.partial(self._writer.write, frames))
                if not self.active and self._writer.is_open:
                    await self._in_thread(self._writer.close)
            except OSError as err:
                self._dropped += len(frames)
                self.active = False
                log.error(LOGGER, "recording_failed", file=self.path, error=str(err))
                log.event(LOGGER, "recording", state="off", file=self.path)
                with contextlib.suppress(OSError):
                    await self._in_thread(self._writer.close)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write pending records periodically until cancelled; then write the rest and close,
        waiting at most :attr:`stop_flush_limit` seconds for the disk (``event=recording_abandoned``).

        Opens (or creates) the file before reporting started, so a bad path shows at start-up
        (as ``event=recording_failed``; the proxy runs on without recording).
        """
        if self.active:
            log.event(LOGGER, "recording", state="on", file=self.path)
            try:
                await self._in_thread(self._writer.open)
            except OSError as err:
                self.active = False
                log.error(LOGGER, "recording_failed", file=self.path, error=str(err))
                log.event(LOGGER, "recording", state="off", file=self.path)
        task_status.started()
        try:
            while True:
                with trio.move_on_after(self.flush_interval):
                    await self._wake.wait()
                self._wake = trio.Event()
                await self.flush()
        finally:
            with trio.CancelScope(shield=True, deadline=trio.current_time() + self.stop_flush_limit) as last:
                await self.flush()
                with contextlib.suppress(OSError):
                    await self._in_thread(self._writer.close)
            if last.cancelled_caught:
                log.warning(
                    LOGGER,
                    "recording_abandoned",
                    file=self.path,
                    reason=f"writing the trace took over {self.stop_flush_limit:g} s; its last records may be lost",
                )


async def watch_toggle_signal(
    recorder: Recorder | None, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Toggle ``recorder`` on every SIGUSR1 (without a recorder, say why nothing happens).

    SIGUSR1 is caught even without a recorder: its default action would kill the daemon.
    Reports started once SIGUSR1 is caught.
    """
    with trio.open_signal_receiver(signal.SIGUSR1) as signals:
        task_status.started()
        async for _ in signals:
            if recorder is None:
                log.warning(
                    LOGGER,
                    "recording_unavailable",
                    reason="no trace file: start krproxy serve with --record FILE",
                )
            else:
                recorder.toggle()
