"""krproxy's layers (docs/architecture.md, "Layers"): the table there against the import graph.

The table lists every module of ``krproxy/`` in one row, top layer first. A module may import
from its own row and the rows below it, never from one above: the graph is read from the
source (tests/unit/test_import_graph.py), lazy imports included, imports made only for the type
checker left out, and so are the lazy re-exports of a package's ``__getattr__`` (they load only
when the name is asked for: ``krproxy.trace.Recorder``). The rows marked *pure* or *sans-I/O* are checked as they load: each module
is imported in a fresh interpreter (a fork of a small one that has loaded nothing of krproxy),
with import hooks that record, for each forbidden module loaded or named in an import statement,
the chain of modules whose code was running, so a package ``__init__`` that drags the machinery in is named.
"""

from __future__ import annotations

import ast
import json
import pathlib
import re
import subprocess
import sys
import textwrap

import attrs
import pytest

from tests.unit.test_import_graph import _imports, _module_name

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
_TABLE_MARK = "<!-- The layer table"

#: What no pure module loads, whatever brings it in.
NOT_PURE = ("trio", "trio_asyncio", "grpclib", "grpc", "h2", "hpack")
#: What no pure module's own code loads, directly or through the standard library (a
#: third-party package may load it for itself: betterproto2 does, through importlib.metadata).
NOT_PURE_OWN = ("socket",)
#: A sans-I/O protocol module may decode header blocks with hpack.
NOT_SANS_IO = tuple(name for name in NOT_PURE if name != "hpack")

#: Pure modules that still load trio through their package, with the reason: the test fails
#: once one of them is fixed (strict xfail), so the list and the doc's note shrink with it.
LOADS_TRIO_THROUGH_PACKAGE: dict[str, str] = {}


@attrs.frozen
class Layer:
    name: str
    patterns: tuple[str, ...]
    kind: str


def read_layers(text: str) -> list[Layer]:
    """The rows of the layer table in ``text`` (architecture.md), top layer first."""
    lines = text[text.index(_TABLE_MARK) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| layer |"))
    layers = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        name, modules, kind = (cell.strip() for cell in line.strip("|").split("|"))
        layers.append(Layer(name, tuple(re.findall(r"`([^`]+)`", modules)), kind))
    return layers


def _path(module: str, packages: set[str]) -> str:
    """``krproxy.relay.frames`` -> ``relay/frames``; a package ``krproxy.relay`` -> ``relay/``."""
    path = module.removeprefix("krproxy").lstrip(".").replace(".", "/")
    return path + "/" if module in packages else path


def assign(layers: list[Layer], modules: set[str], packages: set[str]) -> tuple[dict[str, int], list[str]]:
    """Each module's row (index into ``layers``) by its longest matching pattern, and the problems:
    modules no row names, patterns naming no module, patterns in two rows."""
    problems: list[str] = []
    owner: dict[str, int] = {}
    for index, layer in enumerate(layers):
        for pattern in layer.patterns:
            if pattern in owner:
                problems.append(f"{pattern} is in two rows: {layers[owner[pattern]].name}, {layer.name}")
            owner[pattern] = index
    used: set[str] = set()
    found: dict[str, int] = {}
    for module in sorted(modules):
        if module == "krproxy":
            continue
        path = _path(module, packages)
        matches = [p for p in owner if p == path or (p.endswith("/") and path.startswith(p))]
        if not matches:
            problems.append(f"{path} ({module}) is in no row of the layer table")
            continue
        best = max(matches, key=len)
        used.add(best)
        found[module] = owner[best]
    problems.extend(f"{p} in the layer table names no module" for p in sorted(set(owner) - used))
    return found, problems


def _graph() -> tuple[dict[str, set[str]], set[str]]:
    """``module -> krproxy modules it imports`` (generated code left out) and the packages."""
    paths = {_module_name(p): p for p in sorted((ROOT / "krproxy").rglob("*.py"))}
    # the fakes: the folder fakes/, installed as krproxy.fakes (pyproject.toml)
    paths |= {"krproxy." + _module_name(p): p for p in sorted((ROOT / "fakes").rglob("*.py"))}
    packages = {m for m, p in paths.items() if p.name == "__init__.py"}
    graph = {}
    for module, path in paths.items():
        if module.startswith("krproxy.proto."):
            continue
        tree = ast.parse(path.read_text(), str(path))
        if module in packages:
            tree.body = [
                n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == "__getattr__")
            ]
        package = module if module in packages else module.rpartition(".")[0]
        graph[module] = {t for t in _imports(tree, package, paths) if t in paths and t != module}
    return graph, packages


LAYERS = read_layers(ARCHITECTURE.read_text())
GRAPH, PACKAGES = _graph()
ROWS, PROBLEMS = assign(LAYERS, set(GRAPH) | {"krproxy.proto"}, PACKAGES)


def test_the_layer_table_names_every_module_once() -> None:
    """Every module of krproxy/ is in exactly one row of architecture.md's layer table, and every
    name in the table is a module or package that exists."""
    assert [] == PROBLEMS


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    """An import reaches the module's own row or one below it (rows are listed top first)."""
    upward = [
        f"{module} ({LAYERS[ROWS[module]].name}) imports {target} ({LAYERS[ROWS[target]].name})"
        for module, targets in sorted(GRAPH.items())
        for target in sorted(targets)
        if module in ROWS and target in ROWS and ROWS[target] < ROWS[module]
    ]
    assert [] == upward


def test_the_stdlib_row_imports_only_the_standard_library() -> None:
    """The modules of the *stdlib* row import nothing but the standard library and each other."""
    stdlib = {i for i, layer in enumerate(LAYERS) if layer.kind == "stdlib"}
    outside = []
    for module, row in sorted(ROWS.items()):
        if row not in stdlib:
            continue
        source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
        outside += [
            f"{module} imports {n}"
            for n in _imports(ast.parse(source), "krproxy", type_checking=True)
            if n.partition(".")[0] not in sys.stdlib_module_names
            and not (n.startswith("krproxy.") and ROWS.get(n) in stdlib)
            and n != "krproxy"
        ]
    assert [] == outside


def test_the_layer_checks_see_a_violation() -> None:
    """The checkers themselves: an unlisted module, a stale name and an upward import are found."""
    layers = read_layers(
        f"{_TABLE_MARK} -->\n| layer | modules | imports |\n|---|---|---|\n"
        "| top | `a/` `gone` | any |\n| bottom | `b` | pure |\n"
    )
    rows, problems = assign(layers, {"krproxy.a", "krproxy.a.x", "krproxy.b", "krproxy.c"}, {"krproxy.a"})
    assert {"krproxy.a": 0, "krproxy.a.x": 0, "krproxy.b": 1} == rows
    assert [
        "c (krproxy.c) is in no row of the layer table",
        "gone in the layer table names no module",
    ] == problems
    assert [("bottom", "pure")] == [(layer.name, layer.kind) for layer in layers[1:]]


# Imports each module named on the command line (``kind:module``) in a fork of this small
# interpreter, and prints, as JSON, what each loaded that its kind forbids, with the chain of
# importing modules (innermost first).
_PROBE = textwrap.dedent(
    """
    import builtins, json, os, sys, importlib
    WATCH = set(json.loads(sys.argv[1]))

    def chain():
        # The modules whose code is running, innermost first: the importer, then what imported it.
        names, frame = [], sys._getframe(2)
        while frame is not None:
            name = frame.f_globals.get("__name__", "?")
            if name != "__main__" and not name.startswith("importlib") and (not names or names[-1] != name):
                names.append(name)
            frame = frame.f_back
        return names

    seen = []

    class Watch:
        # Sees each watched module the first time anything loads it.
        def find_spec(self, name, path=None, target=None):
            if name in WATCH:
                seen.append([name, chain()])
            return None

    real_import = builtins.__import__

    def watched_import(name, globals=None, locals=None, fromlist=(), level=0):
        # Sees every import statement naming one, loaded before or not (betterproto2 loads
        # socket before krproxy.unixsock's `import socket` could).
        if level == 0 and name.partition(".")[0] in WATCH:
            seen.append([name.partition(".")[0], chain()])
        return real_import(name, globals, locals, fromlist, level)

    results = {}
    for module in sys.argv[2:]:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            sys.meta_path.insert(0, Watch())
            builtins.__import__ = watched_import
            try:
                importlib.import_module(module)
                out = seen
            except BaseException as e:
                out = [["<error>", [repr(e)]]]
            os.write(write, json.dumps(out).encode())
            os._exit(0)
        os.close(write)
        data = b""
        while chunk := os.read(read, 1 << 16):
            data += chunk
        os.waitpid(pid, 0)
        results[module] = json.loads(data)
    print(json.dumps(results))
    """
)


def _own(chain: list[str]) -> bool:
    """Whether krproxy's own code (not generated) brought the module in, through the standard
    library only: the first importer outside the standard library is a krproxy module."""
    for name in chain:
        if name.partition(".")[0] in sys.stdlib_module_names:
            continue
        return name.startswith("krproxy") and not name.startswith("krproxy.proto")
    return False


def offences(kind: str, seen: list[list[object]]) -> list[str]:
    """What of ``seen`` (``[name, chain]`` pairs from the probe) a module of ``kind`` must not load."""
    forbidden = NOT_PURE if kind == "pure" else NOT_SANS_IO
    found: list[str] = []
    for name, chain in seen:
        assert isinstance(name, str) and isinstance(chain, list)
        if name == "<error>" or name in forbidden or (name in NOT_PURE_OWN and _own(chain)):
            found += [f"{name} (imported by {' <- '.join(chain)})"]
    return sorted(set(found), key=found.index)


CHECKED = {
    module: LAYERS[row].kind
    for module, row in sorted(ROWS.items())
    if LAYERS[row].kind in {"pure", "sans-I/O"}
}


@pytest.fixture(scope="module")
def loaded() -> dict[str, list[list[object]]]:
    watch = json.dumps(sorted({*NOT_PURE, *NOT_PURE_OWN}))
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, watch, *CHECKED],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    result: dict[str, list[list[object]]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(
    "module",
    [
        pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=LOADS_TRIO_THROUGH_PACKAGE[m]))
        if m in LOADS_TRIO_THROUGH_PACKAGE
        else m
        for m in CHECKED
    ],
)
def test_a_pure_module_loads_no_machinery(module: str, loaded: dict[str, list[list[object]]]) -> None:
    """Importing the module, its package's ``__init__`` with it, loads no event loop, gRPC or
    HTTP/2 library (hpack allowed in the sans-I/O protocols) and no socket of its own."""
    assert [] == offences(CHECKED[module], loaded[module])


def test_the_probe_names_who_loaded_what() -> None:
    """The checker itself: socket through betterproto2 is allowed, through krproxy code (or the
    standard library it imports) is not; trio and hpack are refused whoever loads them."""
    assert [] == offences(
        "pure", [["socket", ["email.utils", "importlib.metadata", "betterproto2", "krproxy.hooks.model"]]]
    )
    assert ["socket (imported by asyncio.base_events <- asyncio <- krproxy.x)"] == offences(
        "pure", [["socket", ["asyncio.base_events", "asyncio", "krproxy.x"]]]
    )
    assert ["trio (imported by anyio <- krproxy.x)"] == offences("pure", [["trio", ["anyio", "krproxy.x"]]])
    assert [] == offences("sans-I/O", [["hpack", ["krproxy.h2.frames"]]])
    assert ["hpack (imported by krproxy.x)"] == offences("pure", [["hpack", ["krproxy.x"]]])


def _modules_after_importing(*modules: str) -> set[str]:
    code = f"import json, sys; import {', '.join(modules)}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    )
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_admin_endpoint_loads_no_interceptors() -> None:
    """``krproxy nri``'s admin endpoint (server and status) reads the daemon through protocols:
    importing it loads neither ``HookRuntime`` nor the relay; ``krproxy status`` (the client)
    loads no trio and no metrics either."""
    endpoint = _modules_after_importing("krproxy.admin.server", "krproxy.admin.status")
    assert set() == endpoint & {"krproxy.hooks.runtime", "krproxy.relay", "krproxy.relay.relay"}
    client = _modules_after_importing("krproxy.admin.client")
    assert set() == client & {"trio", "prometheus_client", "krproxy.admin.server", "krproxy.admin.status"}


def test_merge_and_validation_take_records_not_wire_messages() -> None:
    """The merge rules and the answer checks work on records (docs/architecture.md, "One protobuf path per
    job"): importing them, their package included, loads no generated message and no protobuf runtime."""
    loaded = _modules_after_importing("krproxy.hooks.merge", "krproxy.hooks.validate")
    wire = {m for m in loaded if m.startswith(("krproxy.proto", "betterproto2", "google.protobuf"))}
    assert {"krproxy.hooks.merge", "krproxy.hooks.validate"} <= loaded
    assert set() == wire


#: A module of one job fits in about this many lines (docs/architecture.md, "Layers").
MAX_LINES = 500

#: Modules still longer, each for its owner to split; the test of each fails once it fits.
LONG_MODULES_TO_SPLIT: dict[str, str] = {}


def _is_python(path: pathlib.Path) -> bool:
    """A ``.py`` file, or a file without a suffix whose first line is a python shebang (a script)."""
    if path.suffix == ".py":
        return True
    if path.suffix or not path.is_file():
        return False
    with path.open("rb") as file:
        first = file.readline()
    return first.startswith(b"#!") and b"python" in first


def _sources(root: pathlib.Path = ROOT) -> list[str]:
    """The Python modules of the tree outside generated code: ``krproxy/`` (``krproxy/proto``
    left out), ``fakes/``, ``tests/`` and ``scripts/`` (scripts without ``.py`` included)."""
    paths = [p for top in ("krproxy", "fakes", "tests", "scripts") for p in (root / top).rglob("*")]
    return sorted(
        str(p.relative_to(root))
        for p in paths
        if _is_python(p)
        and p.relative_to(root).parts[:2] != ("krproxy", "proto")
        and "__pycache__" not in p.parts
    )


def _too_long(root: pathlib.Path = ROOT) -> list[str]:
    return [p for p in _sources(root) if len((root / p).read_text().splitlines()) > MAX_LINES]


def test_the_length_rule_holds_tests_scripts_not_generated(
    tmp_path: pathlib.Path,
) -> None:
    """A 501-line module is found in each part of the tree, a python script without ``.py`` too;
    a shell script and generated code are left out, and a module of 500 lines passes."""
    files = {
        "krproxy/proto/runtime/big.py": 501,
        "krproxy/relay/big.py": 501,
        "fakes/big.py": 501,
        "tests/unit/test_big.py": 501,
        "tests/unit/test_fits.py": 500,
        "scripts/tool": 501,
        "scripts/shell-tool": 501,
        "scripts/data.txt": 501,
    }
    for name, count in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        first = "#!/bin/sh" if name == "scripts/shell-tool" else "#!/usr/bin/env python3"
        path.write_text("\n".join([first, *["x = 1"] * (count - 1)]) + "\n")
    assert ["fakes/big.py", "krproxy/relay/big.py", "scripts/tool", "tests/unit/test_big.py"] == _too_long(
        tmp_path
    )


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=LONG_MODULES_TO_SPLIT[p]))
        if p in LONG_MODULES_TO_SPLIT
        else p
        for p in _sources()
    ],
)
def test_a_module_fits_in_about_500_lines(path: str) -> None:
    """Outside generated code, a module has at most :data:`MAX_LINES` lines."""
    assert len((ROOT / path).read_text().splitlines()) <= MAX_LINES
