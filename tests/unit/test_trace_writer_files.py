"""Tests of the trace writer as a node's operator meets it: the file rotated or deleted under it
(logrotate's copytruncate and rename, an ``rm`` to free space), a disk that fills, a FIFO given
as the trace file. Each file must stay readable up to its last whole record, and new records
must land in a readable file at the path the daemon was given."""

from __future__ import annotations

import errno
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from krproxy import cli
from krproxy.trace import format as fmt
from krproxy.trace.files import load
from krproxy.trace.recorder import TraceWriter
from tests.unit.test_trace_format import call

PATH = "/runtime.v1.RuntimeService/Version"


def frame(n: int) -> bytes:
    return fmt.encode_call(
        call(n, path=PATH, seconds=0.001, request=b"\x0a\x02v" + bytes([n]), reply=b"\x0a\x01x")
    )


def requests(path: Path | str) -> list[bytes]:
    return [r.request for r in load([str(path)]).records]


def writer(path: Path, **options: int) -> TraceWriter:
    return TraceWriter(str(path), max_bytes=options.get("max_bytes", 0), keep=options.get("keep", 3))


def req(n: int) -> bytes:
    return b"\x0a\x02v" + bytes([n])


class TestFileChangedUnderTheWriter:
    def test_copytruncate_leaves_a_readable_file(self, tmp_path: Path) -> None:
        """logrotate's copytruncate: the copy holds the old records, the truncated file the new ones,
        both readable (the file must get a header again, not start with a bare record)."""
        trace = tmp_path / "node.krt"
        w = writer(trace)
        w.write([frame(1), frame(2)])
        shutil.copyfile(trace, tmp_path / "node.krt-1")
        os.truncate(trace, 0)
        w.write([frame(3)])
        w.close()
        assert [req(1), req(2)] == requests(tmp_path / "node.krt-1")
        assert [req(3)] == requests(trace)

    def test_rename_starts_a_new_file_at_the_path(self, tmp_path: Path) -> None:
        """logrotate's rename (create): later records go to a new file at the path, not on into the
        renamed one."""
        trace = tmp_path / "node.krt"
        w = writer(trace)
        w.write([frame(1)])
        os.rename(trace, tmp_path / "node.krt-1")
        w.write([frame(2)])
        w.close()
        assert [req(1)] == requests(tmp_path / "node.krt-1")
        assert [req(2)] == requests(trace)

    def test_rename_with_an_empty_file_created_in_its_place(self, tmp_path: Path) -> None:
        """logrotate's ``create``: an empty file at the path after the rename gets the new records."""
        trace = tmp_path / "node.krt"
        w = writer(trace)
        w.write([frame(1)])
        os.rename(trace, tmp_path / "node.krt-1")
        trace.touch(mode=0o600)
        w.write([frame(2)])
        w.close()
        assert [req(2)] == requests(trace)

    def test_deleted_file_is_created_again(self, tmp_path: Path) -> None:
        """An operator deleting the trace (to free space): new records go to a new file at the path,
        not into the deleted inode, which would hold its disk space and be unreadable."""
        trace = tmp_path / "node.krt"
        w = writer(trace)
        w.write([frame(1)])
        os.unlink(trace)
        w.write([frame(2)])
        w.close()
        assert [req(2)] == requests(trace)

    def test_size_rotation_after_a_rename_counts_the_new_file(self, tmp_path: Path) -> None:
        """After an outside rename the size rotation counts the new file's bytes, not the old one's."""
        trace = tmp_path / "node.krt"
        w = writer(trace, keep=2)
        w.open()
        w.max_bytes = os.path.getsize(trace) + 3 * len(frame(1))
        w.write([frame(1), frame(2)])
        os.rename(trace, tmp_path / "outside")
        w.write([frame(3), frame(4)])  # a new file: two records fit, no rotation
        w.close()
        assert [req(3), req(4)] == requests(trace)
        assert not (tmp_path / "node.krt.1").exists()

    def test_unchanged_file_is_appended_to(self, tmp_path: Path) -> None:
        """The check does not disturb the common case: one file, records appended in order."""
        trace = tmp_path / "node.krt"
        w = writer(trace)
        for n in range(5):
            w.write([frame(n)])
        w.close()
        assert [req(n) for n in range(5)] == requests(trace)


class TestFullDisk:
    def test_enospc_mid_batch_leaves_the_whole_records_readable(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A disk that fills in the middle of a batch: the error reaches the caller, the file reads
        up to the last whole record (the torn one named), and a writer opened later cuts the torn
        tail and appends."""
        trace = tmp_path / "node.krt"
        w = writer(trace)
        w.write([frame(1)])
        real_write = os.write
        room = [len(frame(2)) + 5]

        def full_disk(fd: int, data: bytes | memoryview) -> int:
            if room[0] <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            n = real_write(fd, bytes(data[: room[0]]))
            room[0] -= n
            return n

        monkeypatch.setattr(os, "write", full_disk)
        with pytest.raises(OSError, match="No space left"):
            w.write([frame(2), frame(3)])
        monkeypatch.setattr(os, "write", real_write)
        w.close()
        loaded = load([str(trace)])
        assert [req(1), req(2)] == [r.request for r in loaded.records]
        (note,) = loaded.notes
        assert "torn last record 3" in note
        again = writer(trace)
        again.write([frame(4)])
        again.close()
        loaded = load([str(trace)])
        assert ([req(1), req(2), req(4)], ()) == ([r.request for r in loaded.records], loaded.notes)


class TestAfterAFailedWrite:
    def test_the_same_writer_goes_on_after_the_torn_record(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A write that fails mid-record (ENOSPC), then space again: the same writer's next records
        follow the last whole one; none is appended after the torn bytes, which would make every
        later record unreadable (CRC mismatch). The recorder closed its writer after a failure, but
        a write abandoned at the daemon's stop is followed by the stop's own write."""
        trace = tmp_path / "node.krt"
        w = writer(trace)
        w.write([frame(1)])
        real_write = os.write

        calls: list[int] = []

        def full_disk(fd: int, data: bytes | memoryview) -> int:
            # As the kernel does: a short write of what still fits, then ENOSPC.
            calls.append(fd)
            if len(calls) == 1:
                return real_write(fd, bytes(data[:7]))
            monkeypatch.setattr(os, "write", real_write)  # space again after this one
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "write", full_disk)
        with pytest.raises(OSError, match="No space left"):
            w.write([frame(2)])
        w.write([frame(3)])
        w.close()
        loaded = load([str(trace)])
        assert ([req(1), req(3)], ()) == ([r.request for r in loaded.records], loaded.notes)


def _in_thread_or_unblock(fn: Callable[[], object], unblock: Callable[[], None]) -> tuple[bool, object]:
    """Run ``fn`` in a thread; if it has not returned within 10 s, ``unblock`` it and wait for it.

    Returns (returned in time, what it returned or raised).
    """
    result: list[object] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as err:  # handed to the test
            result.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    in_time = not thread.is_alive()
    if not in_time:
        unblock()
        thread.join(10)
    return in_time, result[0] if result else None


def _open_other_end(fifo: Path, flags: int) -> Callable[[], None]:
    def unblock() -> None:
        fd = os.open(fifo, flags | os.O_NONBLOCK)
        os.close(fd)

    return unblock


class TestNotARegularFile:
    def test_serve_refuses_a_fifo_at_once(self, tmp_path: Path) -> None:
        """``--record`` naming a FIFO nobody reads: refused with a message, instead of hanging the
        start (kubelet's calls wait for a proxy that never listens)."""
        fifo = tmp_path / "trace.fifo"
        os.mkfifo(fifo)
        in_time, problem = _in_thread_or_unblock(
            lambda: cli._check_record(str(fifo)), _open_other_end(fifo, os.O_RDONLY)
        )
        assert in_time, "the check blocked on the FIFO"
        assert isinstance(problem, str)
        assert f"--record {fifo}" in problem and "not a regular file" in problem

    def test_writer_refuses_a_fifo_at_once(self, tmp_path: Path) -> None:
        """The writer (what ``Recorder.run`` opens before the proxy listens) raises OSError naming
        the problem instead of blocking on a FIFO without a writer."""
        fifo = tmp_path / "trace.fifo"
        os.mkfifo(fifo)
        w = writer(fifo)
        in_time, raised = _in_thread_or_unblock(w.open, _open_other_end(fifo, os.O_WRONLY))
        assert in_time, "opening the FIFO blocked"
        assert isinstance(raised, OSError) and "not a regular file" in str(raised)
        assert not w.is_open

    def test_regular_file_passes_the_check(self, tmp_path: Path) -> None:
        assert "" == cli._check_record(str(tmp_path / "node.krt"))
