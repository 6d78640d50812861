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


_VERSION = r"(?:/v\d+\.\d+)?"
_CREATE = re.compile(rf"^{_VERSION}/containers/create$")
_ACTION = re.compile(rf"^{_VERSION}/containers/([^/]+)/(start|stop|update)$")
_REMOVE = re.compile(rf"^{_VERSION}/containers/([^/]+)$")
_ACTIONS = {"start": Action.START, "stop": Action.STOP, "update": Action.UPDATE}


def route(method: bytes, target: bytes) -> Route | None:
    """The route of a request (method and request-target as sent), or None to forward it unchanged."""
    parsed = urllib.parse.urlsplit(target.decode("latin-1"))
    path = parsed.path
    if method == b"POST":
        if _CREATE.match(path):
            return Route(Action.CREATE)
        found = _ACTION.match(path)
        if found:
            return Route(_ACTIONS[found.group(2)], urllib.parse.unquote(found.group(1)))
    elif method == b"DELETE":
        found = _REMOVE.match(path)
        if found and found.group(1) not in ("create", "prune", "json"):
            return Route(Action.REMOVE, urllib.parse.unquote(found.group(1)))
    return None


def query_value(target: bytes, name: str) -> str:
    """The first value of query parameter *name* in a request-target, or ``""``."""
    values = urllib.parse.parse_qs(urllib.parse.urlsplit(target.decode("latin-1")).query).get(name)
    return values[0] if values else ""
