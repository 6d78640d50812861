"""What each part of krproxy imports: the pure core loads no event loop or gRPC library, and no
``krproxy`` command loads grpclib, trio-asyncio, h2, grpcio or an asyncio event loop (policy):
they all speak gRPC through krproxy's own engine on trio, so ``pip install krproxy`` runs every
command, on every Python trio runs on.

The tests run real commands in a fresh interpreter and read ``sys.modules`` at the end, so a
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
    "krproxy.hooks.encode",
    "krproxy.hooks.lifecycle",
    "krproxy.hooks.validate",
    "krproxy.calls",
    "krproxy.config",
    "krproxy.methods",
    "krproxy.forward",
]

#: What the pure core must not load.
NOT_IN_CORE = {"trio_asyncio", "grpclib", "h2", "hpack", "grpc", "trio", "krproxy.relay"}

#: What no krproxy command may load: the runtime dependencies hold none of them.
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
# (a daemon) or lets it finish (a command), then prints the modules it had loaded, and whether an
# asyncio event loop policy was ever set up (asyncio's loops are made through it).
_RUN_CLI = textwrap.dedent(
    """
    import json, sys
    from krproxy import cli
    code = cli.main(sys.argv[1:])
    events = sys.modules.get("asyncio.events")
    policy = getattr(events, "_event_loop_policy", None) if events is not None else None
    print(json.dumps(sorted(sys.modules) + (["<asyncio loop policy>"] if policy is not None else [])))
    """
)


def _daemon_modules(args: list[str], ready: str = "event=ready") -> list[str]:
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
            if ready in line:
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


#: The proxy's routing and hook machinery, and the CRI's 186 betterproto2 classes (0.1 s of imports).
PROXY_ONLY = {
    "krproxy.relay.relay",
    "krproxy.forward",
    "krproxy.methods",
    "krproxy.hooks",
    "krproxy.proto.runtime.v1",
}


def test_krproxys_own_grpc_loads_no_proxy_machinery() -> None:
    """krproxy's gRPC client and server (:mod:`krproxy.rpc`, under the fakes, ``krproxy trace`` and the
    SDK's hook server) load none of the proxy's routing, hook machinery or CRI messages: the
    transport's modules are loaded without :class:`krproxy.relay.Relay`."""
    code = "import json, sys; import krproxy.rpc; print(json.dumps(sorted(sys.modules)))"
    modules = _modules_after(code)
    assert "krproxy.relay.transport" in modules
    assert [] == _loaded(modules, PROXY_ONLY)


def _command_modules(args: list[str]) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", _RUN_CLI, *args], capture_output=True, text=True, timeout=120, check=False
    )
    # cli.main returns the exit status; _RUN_CLI prints the modules whatever it was.
    assert done.stdout.strip(), f"{args}: no output; stderr: {done.stderr}"
    modules: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return modules


#: What no krproxy command may load, with the asyncio loop policy marker of _RUN_CLI.
NOT_IN_COMMANDS = NOT_IN_DAEMON | {"<asyncio loop policy>"}


@pytest.mark.parametrize(
    ("args", "ready"),
    [
        (["hooks", "serve", "--socket={tmp}/hs.sock", "--hook-dir={tmp}/hooks"], "event=hookserver_started"),
        (
            ["hooks", "standalone", "--cri-endpoint=unix://{tmp}/nobody.sock", "--interval=60"],
            "event=cri_list_failed",
        ),
        (["trace", "serve", "{trace}", "--socket={tmp}/trace.sock"], "event=serving"),
    ],
    ids=["hooks-serve", "hooks-standalone", "trace-serve"],
)
def test_serving_commands_load_no_grpclib_h2_or_asyncio_loop(
    args: list[str], ready: str, short_tmp: pathlib.Path
) -> None:
    """`krproxy hooks serve|standalone` and `trace serve`, started, serving and stopped, loaded
    none of grpclib, trio-asyncio, h2, grpcio, and set up no asyncio event loop."""
    trace = str(ROOT / "tests" / "data" / "traces" / "fake-lifecycle.krt")
    modules = _daemon_modules([a.format(tmp=short_tmp, trace=trace) for a in args], ready)
    assert "krproxy.rpc" in modules  # it did serve or call over gRPC
    assert [] == _loaded(modules, NOT_IN_COMMANDS)


def test_demo_and_trace_replay_load_no_grpclib_h2_or_asyncio(short_tmp: pathlib.Path) -> None:
    """`krproxy demo` (fake containerd, plugin, proxy, client in one process) and `trace replay`
    (against nobody: it stops at its check of the target, with every module of a replay loaded)
    load none of them either."""
    trace = str(ROOT / "tests" / "data" / "traces" / "fake-lifecycle.krt")
    for args in (
        ["demo"],
        ["trace", "replay", trace, f"--target={short_tmp / 'nobody.sock'}", "--progress=never"],
    ):
        modules = _command_modules(args)
        assert "krproxy.rpc" in modules, args
        assert [] == _loaded(modules, NOT_IN_COMMANDS), args


def _all_imports(tree: ast.Module) -> list[str]:
    """Every module imported anywhere in ``tree``: at the top, inside functions, under TYPE_CHECKING."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _sources() -> list[pathlib.Path]:
    return sorted(p for top in ("krproxy", "fakes") for p in (ROOT / top).rglob("*.py"))


#: The benchmark drives krproxy from outside with independent stacks (grpcio clients, an h2
#: stuck client); it runs with the test extra, and no krproxy command imports it.
OUTSIDE_THE_PACKAGE_RULE = ROOT / "krproxy" / "bench"


def test_no_module_imports_grpclib_trio_asyncio_or_h2() -> None:
    """No module of krproxy or the fakes imports grpclib, trio-asyncio or h2, not even lazily:
    `pip install krproxy` does not bring them (the benchmark's modules aside)."""
    offenders = []
    for path in _sources():
        if path.is_relative_to(OUTSIDE_THE_PACKAGE_RULE):
            continue
        imports = _all_imports(ast.parse(path.read_text(), str(path)))
        if any(name.split(".")[0] in ("grpclib", "trio_asyncio", "h2") for name in imports):
            offenders.append(str(path.relative_to(ROOT)))
    assert [] == offenders
