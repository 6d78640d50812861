"""NRI's event bits: the mask a plugin subscribes with (``Configure``'s answer)."""

from __future__ import annotations

from collections.abc import Iterable

from krproxy.proto.nri.pkg.api import v1alpha1 as api


def event_mask(events: Iterable[api.Event]) -> int:
    """NRI's event mask: bit ``e - 1`` for each event ``e``."""
    mask = 0
    for event in events:
        mask |= 1 << (event - 1)
    return mask


def all_events() -> int:
    """Every valid event (``ValidEvents`` in NRI)."""
    return (1 << (api.Event.LAST - 1)) - 1
