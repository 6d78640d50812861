"""What each part of krproxy imports: the pure core loads no event loop or gRPC library, the daemon
no grpclib or trio-asyncio, and grpclib is always reached through its adapter (krproxy._grpc).

The first two run real commands in a fresh interpreter and read ``sys.modules`` at the end, so a
lazy import inside a function counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
import json
import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: Modules of the pure core (docs/architecture.md, "Layers"): hook points, records, merge rules,
#: registration parsing, the store, the trace format and what they are made of.
PURE_CORE = [
    "krproxy.hooks.merge",
    "krproxy.hooks.registration",
    "krproxy.hooks.store",
    "krproxy.trace.format",
    "krproxy.hooks.points",
    "krproxy.hooks.model",
    "krproxy.hooks.slices",
    "krproxy.hooks.outcomes",
    "krproxy.hooks.convert",
    "krproxy.hooks.validate",
    "krproxy.calls",
    "krproxy.config",
    "krproxy.methods",
    "krproxy.forward",
]

#: What the pure core must not load.
NOT_IN_CORE = {"trio_asyncio", "grpclib", "h2", "hpack", "grpc", "trio", "krproxy.relay"}

#: What no part of the daemon may load (grpclib is for the SDK, `trace serve` and the fakes).
NOT_IN_DAEMON = {"trio_asyncio", "grpclib", "grpc", "h2", "cri_api"}


def _loaded(modules: list[str], forbidden: set[str]) -> list[str]:
    return sorted({m for m in modules for f in forbidden if m == f or m.startswith(f + ".")})


def _modules_after(code: str, *args: str) -> list[str]:
    """Run ``code`` in a fresh interpreter; it must print ``sorted(sys.modules)`` as JSON, last."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args], check=True, capture_output=True, text=True, timeout=120
    )
    modules: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return modules


def test_the_pure_core_imports_no_event_loop_and_no_grpc_library() -> None:
    """Importing the pure core loads none of trio, trio-asyncio, grpclib, h2, hpack, grpcio, the relay."""
    code = f"import json, sys; import {', '.join(PURE_CORE)}; print(json.dumps(sorted(sys.modules)))"
    assert [] == _loaded(_modules_after(code), NOT_IN_CORE)


# Runs `krproxy ARGS...` in this interpreter, stops it with SIGTERM once it logged `ready`
# (a daemon) or lets it finish (a command), then prints the modules it had loaded.
_RUN_CLI = textwrap.dedent(
    """
    import json, sys
    from krproxy import cli
    code = cli.main(sys.argv[1:])
    print(json.dumps(sorted(sys.modules)))
    """
)


def _daemon_modules(args: list[str]) -> list[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUN_CLI, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if "event=ready" in line:
                break
        else:
            pytest.fail(
                f"the daemon never became ready (exit {proc.wait()}): {''.join(seen)} {proc.stdout.read() if proc.stdout else ''}"
            )
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert 0 == proc.returncode, err
    modules: list[str] = json.loads(out.strip().splitlines()[-1])
    return modules


@pytest.mark.parametrize("mode", ["Containerd", "Docker"])
def test_krproxy_serve_loads_no_grpclib_and_no_trio_asyncio(mode: str, short_tmp: pathlib.Path) -> None:
    """A `krproxy serve` that started, served and stopped has loaded no grpclib, trio-asyncio, grpcio or h2."""
    hook_dir = short_tmp / "hooks"
    hook_dir.mkdir()
    modules = _daemon_modules(
        [
            "serve",
            f"--koord-runtimeproxy-endpoint={short_tmp / 'proxy.sock'}",
            f"--remote-runtime-service-endpoint={short_tmp / 'runtime.sock'}",  # nobody there: fine
            f"--backend-runtime-mode={mode}",
            f"--hook-dir={hook_dir}",
            f"--record={short_tmp / 'trace.krt'}",
            f"--oci-hooks-dir={hook_dir}",
        ]
    )
    assert "krproxy.relay" in modules or mode == "Docker"  # it did load the daemon
    assert [] == _loaded(modules, NOT_IN_DAEMON)


def test_trace_show_and_the_runc_wrapper_load_no_grpclib() -> None:
    """`krproxy trace show` and the runc wrapper's module load no grpclib and no trio-asyncio."""
    trace = str(ROOT / "tests" / "data" / "traces" / "fake-lifecycle.krt")
    code = _RUN_CLI.replace(
        "code = cli.main", "import krproxy.ocihooks.wrapper, krproxy.trace.replay\ncode = cli.main"
    )
    modules = _modules_after(code, "trace", "show", trace)
    assert "krproxy.trace.show" in modules
    assert [] == _loaded(modules, NOT_IN_DAEMON)


def _top_level_imports(tree: ast.Module) -> list[str]:
    """Modules imported at module level, outside ``if TYPE_CHECKING:`` blocks."""
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def _sources() -> list[pathlib.Path]:
    return sorted(p for top in ("krproxy", "fakes") for p in (ROOT / top).rglob("*.py"))


def test_grpclib_is_only_imported_together_with_its_adapter() -> None:
    """Every module that imports grpclib or trio-asyncio also imports krproxy._grpc, which owns their order."""
    offenders = []
    for path in _sources():
        imports = _top_level_imports(ast.parse(path.read_text(), str(path)))
        uses_grpclib = any(name.split(".")[0] in ("grpclib", "trio_asyncio") for name in imports)
        if uses_grpclib and path != ROOT / "krproxy" / "_grpc.py" and "krproxy._grpc" not in imports:
            offenders.append(str(path.relative_to(ROOT)))
    assert [] == offenders


def test_grpclib_imported_first_still_works_once_the_adapter_is_imported() -> None:
    """grpclib imported before trio-asyncio (by a program of its own) gets trio-asyncio's current_task."""
    code = (
        "import asyncio, grpclib.utils, krproxy._grpc; "
        "print(grpclib.utils._current_task is asyncio.current_task)"
    )
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert "True" == done.stdout.strip()
