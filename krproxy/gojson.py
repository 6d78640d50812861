"""JSON read as Go's ``encoding/json`` reads it, where a Go program reads the same bytes beside krproxy.

Three places need it: a registration file, which koord-runtime-proxy unmarshals into its
``RuntimeHookConfig`` (:mod:`krproxy.hooks.registration`); a Docker API body, which dockerd decodes
into its structs (:mod:`krproxy.docker`); Koordinator's resource-status annotation, which koordlet
reads beside the SDK's cpuset policy (:mod:`krproxy.hookserver.policies.cpuset`). Python's ``json``
and Go's differ where it matters to them:

- Go matches an object's key to a struct field by Unicode simple folding (``Failure-Policy``,
  ``FAILURE-POLICY`` and ``failure-poliſy``-like spellings are the field), and decodes every key that
  matches in turn, so the last one wins (a ``null`` leaves a string field as it was): :func:`fold_name`,
  and :class:`Object`, which keeps every member in order where a ``dict`` keeps one per key;
- Go reads the bytes as UTF-8, each invalid byte a U+FFFD, and refuses a byte order mark, ``NaN`` and
  ``Infinity``, where ``json.loads`` of bytes guesses UTF-16 or UTF-32, takes a BOM and reads the
  constants: :func:`loads`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["Object", "fold_name", "loads"]


def fold_name(key: str) -> str:
    """*key* folded as Go's ``encoding/json`` matches it to a struct field's ASCII name: by Unicode simple
    folding, under which ``ſ`` (U+017F) is an ``s`` and the Kelvin sign a ``k`` (``lower()`` folds the
    latter already, and no other character lowers to ASCII)."""
    return key.lower().replace("\u017f", "s")


class Object(dict[str, Any]):
    """A JSON object as read: a ``dict`` (the last value of each key, as Python reads it) that also keeps
    :attr:`members`, every ``(key, value)`` in document order, each key as often as it came."""

    __slots__ = ("members",)

    def __init__(self, members: list[tuple[str, Any]]) -> None:
        super().__init__(members)
        self.members = members


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def loads(content: bytes, object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] = Object) -> Any:
    """*content* read as Go reads JSON, each object what *object_pairs_hook* makes of its members (an
    :class:`Object`). Raises ``ValueError`` (``json.JSONDecodeError`` for the syntax) and
    ``RecursionError`` (nested too deeply for Python)."""
    text = content.decode("utf-8", "replace")
    return json.loads(text, object_pairs_hook=object_pairs_hook, parse_constant=_no_constant)
