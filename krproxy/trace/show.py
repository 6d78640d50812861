"""``krproxy trace show``: list recorded calls, filtered, as a table or as JSON lines.

Messages are decoded here, offline. Pods and containers are named from the trace itself: a
RunPodSandbox (CreateContainer) record tells which ``namespace/name`` (container name) the
sandbox (container) ID it returned belongs to, so later calls can be filtered by name too.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs
import betterproto2

from krproxy.trace import messages
from krproxy.trace.format import TraceRecord


def parse_time(text: str) -> float:
    """Seconds since the epoch from ISO 8601 (UTC unless it names a zone) or a plain number.

    Raises:
        ValueError: neither.
    """
    try:
        return float(text)
    except ValueError:
        pass
    when = datetime.datetime.fromisoformat(text)
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp()


def format_time(seconds: float) -> str:
    """``2024-05-01T10:00:00.123Z`` (UTC, milliseconds)."""
    when = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"


@attrs.frozen
class Call:
    """A record with its messages decoded and its subjects resolved."""

    record: TraceRecord
    request: Any
    forwarded: Any
    reply: Any
    pod_id: str
    container_id: str
    pod: str
    container: str


@attrs.frozen
class Filter:
    """Which calls to list; every given criterion must match.

    ``method`` matches the short name or the full path, case-insensitively; ``pod`` an ID
    prefix, ``namespace/name`` or name; ``container`` an ID prefix or name.
    """

    methods: tuple[str, ...] = ()
    pod: str = ""
    container: str = ""
    since: float | None = None
    until: float | None = None

    def matches(self, call: Call) -> bool:
        record = call.record
        if self.methods and not any(
            m.lower() in (record.method.lower(), record.path.lower()) for m in self.methods
        ):
            return False
        if self.pod and not _names(self.pod, call.pod_id, call.pod, call.pod.partition("/")[2]):
            return False
        if self.container and not _names(self.container, call.container_id, call.container):
            return False
        if self.since is not None and record.started < self.since:
            return False
        return not (self.until is not None and record.started > self.until)


def _names(wanted: str, ident: str, *names: str) -> bool:
    return bool(ident and ident.startswith(wanted)) or any(n and n == wanted for n in names)


def decode_calls(records: Iterable[TraceRecord]) -> Iterator[Call]:
    """Decode every record, naming pods and containers from earlier Run/Create records."""
    pods: dict[str, str] = {}
    containers: dict[str, str] = {}
    pod_of: dict[str, str] = {}  # container ID -> sandbox ID
    for record in records:
        request = messages.decode(record.path, record.request)
        forwarded = messages.decode(record.path, record.forwarded)
        reply = messages.decode(record.path, record.reply, reply=True)
        ids = messages.subjects(request, reply)
        if ids.pod_sandbox_id and (name := messages.pod_name(request)):
            pods[ids.pod_sandbox_id] = name
        if ids.container_id and (name := messages.container_name(request)):
            containers[ids.container_id] = name
            pod_of[ids.container_id] = ids.pod_sandbox_id
        pod_id = ids.pod_sandbox_id or pod_of.get(ids.container_id, "")
        yield Call(
            record=record,
            request=request,
            forwarded=forwarded,
            reply=reply,
            pod_id=pod_id,
            container_id=ids.container_id,
            pod=pods.get(pod_id, ""),
            container=containers.get(ids.container_id, ""),
        )


def readable(message: betterproto2.Message) -> messages.Plain:
    """:func:`~krproxy.trace.messages.to_plain` for a person: a bytes field that is UTF-8 shows as its
    text, other bytes as text with ``\\xNN`` escapes, where proto3's JSON mapping (``to_plain``, ``trace
    show --json``) gives base64.

    CRI's env values are bytes (``KeyValue.value``): ``MODE=trace`` read ``"dHJhY2U="`` in ``trace show
    -d``. Nothing here reads the result back; ``--json`` keeps the mapping tools can decode.
    """
    plain = messages.to_plain(message)
    _readable_bytes(message, plain)
    return plain


def _readable_bytes(message: betterproto2.Message, plain: messages.Plain) -> None:
    """Replace, in *plain* (``message``'s ``to_plain``), every bytes value by its text."""
    for field in dataclasses.fields(message):  # type: ignore[arg-type]  # betterproto2 messages are dataclasses
        if field.name not in plain:
            continue
        value = getattr(message, field.name)
        if isinstance(value, list):
            plain[field.name] = [_readable(v, p) for v, p in zip(value, plain[field.name], strict=True)]
        elif isinstance(value, dict):
            # to_dict keeps the map's order (its keys may be strings of int keys)
            plain[field.name] = {
                key: _readable(v, p)
                for v, (key, p) in zip(value.values(), plain[field.name].items(), strict=True)
            }
        else:
            plain[field.name] = _readable(value, plain[field.name])


def _readable(value: Any, plain: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, betterproto2.Message):
        _readable_bytes(value, plain)
    return plain


def _hook_summary(record: TraceRecord) -> str:
    parts = []
    for hook in record.hooks:
        changes = (
            f" {len(hook.changes)} change{'s' if len(hook.changes) != 1 else ''}" if hook.changes else ""
        )
        parts.append(f"{hook.plugin}:{hook.point}={hook.result}{changes}")
    return ", ".join(parts)


def _short(ident: str) -> str:
    return ident[:13]


def _status(record: TraceRecord) -> str:
    if record.status.name == "OK":
        return "OK"
    message = (record.message or "").replace("\n", " ")
    if len(message) > 40:
        message = message[:37] + "..."
    return f"{record.status.name} {message}".rstrip()


COLUMNS = ("#", "started (UTC)", "method", "ms", "backend", "status", "pod", "container", "hooks")


def table_rows(calls: Iterable[Call]) -> Iterator[tuple[str, ...]]:
    for call in calls:
        r = call.record
        yield (
            str(r.number),
            format_time(r.started),
            r.method + ("" if messages.method_types(r.path) else f" ({r.path})"),
            f"{r.seconds * 1000:.1f}",
            f"{r.backend_seconds * 1000:.1f}",
            _status(r),
            call.pod or _short(call.pod_id),
            call.container or _short(call.container_id),
            _hook_summary(r),
        )


def render_table(calls: Iterable[Call]) -> list[str]:
    """A plain-text table, one line per call, columns padded to fit."""
    rows = [COLUMNS, *table_rows(calls)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    right = {0, 3, 4}
    lines = []
    for row in rows:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def render_details(call: Call) -> list[str]:
    """Indented lines under a table row: hook changes and the decoded messages."""
    lines = []
    for hook in call.record.hooks:
        lines.append(
            f"    hook {hook.plugin} {hook.point}: {hook.result} in {hook.seconds * 1000:.1f} ms {hook.detail}".rstrip()
        )
        lines.extend(f"      {c.field}: {json.dumps(c.old)} -> {json.dumps(c.new)}" for c in hook.changes)
    for label, message in (("request", call.request), ("forwarded", call.forwarded), ("reply", call.reply)):
        if message is not None:
            lines.append(f"    {label}: {json.dumps(readable(message), sort_keys=True)}")
    if call.record.reply is None and call.record.replies:
        lines.append(f"    replies: {call.record.replies} stream messages (not recorded)")
    return lines


def to_json(call: Call) -> dict[str, Any]:
    """One call as a JSON object (what ``--json`` prints, one per line)."""
    r = call.record
    out: dict[str, Any] = {
        "record": r.number,
        "method": r.path,
        "started": format_time(r.started),
        "started_unix": r.started,
        "seconds": r.seconds,
        "backend_seconds": r.backend_seconds,
        "status": r.status.name,
        "status_code": r.status.value,
        "message": r.message,
        "pod_sandbox_id": call.pod_id or None,
        "pod": call.pod or None,
        "container_id": call.container_id or None,
        "container": call.container or None,
        "replies": r.replies,
        "hooks": [h.to_json() for h in r.hooks],
    }
    for label, raw, message in (
        ("request", r.request, call.request),
        ("forwarded", r.forwarded, call.forwarded),
        ("reply", r.reply, call.reply),
    ):
        if message is not None:
            out[label] = messages.to_plain(message)
        elif raw is not None and (raw or label == "request"):
            out[label] = None
            out[f"{label}_hex"] = raw.hex()
        else:
            out[label] = None
    return out


def show(
    records: Sequence[TraceRecord], selection: Filter, *, as_json: bool = False, details: bool = False
) -> Iterator[str]:
    """The lines ``trace show`` prints."""
    calls = [c for c in decode_calls(records) if selection.matches(c)]
    if as_json:
        for call in calls:
            yield json.dumps(to_json(call), sort_keys=True)
        return
    header, *rows = render_table(calls)
    yield header
    for call, row in zip(calls, rows, strict=True):
        yield row
        if details:
            yield from render_details(call)
