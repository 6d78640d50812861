"""Which Docker Engine API requests carry hook points (koord-runtime-proxy's Docker router).

=====================================  =====================================================
request (optional ``/vX.Y`` prefix)    hook points
=====================================  =====================================================
``POST /containers/create``            PreRunPodSandbox (sandbox) or PreCreateContainer
``POST /containers/{id}/start``        PreStartContainer, PostStartContainer
``POST /containers/{id}/stop``         PostStopContainer or PostStopPodSandbox
``POST /containers/{id}/update``       PreUpdateContainerResources
``DELETE /containers/{id}``            none: the store forgets the container (or the pod and its
                                       containers)
anything else                          none: forwarded unchanged
=====================================  =====================================================

Pure: :func:`route` maps a request line to a :class:`Route` or None.
"""

from __future__ import annotations

import enum
import re
import urllib.parse

import attrs

__all__ = ["Action", "Route", "query_value", "route"]


class Action(enum.Enum):
    """What the proxy does with an intercepted request."""

    CREATE = "create"
    START = "start"
    STOP = "stop"
    UPDATE = "update"
    REMOVE = "remove"


@attrs.frozen
class Route:
    """An intercepted request: the action and the container id (or name) in its path (``""`` for create)."""

    action: Action
    container: str = ""


#: dockerd's router (gorilla/mux, ``/v{version:[0-9.]+}``) takes any digits and dots: ``1.41.0`` and ``01.41``
#: compare equal to 1.41, ``1.41.`` too.
_VERSION = r"(?:/v[0-9.]+)?"
_CREATE = re.compile(rf"^{_VERSION}/containers/create$")
_ACTION = re.compile(rf"^{_VERSION}/containers/([^/]+)/(start|stop|update)$")
_REMOVE = re.compile(rf"^{_VERSION}/containers/([^/]+)$")
_ACTIONS = {"start": Action.START, "stop": Action.STOP, "update": Action.UPDATE}


def _split(target: bytes) -> tuple[str, str]:
    """The path and query of a request-target as Go's ``url.ParseRequestURI`` reads them: an origin-form
    target (``/...``, even ``//host/...``) is a path up to ``?``; else an absolute URL."""
    text = target.decode("latin-1")
    if text.startswith("/"):
        path, _, query = text.partition("?")
        return path, query
    parsed = urllib.parse.urlsplit(text)
    return parsed.path, parsed.query


def route(method: bytes, target: bytes) -> Route | None:
    """The route of a request (method and request-target as sent), or None to forward it unchanged.

    Matched as dockerd matches it: on the percent-decoded path (``/containers/%63reate`` is create;
    ``%2F`` in an id is a ``/``, which no route takes)."""
    path = urllib.parse.unquote(_split(target)[0])
    if method == b"POST":
        if _CREATE.match(path):
            return Route(Action.CREATE)
        found = _ACTION.match(path)
        if found:
            return Route(_ACTIONS[found.group(2)], found.group(1))
    elif method == b"DELETE":
        found = _REMOVE.match(path)
        if found and found.group(1) not in ("create", "prune", "json"):
            return Route(Action.REMOVE, found.group(1))
    return None


def query_value(target: bytes, name: str) -> str:
    """The first value of query parameter *name* in a request-target, or ``""``."""
    values = urllib.parse.parse_qs(_split(target)[1]).get(name)
    return values[0] if values else ""
