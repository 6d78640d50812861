"""What plugin calls did: value types shared by the dispatcher, call records, metrics and traces.

Pure (attrs only): metrics, trace files and call records read these without importing the
dispatcher or the relay that makes the calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

import attrs

from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks.merge import Change
from krproxy.hooks.points import HookPoint
from krproxy.hooks.required import Availability, missing_message

__all__ = ["ChainResult", "HookFailure", "HookRejected", "Outcome", "RequiredFailed", "RequiredMissing"]

Record = TypeVar("Record")


@attrs.frozen
class HookFailure:
    """One failed plugin call."""

    plugin: str
    point: HookPoint
    cause: str

    def describe(self) -> str:
        return f"hook server {self.plugin} failed {self.point.value}: {self.cause}"


class HookRejected(GRPCError):
    """A ``Fail`` plugin failed a pre hook: the CRI call is refused and nothing is forwarded.

    The status is UNKNOWN, as koord-runtime-proxy answers (its message starts with
    ``hook server err:`` too), so kubelet and tooling see the same thing from either proxy.
    """

    def __init__(self, failure: HookFailure) -> None:
        super().__init__(Status.UNKNOWN, f"hook server err: {failure.describe()}")
        self.failure = failure


class RequiredFailed(GRPCError):
    """A required hook server (:mod:`krproxy.hooks.required`) failed a pre hook: the CRI call is refused
    with UNAVAILABLE, which kubelet retries, and nothing is forwarded (whatever the file's failure policy)."""

    def __init__(self, failure: HookFailure) -> None:
        super().__init__(
            Status.UNAVAILABLE,
            f"required {failure.describe()}; the call was not forwarded to the runtime, "
            "kubelet's retry goes through once the hook server answers",
        )
        self.failure = failure


class RequiredMissing(GRPCError):
    """A call needs required hook servers that are not up: refused with UNAVAILABLE, nothing forwarded."""

    def __init__(self, point: HookPoint, missing: Sequence[tuple[str, Availability]]) -> None:
        super().__init__(Status.UNAVAILABLE, missing_message(point, missing))
        self.point = point
        self.missing = tuple(missing)


@attrs.frozen
class Outcome:
    """What one plugin call did, for logs, metrics and traces."""

    plugin: str
    point: HookPoint
    result: str  # "ok" | "failed" | "rejected"
    seconds: float
    detail: str = ""
    changes: tuple[Change, ...] = ()


@attrs.frozen
class ChainResult(Generic[Record]):
    """The record after every plugin had its turn, and what each call did."""

    value: Record
    outcomes: tuple[Outcome, ...]
