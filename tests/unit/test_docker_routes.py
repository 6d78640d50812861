"""krproxy.docker.routes: request lines routed as dockerd 20.10's gorilla/mux router routes them."""

from __future__ import annotations

import pytest

from krproxy.docker.routes import Action, Route, query_value, route


@pytest.mark.parametrize(
    "target",
    [
        b"/containers/create",
        b"/v1.41/containers/create",
        b"/v1.41.0/containers/create",
        b"/v1.41./containers/create",
        b"/v01.41/containers/create",
        b"/containers/%63reate?name=a",
        b"http://docker/containers/create",
    ],
)
def test_create_spellings(target: bytes) -> None:
    """Every spelling dockerd routes to create is a create."""
    assert Route(Action.CREATE) == route(b"POST", target)


@pytest.mark.parametrize(
    "target",
    [
        b"//docker/containers/create",
        b"/containers//create",
        b"/containers/create/",
        b"/Containers/create",
        b"/V1.41/containers/create",
    ],
)
def test_paths_dockerd_does_not_route(target: bytes) -> None:
    """Paths dockerd redirects (unclean) or does not find are not intercepted."""
    assert route(b"POST", target) is None


def test_escaped_id() -> None:
    """The container reference is read percent-decoded, as dockerd reads the path."""
    assert Route(Action.START, "abc") == route(b"POST", b"/v1.41.0/containers/%61bc/start")
    assert Route(Action.START, "a/b") == route(b"POST", b"/containers/a%2Fb/start")


@pytest.mark.parametrize(
    ("method", "target", "expected"),
    [
        (b"POST", b"/containers/web/db/start", Route(Action.START, "web/db")),
        (b"POST", b"/v1.41/containers/web/restart?t=0", Route(Action.RESTART, "web")),
        (b"POST", b"/containers/%72estart/restart", Route(Action.RESTART, "restart")),
        (b"POST", b"/v1.41/containers/a/stop/update", Route(Action.UPDATE, "a/stop")),
        (b"DELETE", b"/containers/web/db", Route(Action.REMOVE, "web/db")),
        (b"DELETE", b"/containers/json", Route(Action.REMOVE, "json")),
        (b"POST", b"/containers/a//start", None),
        (b"POST", b"/containers/./a/start", None),
        (b"DELETE", b"/containers/a/../b", None),
    ],
)
def test_references_as_dockerd_routes_them(method: bytes, target: bytes, expected: Route | None) -> None:
    """A reference is whatever dockerd's ``{name:.*}`` takes, ``/`` included (a legacy link's alias is a
    name); a path dockerd would clean (and redirect) is not intercepted."""
    assert expected == route(method, target)


def test_name_of_an_origin_form_target() -> None:
    """``?name=`` is read from the path's query even when the path starts with ``//``; the first wins."""
    assert "k" == query_value(b"//docker/containers/create?name=k&name=j", "name")
