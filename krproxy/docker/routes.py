"""Which Docker Engine API requests carry hook points (koord-runtime-proxy's Docker router).

=====================================  =====================================================
request (optional ``/vX.Y`` prefix)    hook points
=====================================  =====================================================
``POST /containers/create``            PreRunPodSandbox (sandbox) or PreCreateContainer
``POST /containers/{ref}/start``       PreStartContainer, PostStartContainer
``POST /containers/{ref}/restart``     PreStartContainer, PostStartContainer (the container starts again)
``POST /containers/{ref}/stop``        PostStopContainer or PostStopPodSandbox
``POST /containers/{ref}/update``      PreUpdateContainerResources
``DELETE /containers/{ref}``           none: the store forgets the container (or the pod and its
                                       containers)
anything else                          none: forwarded unchanged
=====================================  =====================================================

``{ref}`` is any reference dockerd takes there: an id, a unique id prefix, a name, ``/`` included.

Pure: :func:`route` maps a request line to a :class:`Route` or None.
"""

from __future__ import annotations

import enum
import posixpath
import re
import urllib.parse

import attrs

__all__ = ["Action", "Route", "query_value", "route"]


class Action(enum.Enum):
    """What the proxy does with an intercepted request."""

    CREATE = "create"
    START = "start"
    RESTART = "restart"
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
#: dockerd's routes take any reference, ``/`` included (``/containers/{name:.*}/start``, ``DELETE
#: /containers/{name:.*}``): a legacy link's alias ``web/db`` is a container's name.
_ACTION = re.compile(rf"^{_VERSION}/containers/(.+)/(start|restart|stop|update)$")
_REMOVE = re.compile(rf"^{_VERSION}/containers/(.+)$")
_ACTIONS = {"start": Action.START, "restart": Action.RESTART, "stop": Action.STOP, "update": Action.UPDATE}


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

    Matched as dockerd matches it: on the percent-decoded path (``/containers/%63reate`` is create, ``%2F``
    in a reference a ``/``), and not at all where the path is not clean (``//``, ``.`` or ``..``
    segments), which dockerd answers with a redirect and nothing done."""
    path = urllib.parse.unquote(_split(target)[0])
    if _cleaned(path) != path:
        return None
    if method == b"POST":
        if _CREATE.match(path):
            return Route(Action.CREATE)
        found = _ACTION.match(path)
        if found:
            return Route(_ACTIONS[found.group(2)], found.group(1))
    elif method == b"DELETE":
        found = _REMOVE.match(path)
        if found:
            return Route(Action.REMOVE, found.group(1))
    return None


def _cleaned(path: str) -> str:
    """*path* as Go's ``path.Clean`` makes it, its trailing slash kept (gorilla/mux's ``cleanPath``)."""
    cleaned = "/" + posixpath.normpath(path).lstrip("/")
    if path.endswith("/") and cleaned != "/":
        cleaned += "/"
    return cleaned


def query_value(target: bytes, name: str) -> str:
    """The first value of query parameter *name* in a request-target, or ``""``."""
    values = urllib.parse.parse_qs(_split(target)[1]).get(name)
    return values[0] if values else ""
