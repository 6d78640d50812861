"""``krproxy trace replay``: send recorded requests again and compare the answers.

The replay acts as the recorded caller (kubelet): it sends each recorded request, in the order
the calls started, to a target (a krproxy or a runtime), and compares the target's answer —
status, status message, reply — to the recorded one. IDs the target assigns are learnt from
its replies and substituted into later requests; volatile fields are normalised on both
sides (see :mod:`krproxy.trace.messages`).

Calls that cannot be sent as one request and one reply — server streams such as
GetContainerEvents, methods our protos do not know (relayed as raw streams, their messages
not recorded) — are skipped and counted.

:func:`replay` is synchronous and takes its transport as an argument: tests drive it with a
fake one, the CLI with :class:`ChannelTransport` (a :class:`krproxy.rpc.Channel`, raw bytes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import trio

from krproxy.grpcstatus import GRPCError, Status
from krproxy.trace import messages
from krproxy.trace.format import TraceRecord
from krproxy.trace.messages import Difference, IdMap

if TYPE_CHECKING:
    from krproxy.rpc import Channel


@attrs.frozen
class Answer:
    """What the target answered to one request."""

    status: Status
    message: str | None
    reply: bytes | None


#: ``transport(path, request, timeout) -> Answer``: one unary call to the target.
Transport = Callable[[str, bytes, float], Answer]

#: What :func:`replay` can send of a record: the caller's request or the runtime's.
SENT = ("caller", "runtime")

#: ``progress(done, total, record)``: called before each call is sent.
Progress = Callable[[int, int, TraceRecord], None]


@attrs.frozen
class CallResult:
    """One recorded call and how its replay went.

    Attributes:
        record: the recorded call.
        answer: the target's answer; None if the call was skipped.
        differences: where the answer differs from the recording (empty: identical).
        skipped: why the call was not sent, if it was not.
    """

    record: TraceRecord
    answer: Answer | None
    differences: tuple[Difference, ...] = ()
    skipped: str = ""


@attrs.frozen
class ReplayReport:
    """Every call's result, in replay order."""

    results: tuple[CallResult, ...]
    ids: dict[str, str]

    @property
    def identical(self) -> int:
        return sum(1 for r in self.results if not r.skipped and not r.differences)

    @property
    def different(self) -> int:
        return sum(1 for r in self.results if r.differences)

    @property
    def skipped(self) -> int:
        return sum(1 for r in self.results if r.skipped)

    @property
    def ok(self) -> bool:
        return self.different == 0

    def summary(self) -> str:
        return (
            f"{len(self.results)} calls: {self.identical} identical, {self.different} different, "
            f"{self.skipped} skipped; {len(self.ids)} ids mapped"
        )

    def lines(self) -> Iterator[str]:
        """The readable report: one block per differing call, then the summary."""
        for result in self.results:
            if not result.differences:
                continue
            r = result.record
            yield f"call #{r.number} {r.path}: {len(result.differences)} difference(s)"
            for difference in result.differences:
                yield f"    {difference.describe()}"
        skipped: dict[str, int] = {}
        for result in self.results:
            if result.skipped:
                skipped[result.skipped] = skipped.get(result.skipped, 0) + 1
        for reason, count in sorted(skipped.items()):
            yield f"skipped {count}: {reason}"
        yield ("OK " if self.ok else "MISMATCH ") + self.summary()


def replay_order(records: Iterable[TraceRecord]) -> list[TraceRecord]:
    """Records in the order their calls started (a trace holds them in the order they ended)."""
    return sorted(records, key=lambda r: r.started)


def _reply_side(raw: bytes | None, decoded: Any, back: dict[str, str], volatile: frozenset[str]) -> Any:
    if raw is None:
        return None
    if decoded is None:
        return {"undecodable_hex": raw.hex()}
    return messages.normalise(messages.to_plain(decoded), back, volatile, type(decoded))


def compare(
    record: TraceRecord, answer: Answer, ids: IdMap, volatile: frozenset[str] = messages.VOLATILE
) -> tuple[Difference, ...]:
    """Where ``answer`` differs from the recorded outcome of ``record`` (after learning its IDs).

    Lists whose order the runtime does not define (:data:`krproxy.trace.messages.UNORDERED`)
    are compared as multisets, so a runtime listing the same images in another order is no
    difference.
    """
    recorded_reply = messages.decode(record.path, record.reply, reply=True)
    actual_reply = messages.decode(record.path, answer.reply, reply=True)
    ids.learn(recorded_reply, actual_reply)
    back = ids.reverse()
    types = messages.method_types(record.path)
    pairs: list[tuple[str, Any, Any, Any]] = [
        ("status", record.status.name, answer.status.name, None),
        ("message", record.message or None, messages.normalise_text(answer.message, back) or None, None),
        (
            "reply",
            _reply_side(record.reply, recorded_reply, {}, volatile),
            _reply_side(answer.reply, actual_reply, back, volatile),
            types.reply if types is not None else None,
        ),
    ]
    return tuple(messages.all_differences(pairs))


def replay(
    records: Sequence[TraceRecord],
    transport: Transport,
    *,
    timing: bool = False,
    speed: float = 1.0,
    timeout: float = 30.0,
    volatile: frozenset[str] = messages.VOLATILE,
    send: str = "caller",
    progress: Progress | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> ReplayReport:
    """Replay ``records`` through ``transport``; see the module docstring.

    Args:
        timing: keep the recorded gaps between call starts (divided by ``speed``); calls are
            still sent one at a time, so a slow target only delays what follows.
        timeout: deadline of each call, in seconds.
        volatile: field names normalised before comparing.
        send: which recorded request to send. ``"caller"``: what the caller (kubelet) sent, for
            a target that is a krproxy, which adds its own fields and its hooks' changes again.
            ``"runtime"``: what the runtime received (:attr:`TraceRecord.runtime_request`), for a
            trace recorded at a proxy and replayed straight at a runtime; sending the caller's
            request there leaves out what krproxy added (an empty ``linux.resources``, the hooks'
            changes), and later answers (ContainerStatus) differ for that alone.
    """
    if send not in SENT:
        raise ValueError(f"send must be one of {', '.join(SENT)}, not {send!r}")
    ordered = replay_order(records)
    ids = IdMap()
    results: list[CallResult] = []
    first = ordered[0].started if ordered else 0.0
    began = clock()
    for done, record in enumerate(ordered):
        if progress is not None:
            progress(done, len(ordered), record)
        if not messages.is_replayable(record.path):
            why = "unknown method" if messages.method_types(record.path) is None else "streaming method"
            results.append(
                CallResult(record, None, skipped=f"{why} (not recorded as one request and one reply)")
            )
            continue
        if timing and speed > 0:
            wait = (record.started - first) / speed - (clock() - began)
            if wait > 0:
                sleep(wait)
        sent = record.runtime_request if send == "runtime" else record.request
        request = messages.rewrite_ids(record.path, sent, ids)
        answer = transport(record.path, request, timeout)
        results.append(CallResult(record, answer, compare(record, answer, ids, volatile)))
    if progress is not None and ordered:
        progress(len(ordered), len(ordered), ordered[-1])
    return ReplayReport(tuple(results), dict(ids.new))


class ChannelTransport:
    """A :data:`Transport` over a :class:`krproxy.rpc.Channel`, sending and receiving raw bytes.

    :func:`replay` is synchronous: run it in a worker thread of the trio run that owns the
    channel (``trio.to_thread.run_sync``); each call hops back onto trio for the channel.
    """

    def __init__(self, channel: Channel) -> None:
        self._channel = channel

    def __call__(self, path: str, request: bytes, timeout: float) -> Answer:
        return trio.from_thread.run(self.call, path, request, timeout)

    async def call(self, path: str, request: bytes, seconds: float) -> Answer:
        """One unary call with a deadline ``seconds`` from now; an error status is an answer too."""
        try:
            reply = await self._channel.unary(path, request, timeout=seconds)
        except GRPCError as err:
            return Answer(err.status, err.message or None, None)
        return Answer(Status.OK, None, reply)
