"""One CRI call as the proxy handled it: collected while it runs, handed to observers after.

The relay opens a :class:`CallContext` for every call with hook points and makes it current
(a ``ContextVar``: each such call runs in a task of its own, one call at a time, so contexts never mix). Code on
the call's path adds to it — the dispatcher the hook outcomes, the relay the bytes it sent to
the runtime and the time the runtime took. When the call ends, the relay freezes
it into a :class:`CallRecord` and passes that to every observer (metrics, the recorder).

Observers run on the request path: they must be quick and must not block or raise.
"""

from __future__ import annotations

import contextvars
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from krproxy import log
from krproxy.grpcstatus import Status

if TYPE_CHECKING:  # the hook machinery, which a call record only holds outcomes of
    from krproxy.hooks.outcomes import Outcome


@attrs.define
class CallContext:
    """What is known about the current call so far."""

    path: str
    request: bytes = b""
    forwarded: bytes | None = None
    backend_seconds: float = 0.0
    hooks: list[Outcome] = attrs.field(factory=list)
    status: Status = Status.OK
    message: str | None = None
    reply: bytes | None = None
    replies: int = 0
    #: The caller's deadline (trio time; ``inf`` when it sent none): what this call does on its
    #: own account (plugin calls) must end by then, as the forward does.
    deadline: float = math.inf
    started: float = attrs.field(factory=time.time)
    _clock_start: float = attrs.field(factory=time.perf_counter)

    def fail(self, status: Status, message: str | None) -> None:
        self.status, self.message = status, message

    def finish(self) -> CallRecord:
        return CallRecord(
            path=self.path,
            started=self.started,
            seconds=time.perf_counter() - self._clock_start,
            backend_seconds=self.backend_seconds,
            request=self.request,
            forwarded=self.forwarded,
            reply=self.reply,
            replies=self.replies,
            status=self.status,
            message=self.message,
            hooks=tuple(self.hooks),
        )


@attrs.frozen
class CallFacts:
    """What is recorded of a finished call: the fields a :class:`CallRecord` and a trace's
    :class:`krproxy.trace.format.TraceRecord` share (each adds its own ``hooks``).

    Attributes:
        path: the gRPC method path, e.g. ``/runtime.v1.RuntimeService/Version``.
        started: wall-clock start, seconds since the epoch.
        seconds: total time in the proxy, backend time included.
        backend_seconds: time spent waiting for the runtime.
        request: the request as the caller sent it (the first message, for streams; empty for
            calls relayed as raw streams).
        forwarded: the request as sent to the runtime, if hooks changed it; else None.
        reply: the reply (unary calls that succeeded); None otherwise.
        replies: how many reply messages were relayed (streams: only this is recorded).
        status: the status the caller got.
        message: the status message the caller got, if any.
    """

    path: str
    started: float
    seconds: float
    backend_seconds: float
    request: bytes
    forwarded: bytes | None
    reply: bytes | None
    replies: int
    status: Status
    message: str | None


@attrs.frozen
class CallRecord(CallFacts):
    """A finished call, as the proxy handed it to its observers.

    Attributes:
        hooks: every plugin call made for this CRI call, in order.
    """

    hooks: tuple[Outcome, ...]


Observer = Callable[[CallRecord], None]

LOGGER = logging.getLogger("krproxy.calls")


def log_call(record: CallRecord) -> None:
    """Observer: at debug level (``krproxy serve --log-level debug``), one line per finished call."""
    if LOGGER.isEnabledFor(logging.DEBUG):
        log.debug(
            LOGGER,
            "call",
            method=record.path,
            code=record.status.name,
            ms=round(record.seconds * 1000, 3),
            backend_ms=round(record.backend_seconds * 1000, 3),
            hooks=len(record.hooks),
        )


#: The call being handled by the current asyncio task, if any.
CURRENT: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar("krproxy_call", default=None)


def current_deadline() -> float | None:
    """The current call's deadline (trio time), None outside a call or when it has none."""
    ctx = CURRENT.get()
    return None if ctx is None or ctx.deadline == math.inf else ctx.deadline


def add_hook_outcome(outcome: Outcome) -> None:
    """Attach a plugin call to the current CRI call, if there is one."""
    ctx = CURRENT.get()
    if ctx is not None:
        ctx.hooks.append(outcome)
