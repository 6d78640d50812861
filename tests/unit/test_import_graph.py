"""krproxy's modules import each other without cycles (docs/architecture.md, "Layers"), and its
classes are composed, not spread over modules by inheritance ("The transport: who holds whom",
"The HTTP/2 core: who holds whom").

The graph is read from the source: an edge ``a -> b`` for every ``import b`` or ``from b import
x`` in ``a`` (``from package import module`` counts as an edge to the module), at any depth of
the module, lazy imports inside functions included; imports under ``if TYPE_CHECKING:`` are left
out, since they never run. A package's ``__init__`` is a node of its own; a submodule's implicit
import of its parent package (Python imports the parent first) is not an edge.
"""

from __future__ import annotations

import ast
import importlib
import os
import pathlib
from collections.abc import Collection, Iterable, Mapping

import attrs

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    tree: ast.AST, package: str, modules: Iterable[str] = (), *, type_checking: bool = False
) -> list[str]:
    """Absolute names of what ``tree`` (a module in ``package``) imports, TYPE_CHECKING left out.

    ``modules`` are the known module names, to tell ``from package import module`` from
    ``from module import name``. With ``type_checking``, imports for the type checker count too.
    """
    modules = set(modules)
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            # `from package import module` reaches the module; `from module import name` the module.
            found.extend(
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module
                for alias in node.names
            )
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(top: str = "krproxy", *, type_checking: bool = False) -> dict[str, set[str]]:
    """``module -> modules of ``top`` it imports``, for every module under ``top/``."""
    paths = sorted((ROOT / top).rglob("*.py"))
    modules = {_module_name(p): p for p in paths}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        targets = set(_imports(tree, package, modules, type_checking=type_checking))
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or ``[]`` when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_krproxy_has_no_import_cycle() -> None:
    """No module of krproxy/ reaches itself through its imports."""
    assert [] == find_cycle(import_graph())


def across_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` without the edges inside one package (``krproxy.relay.rpc -> krproxy.relay.relay``)."""

    def package(module: str) -> str:
        return module.rpartition(".")[0]

    return {m: {t for t in targets if package(t) != package(m)} for m, targets in graph.items()}


def test_no_cycle_across_packages_even_for_the_type_checker() -> None:
    """Counting the imports made only for the type checker too, no module reaches itself through
    another package: value types (calls, hooks.outcomes) sit below the machinery that makes them
    (hooks.dispatch, the relay). Inside one package, classes may name each other in annotations."""
    assert [] == find_cycle(across_packages(import_graph(type_checking=True)))


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The checker itself: a graph with a cycle reports it, from the first module on it."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert ["a", "b", "c", "a"] == find_cycle(graph)
    assert [] == find_cycle({"a": {"b"}, "b": set()})


def test_the_graph_sees_relative_and_lazy_imports() -> None:
    """Edges come from relative imports, from imports inside functions, and not from TYPE_CHECKING."""
    graph = import_graph()
    assert "krproxy.hookserver._service" in graph["krproxy.hookserver.cli"]  # relative
    assert "krproxy.demo" in graph["krproxy.cli"]  # lazy: `krproxy demo` only
    code = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import krproxy.relay\nimport krproxy.calls\n"
    assert "krproxy.relay" not in _imports(ast.parse(code), "krproxy")
    assert "krproxy.calls" in _imports(ast.parse(code), "krproxy")


#: The transport (docs/architecture.md, "The transport"): krproxy.rpc's faces hold it and use only
#: its public modules; it never imports them, not even for the type checker.
TRANSPORT, FACES = "krproxy.relay", "krproxy.rpc"


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def private_transport_imports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The private transport modules (``krproxy.relay._x``) each module outside the transport imports."""
    return {
        m: found
        for m, targets in graph.items()
        if not _in(m, TRANSPORT)
        and (found := {t for t in targets if _in(t, TRANSPORT) and t.rpartition(".")[2].startswith("_")})
    }


def test_the_rpc_faces_import_no_private_module_of_the_transport() -> None:
    """krproxy.rpc (Server, Channel, Stream) reaches the transport through its public modules only."""
    graph = import_graph(type_checking=True)
    faces = {m: ts for m, ts in private_transport_imports(graph).items() if _in(m, FACES)}
    assert {} == faces


def upward_imports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The krproxy.rpc modules each transport module imports."""
    upward = {m: {t for t in ts if _in(t, FACES)} for m, ts in graph.items() if _in(m, TRANSPORT)}
    return {m: ts for m, ts in upward.items() if ts}


def test_the_transport_imports_no_face_of_rpc() -> None:
    """The transport is below krproxy.rpc: none of its modules imports rpc, even for the type checker."""
    assert {} == upward_imports(import_graph(type_checking=True))


def test_the_layer_checks_see_a_private_import() -> None:
    """The checkers themselves: an import of a private transport module, and one upward, are found."""
    graph = {
        "krproxy.rpc.server": {"krproxy.relay._input", "krproxy.relay.transport"},
        "krproxy.relay.transport": {"krproxy.rpc.server"},
    }
    assert {"krproxy.rpc.server": {"krproxy.relay._input"}} == private_transport_imports(graph)
    assert {"krproxy.relay.transport": {"krproxy.rpc.server"}} == upward_imports(graph)
    assert not _in("krproxy.relayx", TRANSPORT)


#: Left out of :func:`krproxy_classes`.
NOT_WALKED = ("krproxy.proto",)  # generated code

#: Classes that may extend a krproxy class of another module: ``(class, base) -> why``.
INHERITANCE_ALLOWED: dict[tuple[str, str], str] = {
    ("krproxy.trace.format.TraceRecord", "krproxy.calls.CallFacts"): (
        "a data base: the frozen fields a finished call's record and a trace's record share, no methods"
    ),
}


def _package_modules(directory: pathlib.Path) -> list[pathlib.Path]:
    """The modules under *directory*, through symlinked packages too (``krproxy/fakes``), sorted."""
    found = []
    for parent, _dirs, files in os.walk(directory, followlinks=True):
        found.extend(pathlib.Path(parent, name) for name in files if name.endswith(".py"))
    return sorted(found)


def classes_of(paths: Iterable[pathlib.Path]) -> list[type]:
    """Every class defined in the modules at *paths* (imported to see their bases)."""
    found: list[type] = []
    for path in paths:
        module = importlib.import_module(_module_name(path))
        found.extend(
            value
            for value in vars(module).values()
            if isinstance(value, type) and value.__module__ == module.__name__
        )
    return found


def krproxy_classes() -> list[type]:
    """Every class of krproxy's modules but :data:`NOT_WALKED` (``__main__`` modules are not imported:
    they run their command)."""
    return classes_of(
        path
        for path in _package_modules(ROOT / "krproxy")
        if path.name != "__main__.py" and not any(_in(_module_name(path), p) for p in NOT_WALKED)
    )


def inherited_across_modules(classes: Iterable[type]) -> dict[str, list[str]]:
    """``class -> bases of krproxy's from another module`` (exceptions left out: an error type
    extends its family wherever it is raised; typing Protocols too: an interface is implemented, not
    inherited for its code)."""
    found: dict[str, list[str]] = {}
    for cls in classes:
        bases = [
            f"{base.__module__}.{base.__qualname__}"
            for base in cls.__mro__[1:]
            if base.__module__.startswith("krproxy")
            and base.__module__ != cls.__module__
            and not issubclass(base, BaseException)
            and not getattr(base, "_is_protocol", False)
        ]
        if bases:
            found[f"{cls.__module__}.{cls.__qualname__}"] = bases
    return found


def not_allowed(found: dict[str, list[str]]) -> dict[str, list[str]]:
    """*found* without the pairs of :data:`INHERITANCE_ALLOWED`."""
    left = {
        cls: [base for base in bases if (cls, base) not in INHERITANCE_ALLOWED]
        for cls, bases in found.items()
    }
    return {cls: bases for cls, bases in left.items() if bases}


def test_no_class_inherits_from_another_module() -> None:
    """No class of krproxy is spread over several files by inheritance: its parts are held, not
    subclassed (the NRI plugin holds its event handlers, a face of the transport its Transport, a call
    kind its CallState, the fake containerd's state its tables and calls); only the pairs of
    INHERITANCE_ALLOWED, each with its reason, extend a class of another module."""
    found = inherited_across_modules(krproxy_classes())
    assert {} == not_allowed(found)
    assert set(INHERITANCE_ALLOWED) <= {(cls, base) for cls, bases in found.items() for base in bases}


def test_the_walk_reaches_every_package() -> None:
    """The classes checked come from every part of krproxy, the symlinked fakes and the HTTP/2
    core included, and none from generated code."""
    modules = {cls.__module__ for cls in krproxy_classes()}
    for module in (
        "krproxy.nri.plugin",
        "krproxy.relay.transport",
        "krproxy.fakes.containerd.state",
        "krproxy.h2.connection",
    ):
        assert module in modules
    assert not [m for m in modules if _in(m, "krproxy.proto")]


def test_the_call_kinds_subclass_nothing() -> None:
    """The relayed, intercepted and served call kinds are plain classes, each holding the shared
    part of a call (its halves, status and end) as a CallState instead of inheriting it."""
    from krproxy.relay.call import Call
    from krproxy.relay.intercepted import LocalCall
    from krproxy.relay.served import Served
    from krproxy.relay.state import CallState

    kinds = (Call, LocalCall, Served)
    assert [(kind, object) for kind in kinds] == [kind.__mro__ for kind in kinds]
    assert all("state" in kind.__slots__ for kind in kinds)
    assert (CallState, object) == CallState.__mro__


def test_the_inheritance_check_sees_a_subclass() -> None:
    """The checker itself: a class extending one of another krproxy module is reported, an
    exception or a Protocol's implementation extending one is not; an allowed pair is let through."""
    from krproxy.calls import CallFacts
    from krproxy.hooks.lifecycle import Chain
    from krproxy.relay.grpc import UpstreamError
    from krproxy.relay.state import CallState

    spread = type("Spread", (CallState,), {"__module__": "krproxy.relay.elsewhere"})
    error = type("Error", (UpstreamError,), {"__module__": "krproxy.relay.elsewhere"})
    chain = type("AChain", (Chain,), {"__module__": "krproxy.relay.elsewhere"})
    found = inherited_across_modules([spread, error, chain])
    assert {"krproxy.relay.elsewhere.Spread": ["krproxy.relay.state.CallState"]} == found
    record = type("TraceRecord", (CallFacts,), {"__module__": "krproxy.trace.format"})
    assert {} == not_allowed(inherited_across_modules([record]))


def _sets_on_self(method: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The names ``method`` assigns as ``self.name`` (``=``, ``+=``, annotated, unpacked; not
    ``self.name[key] =``, which changes what the name holds)."""
    found: set[str] = set()
    for node in ast.walk(method):
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        while targets:
            target = targets.pop()
            if isinstance(target, ast.Tuple | ast.List):
                targets.extend(target.elts)
            elif (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                found.add(target.attr)
    return found


def borrowed_state(tree: ast.Module, fields: Mapping[str, Collection[str]] = {}) -> dict[str, list[str]]:
    """``class -> state its own __init__ does not set up``: names it annotates at class level
    without a value, or assigns on ``self`` in another method, that its ``__init__`` never sets
    (state declared for someone else's ``__init__`` to set: a subclass's, a host's). ``fields``:
    per class, what an ``__init__`` it does not spell sets (an attrs class's fields)."""
    found: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        init = set(fields.get(node.name, ()))
        elsewhere: set[str] = set()
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and item.value is None and isinstance(item.target, ast.Name):
                elsewhere.add(item.target.id)
            elif isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                (init if item.name == "__init__" else elsewhere).update(_sets_on_self(item))
        if unset := sorted(elsewhere - init):
            found[node.name] = unset
    return found


def test_each_h2_class_sets_up_its_own_state() -> None:
    """Each class of the HTTP/2 core sets all of its state in its own ``__init__``: no bare
    class-level annotation and no attribute first set by another method stands for state some
    other class's ``__init__`` sets up (attrs fields are the class's own)."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "krproxy" / "h2").glob("*.py")):
        module = importlib.import_module(_module_name(path))
        fields = {
            name: [field.name for field in attrs.fields(value)]
            for name, value in vars(module).items()
            if isinstance(value, type) and attrs.has(value)
        }
        found |= {
            f"{module.__name__}.{cls}": names
            for cls, names in borrowed_state(ast.parse(path.read_text()), fields).items()
        }
    assert {} == found


def test_the_state_check_sees_borrowed_state() -> None:
    """The checker itself: a bare annotation, or an attribute a method sets, that ``__init__`` does
    not set is reported; one ``__init__`` sets, one with a value, a key set in a dict the class
    holds and an attrs field are not."""
    code = (
        "class Part:\n    shared: int\n    own: int\n    default: int = 0\n"
        "    def __init__(self):\n        self.own, self.table = 1, {}\n"
        "    def later(self):\n        self.own += 1\n        self.table[1] = 2\n        self.late = 3\n"
        "class Record:\n    field: int\n"
    )
    assert {"Part": ["late", "shared"], "Record": ["field"]} == borrowed_state(ast.parse(code))
    assert {"Part": ["late", "shared"]} == borrowed_state(ast.parse(code), {"Record": ["field"]})


def test_the_connection_holds_its_parts() -> None:
    """The HTTP/2 Connection and each of its parts subclass nothing; the parts share the one State,
    and the methods a driver calls per frame are the parts' own, bound (no call added per call)."""
    from krproxy.h2._blocks import Blocks
    from krproxy.h2._control import Control
    from krproxy.h2._inflow import Inflow
    from krproxy.h2._send import Sender
    from krproxy.h2._state import State
    from krproxy.h2.connection import Connection, Role

    kinds = (Connection, State, Sender, Control, Inflow, Blocks)
    assert [(kind, object) for kind in kinds] == [kind.__mro__ for kind in kinds]
    conn = Connection(Role.SERVER)
    parts = (conn.sender, conn.control, conn.inflow, conn.blocks)
    assert [conn.state] * 4 == [part.state for part in parts]
    assert conn.streams is conn.state.streams and conn.output is conn.state.output
    bound = {
        "send_headers": conn.sender,
        "send_data": conn.sender,
        "send_trailers": conn.sender,
        "start_stream": conn.sender,
        "release_stream": conn.sender,
        "reset_stream": conn.sender,
        "acknowledge_received_data": conn.inflow,
        "decode_block": conn.blocks,
    }
    assert bound == {name: getattr(conn, name).__self__ for name in bound}
