"""krproxy.log.configure: our events at the level asked for, libraries' chatter not."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from krproxy import log


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    hpack_level = logging.getLogger("hpack").level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.getLogger("hpack").setLevel(hpack_level)


def test_debug_shows_our_events_but_not_hpacks_per_field_lines(restore_logging: None) -> None:
    """At debug level (`-v`) our debug events are written, hpack's one line per decoded header
    field (the relay decodes every request's headers with it) is not."""
    out = io.StringIO()
    log.configure("debug", stream=out)
    log.event(logging.getLogger("krproxy.test"), "ours", level=logging.DEBUG)
    logging.getLogger("hpack.hpack").debug("Decoded %s", "(b'te', b'trailers')")
    assert "event=ours" in out.getvalue()
    assert "Decoded" not in out.getvalue()
