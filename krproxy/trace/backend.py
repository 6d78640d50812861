"""``krproxy trace serve``: a CRI backend that answers from a trace, so a recorded node can be
replayed against krproxy (with plugins) without a runtime.

Matching (:class:`TraceAnswers`, pure): a request is answered by a recorded call of the same
method whose request — as the runtime received it, i.e. after the recorded hooks — is equal
once decoded and normalised, else by position in the recorded sequence (e.g. when a plugin
now changes the request differently); read-only calls are answered from the state after the
last state-changing call without using anything up. A method not in the trace is answered
UNIMPLEMENTED.

Server-streaming calls (GetContainerEvents) get their initial metadata and then no message
until the caller goes away: no event is invented.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
from collections.abc import Iterable

import attrs
import trio

from krproxy import log, rpc
from krproxy.grpcstatus import Cardinality, GRPCError, Status
from krproxy.trace import messages
from krproxy.trace.format import TraceRecord
from krproxy.trace.replay import replay_order

LOGGER = logging.getLogger("krproxy.trace.serve")


def request_key(path: str, request: bytes) -> str | bytes:
    """What two requests must share to be "the same": the normalised decoded form, else the bytes."""
    message = messages.decode(path, request)
    if message is None:
        return request
    return json.dumps(messages.normalise(messages.to_plain(message), shape=type(message)), sort_keys=True)


def is_read_only(path: str) -> bool:
    """Whether a CRI method only reads the runtime's state (List*, *Status, *Stats, Version, ...)."""
    method = path.rpartition("/")[2]
    return (
        method.startswith("List")
        or method.endswith(("Status", "Stats", "Info"))
        or method in ("Version", "RuntimeConfig")
    )


@attrs.define
class _Entry:
    index: int
    record: TraceRecord
    key: str | bytes
    used: bool = False


@attrs.frozen
class AnswerStatistics:
    """How requests were matched so far.

    Attributes:
        exact: answered by a recorded call with an equal request.
        sequential: answered by position, no recorded request being equal.
        repeated: a changing call answered again by an already used recorded call.
        missing: methods the trace does not hold.
    """

    exact: int
    sequential: int
    repeated: int
    missing: int


class TraceAnswers:
    """Picks the recorded call that answers a request.

    The trace is a sequence of calls in the order they started. A *cursor* marks the last
    state-changing call answered (RunPodSandbox, CreateContainer, StopContainer, ...):

    * a state-changing request takes the first unused recorded call of its method with an
      equal request (after the cursor if there is one), else the first unused one after the
      cursor, else the first unused one; the cursor moves to it. When all are used, the last
      one answers again.
    * a read-only request (List*, *Status, *Stats, Version, ...) is answered from the state
      after the cursor: the first recorded call of its method after the cursor with an equal
      request, else the last equal one before it, else the first of the method after the
      cursor, else the last before. Read-only calls never move the cursor or use a call up,
      so extra reads (the proxy's own store recovery at start-up, a caller polling more
      often) cannot steal answers from the recorded sequence.
    """

    def __init__(self, records: Iterable[TraceRecord]) -> None:
        self._by_path: dict[str, list[_Entry]] = collections.defaultdict(list)
        for index, record in enumerate(replay_order(records)):
            key = request_key(record.path, record.runtime_request)
            self._by_path[record.path].append(_Entry(index, record, key))
        self._cursor = -1
        self._counts = collections.Counter[str]()

    @property
    def paths(self) -> list[str]:
        return sorted(self._by_path)

    def answer(self, path: str, request: bytes) -> TraceRecord | None:
        """The recorded call answering ``request`` to ``path``; None if the method is not in the trace."""
        entries = self._by_path.get(path)
        if not entries:
            self._counts["missing"] += 1
            return None
        key = request_key(path, request)
        entry = self._read(entries, key) if is_read_only(path) else self._change(entries, key)
        return entry.record

    def _read(self, entries: list[_Entry], key: str | bytes) -> _Entry:
        after = [e for e in entries if e.index > self._cursor]
        before = [e for e in entries if e.index <= self._cursor]
        for candidates, pick in ((after, 0), (before, -1)):
            equal = [e for e in candidates if e.key == key]
            if equal:
                self._counts["exact"] += 1
                return equal[pick]
        self._counts["sequential"] += 1
        return after[0] if after else before[-1]

    def _change(self, entries: list[_Entry], key: str | bytes) -> _Entry:
        unused = [e for e in entries if not e.used]
        after = [e for e in unused if e.index > self._cursor]
        entry = next((e for e in after if e.key == key), None) or next(
            (e for e in unused if e.key == key), None
        )
        if entry is not None:
            self._counts["exact"] += 1
        elif after or unused:
            entry = (after or unused)[0]
            self._counts["sequential"] += 1
        else:
            self._counts["repeated"] += 1
            return entries[-1]
        entry.used = True
        self._cursor = max(self._cursor, entry.index)
        return entry

    def statistics(self) -> AnswerStatistics:
        c = self._counts
        return AnswerStatistics(c["exact"], c["sequential"], c["repeated"], c["missing"])


class TraceBackend:
    """Serves :class:`TraceAnswers` for every method path (raw bytes), as the fallback of a
    :class:`krproxy.rpc.Server`: ``rpc.Server({}, fallback=backend.fallback)``.

    Args:
        timing: wait each call's recorded backend time before answering.
    """

    def __init__(self, records: Iterable[TraceRecord], *, timing: bool = False) -> None:
        self.answers = TraceAnswers(records)
        self.timing = timing

    def fallback(self, path: str) -> rpc.Handler:
        return functools.partial(self._handle, path)

    async def _handle(self, path: str, stream: rpc.Stream) -> None:
        types = messages.method_types(path)
        if types is not None and types.cardinality is Cardinality.UNARY_STREAM:
            await stream.recv_message()
            await stream.send_initial_metadata()
            await trio.sleep_forever()  # no recorded events to send; until the caller leaves
        requests = []
        while (request := await stream.recv_message()) is not None:
            requests.append(request)
        record = self.answers.answer(path, requests[0] if requests else b"")
        if record is None:
            log.warning(LOGGER, "not_in_trace", method=path)
            raise GRPCError(Status.UNIMPLEMENTED, f"{path} is not in the trace")
        log.debug(LOGGER, "answered", method=path, record=record.number)
        if self.timing and record.backend_seconds > 0:
            await trio.sleep(record.backend_seconds)
        if record.status is not Status.OK:
            raise GRPCError(record.status, record.message)
        if record.reply is not None:
            await stream.send_message(record.reply)
