"""krproxy.log's level-named calls: debug(), warning() and error() are event() at that level."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from krproxy import log


@pytest.fixture
def out() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    hpack_level = logging.getLogger("hpack").level
    stream = io.StringIO()
    log.configure("debug", fmt="json", stream=stream)
    yield stream
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.getLogger("hpack").setLevel(hpack_level)


@pytest.mark.parametrize(
    ("call", "level"), [(log.debug, "debug"), (log.warning, "warning"), (log.error, "error")]
)
def test_each_logs_its_event_and_fields_at_its_level(
    out: io.StringIO, call: Callable[..., None], level: str
) -> None:
    call(logging.getLogger("krproxy.test"), "plugin_failed", plugin="a", ms=1.5)
    line: dict[str, Any] = json.loads(out.getvalue())
    assert {"level": level, "logger": "krproxy.test", "event": "plugin_failed", "plugin": "a", "ms": 1.5} == {
        key: line[key] for key in ("level", "logger", "event", "plugin", "ms")
    }


def test_below_the_configured_level_nothing_is_written(out: io.StringIO) -> None:
    logging.getLogger().setLevel(logging.ERROR)
    log.debug(logging.getLogger("krproxy.test"), "quiet")
    log.warning(logging.getLogger("krproxy.test"), "quiet")
    log.error(logging.getLogger("krproxy.test"), "loud")
    assert ["loud"] == [json.loads(line)["event"] for line in out.getvalue().splitlines()]
