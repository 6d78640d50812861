"""The HTTP/2 core (krproxy.h2) does no I/O: neither it nor anything it imports — package
``__init__``s included, which Python runs first — imports a socket, event loop, clock or thread
module; and krproxy.h2 and krproxy.relay have no import cycle inside them."""

from __future__ import annotations

import ast
import functools

import pytest

from tests.unit.test_import_graph import ROOT, _imports, find_cycle, import_graph

#: What a sans-I/O module may not import, directly or through another krproxy module.
FORBIDDEN = frozenset(("socket", "selectors", "trio", "anyio", "asyncio", "time", "threading"))


@functools.cache
def _graph(type_checking: bool = False) -> dict[str, set[str]]:
    return import_graph(type_checking=type_checking)


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """``start`` and every krproxy module its import runs, the parent packages of each included."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # its packages' __init__s
        todo += graph.get(module, ())
    return seen


def _external(module: str) -> set[str]:
    """Top-level names of what ``module`` imports from outside krproxy (lazy imports too)."""
    path = ROOT.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = _imports(ast.parse(path.read_text()), package)
    return {name.split(".")[0] for name in names if not name.startswith("krproxy")}


def forbidden_imports(start: str) -> dict[str, set[str]]:
    graph = _graph()
    found = {m: _external(m) & FORBIDDEN for m in sorted(_reached(graph, start))}
    return {m: names for m, names in found.items() if names}


@pytest.mark.parametrize("module", ["krproxy.h2.connection", "krproxy.h2.events", "krproxy.h2.frames"])
def test_the_http2_core_imports_no_socket_loop_clock_or_thread(module: str) -> None:
    assert {} == forbidden_imports(module)


def test_the_check_sees_an_io_import_through_a_package_init() -> None:
    """The checker itself: the relay's Endpoint is reached through krproxy.relay's __init__."""
    found = forbidden_imports("krproxy.relay.rpc")
    assert {"socket", "trio", "time"} <= found["krproxy.relay.connection"]
    assert {"trio", "threading"} <= found["krproxy.relay._input"]  # its reader decodes blocks in threads


@pytest.mark.parametrize(
    ("package", "type_checking"),
    [("krproxy.h2", False), ("krproxy.h2", True), ("krproxy.relay", False)],
    ids=["h2-run", "h2-type-checker", "relay-run"],
)
def test_no_import_cycle_inside(package: str, type_checking: bool) -> None:
    """No cycle inside the core, counting the imports made only for the type checker too; none
    inside the transport at run time. The transport's parts name each other's concrete classes in
    annotations (a connection its transport, a half its connection), as any one package may
    (test_import_graph), rather than each declaring a Protocol of what it needs of the others."""
    graph = _graph(type_checking=type_checking)
    inside = {m: {t for t in ts if t.startswith(package)} for m, ts in graph.items() if m.startswith(package)}
    assert [] == find_cycle(inside)
