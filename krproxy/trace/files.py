"""Reading trace files from disk (one or several, e.g. ``FILE.2 FILE.1 FILE`` after rotation)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from krproxy.trace.format import ReadResult, TraceError, TraceRecord, read_records


class TraceFileError(TraceError):
    """A trace file could not be read; the message names the file and the problem."""


@attrs.frozen
class Loaded:
    """The records of one or more files, in file order, and what was noticed reading them."""

    records: tuple[TraceRecord, ...]
    files: tuple[tuple[str, ReadResult], ...]
    notes: tuple[str, ...]

    @property
    def damaged(self) -> bool:
        """Whether a damaged record was left out (``skip_corrupt``): what was shown is not all."""
        return any(result.corrupt for _, result in self.files)


def load(
    paths: Sequence[str], *, warn: Callable[[str], None] = lambda note: None, skip_corrupt: bool = False
) -> Loaded:
    """Read the trace files ``paths`` in the order given.

    A torn last record is skipped and reported through ``warn`` (and in :attr:`Loaded.notes`); with
    ``skip_corrupt`` so is each damaged record (named by file, number and offset), the good ones kept.

    Raises:
        TraceFileError: a file is missing, not a trace, or has a corrupt record; the message
            names the file and, for a corrupt record, its number and byte offset.
    """
    records: list[TraceRecord] = []
    files: list[tuple[str, ReadResult]] = []
    notes: list[str] = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as err:
            raise TraceFileError(f"{path}: {err.strerror or err}") from None
        try:
            result = read_records(data, skip_corrupt=skip_corrupt)
        except TraceError as err:
            raise TraceFileError(f"{path}: {err}") from None
        files.append((path, result))
        records.extend(result.records)
        for note in _notes(result):
            notes.append(f"{path}: {note}")
            warn(f"{path}: {note}")
    return Loaded(tuple(records), tuple(files), tuple(notes))


def _notes(result: ReadResult) -> list[str]:
    notes = [f"{error} (left out)" for error in result.corrupt]
    if result.unread:
        notes.append(
            f"the last {result.unread} bytes could not be read: no record can be found after a damaged length"
        )
    if result.torn is not None:
        notes.append(result.torn.describe())
    if result.unknown_kinds:
        notes.append(f"{result.unknown_kinds} records of kinds this krproxy does not know were skipped")
    return notes
