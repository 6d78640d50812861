"""What a fake was told to do wrong, and for how many calls: the fake containerd's faults and the fake
plugin's misbehaviours are kept alike, as ``{key: (what, calls left or None for every call)}``."""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def take(armed: dict[K, tuple[V, int | None]], key: K) -> V | None:
    """What is armed under *key* for this call (None: nothing), counting the call: the entry goes with
    its last call; one armed with None stays until the fake is told to behave."""
    entry = armed.get(key)
    if entry is None:
        return None
    what, left = entry
    if left is not None:
        if left <= 1:
            del armed[key]
        else:
            armed[key] = (what, left - 1)
    return what
