"""Structured logging: one line per event, ``key=value`` (default) or JSON.

Code logs events with :func:`event` (at INFO), or :func:`debug`, :func:`warning` and :func:`error`
for the other levels, naming the event and its fields::

    log.warning(LOGGER, "backend_unavailable", backend="/run/containerd.sock", error=str(err))

which renders as ``ts=2026-11-22T07:02:03.123Z level=warning logger=krproxy.forward
event=backend_unavailable backend=/run/containerd.sock error="..."``. A level known only at run time
goes to ``event(..., level=...)``. Plain ``LOGGER.info(msg)`` calls from libraries still render,
with their text as ``msg=``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

FORMATS = ("logfmt", "json")
LEVELS = ("debug", "info", "warning", "error")


def event(logger: logging.Logger, name: str, *, level: int = logging.INFO, **fields: Any) -> None:
    """Log the event ``name`` with ``fields`` at ``level``."""
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={"krproxy_fields": fields})


def debug(logger: logging.Logger, name: str, **fields: Any) -> None:
    """:func:`event` at DEBUG."""
    event(logger, name, level=logging.DEBUG, **fields)


def warning(logger: logging.Logger, name: str, **fields: Any) -> None:
    """:func:`event` at WARNING."""
    event(logger, name, level=logging.WARNING, **fields)


def error(logger: logging.Logger, name: str, **fields: Any) -> None:
    """:func:`event` at ERROR."""
    event(logger, name, level=logging.ERROR, **fields)


def _timestamp(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "ts": _timestamp(record),
        "level": record.levelname.lower(),
        "logger": record.name,
    }
    extra = getattr(record, "krproxy_fields", None)
    if extra is None:
        fields["msg"] = record.getMessage()
    else:
        fields["event"] = record.getMessage()
        fields.update(extra)
    if record.exc_info:
        fields["exc"] = logging.Formatter().formatException(record.exc_info)
    return fields


def _logfmt_value(value: Any) -> str:
    if isinstance(value, str):
        text = value
    elif value is None or isinstance(value, (bool, int, float, list, dict)):
        text = json.dumps(value, default=str)
    else:  # exceptions, paths, enums: their text, quoted once below if need be
        text = str(value)
    if text and text.isprintable() and not any(c in text for c in ' "=\\'):
        return text
    return json.dumps(text)


class LogfmtFormatter(logging.Formatter):
    """``key=value`` pairs; values with spaces, quotes or ``=`` are JSON-quoted."""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{key}={_logfmt_value(value)}" for key, value in _fields(record).items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), default=str)


def configure(level: str = "info", fmt: str = "logfmt", stream: Any = None) -> None:
    """Send all logging to ``stream`` (stderr) in ``fmt`` at ``level``, replacing earlier setup."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, not {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # hpack (the relay's header decoder) logs every header field at DEBUG, which would drown our
    # events at -v: it stays at WARNING whatever our level.
    logging.getLogger("hpack").setLevel(max(root.level, logging.WARNING))
