"""What the OCI hooks runc wrapper (``krproxy-runc-wrapper``) adds, alone and on containerd."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from typing import Any

from krproxy.bench._support import (
    PY,
    SANDBOX_SCRIPT,
    _check,
    _client,
    _NoSandbox,
    _sandbox,
    _summary,
)


def _timed_runs(
    variants: dict[str, list[str]], env: dict[str, str], calls: int
) -> dict[str, dict[str, float]]:
    """Wall time of each command line (start to exit), alternating variants block by block."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    blocks = 10
    for block in range(blocks + 1):  # block 0 warms the page cache and is not counted
        for name, argv in variants.items():
            for _ in range(max(calls // blocks, 1)):
                started = time.perf_counter_ns()
                subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                if block:
                    samples[name].append((time.perf_counter_ns() - started) / 1000)
    return {name: _summary(got) for name, got in samples.items()}


#: A hook file like oci-seccomp-bpf-hook's: it applies to containers with one annotation. Used as the
#: hook that matches nothing in the wrapper's cases.
_NO_MATCH_HOOK = {
    "version": "1.0.0",
    "hook": {"path": "/bin/true"},
    "when": {"annotations": {r"^io\.containers\.trace-syscall$": ".*"}},
    "stages": ["prestart"],
}


def _wrapper_install(directory: str, runc: str, hooks: dict[str, dict[str, Any]]) -> str:
    """The fast launcher at ``directory/krproxy-runc-wrapper`` with ``hooks`` in ``directory/hooks``
    and its index in ``directory/index``; returns the launcher's path.

    Waits out the second by which the index is dated back (see :mod:`krproxy.ocihooks.index`), so that
    the first create writes an index that is current for the later ones.
    """
    from krproxy.ocihooks.wrapper import CONFIG_NAME, write_launcher

    hook_dir = os.path.join(directory, "hooks")
    os.makedirs(hook_dir, exist_ok=True)
    for name, doc in hooks.items():
        with open(os.path.join(hook_dir, name), "w") as f:
            json.dump(doc, f)
    with open(os.path.join(directory, CONFIG_NAME), "w") as f:
        f.write(f"runc = {runc}\nhooks-dir = {hook_dir}\n")
    launcher = os.path.join(directory, "krproxy-runc-wrapper")
    write_launcher(launcher, runc=runc, index=os.path.join(directory, "index"))
    time.sleep(1.1)
    return launcher


def runc_wrapper(workdir: str, calls: int) -> dict[str, Any]:
    """What the OCI hooks runc wrapper adds to a runc call that no hook concerns.

    Plain runc against the fast launcher (``krproxy oci-launcher``) and the Python entry point
    (``krproxy-runc-wrapper``), for ``runc --version`` and ``runc state`` (a container that does
    not exist: runc's own work is small, so the wrapper's share shows). Then ``create`` against a
    runc that does nothing (``true``), so that all of the difference is the wrapper's: with a hook
    file whose index strings are not in ``config.json`` (the launcher decides without Python), and
    with one the index cannot rule out (``hasBindMounts``: Python runs, reads the hooks and
    ``config.json``, adds nothing).
    """
    runc = shutil.which("runc")
    if runc is None:
        return {"skipped": "runc not installed"}
    base = os.path.join(workdir, "runc-wrapper")
    os.makedirs(base)
    true = shutil.which("true") or "/bin/true"
    entry_point = os.path.join(os.path.dirname(PY), "krproxy-runc-wrapper")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KRPROXY_")}
    root = os.path.join(base, "root")
    bundle = os.path.join(base, "bundle")
    os.makedirs(bundle)
    with open(os.path.join(bundle, "config.json"), "w") as f:
        spec = {"ociVersion": "1.0.2", "process": {"args": ["sh"]}, "annotations": {}, "mounts": []}
        json.dump(spec, f)
    results: dict[str, Any] = {}
    launcher = _wrapper_install(os.path.join(base, "plain"), runc, {"never.json": _NO_MATCH_HOOK})
    for name, args in (("version", ["--version"]), ("state", ["--root", root, "state", "nothing"])):
        variants = {"runc": [runc, *args], "launcher": [launcher, *args]}
        if os.path.exists(entry_point):
            variants["entry_point"] = [entry_point, *args]
        results[name] = _timed_runs(variants, env, calls)
    create = ["--root", root, "create", "--bundle", bundle, "c1"]
    bind_hook = {**_NO_MATCH_HOOK, "when": {"hasBindMounts": True}}
    for name, hooks in (
        ("create", {"never.json": _NO_MATCH_HOOK}),
        ("create_python", {"binds.json": bind_hook}),
    ):
        launcher = _wrapper_install(os.path.join(base, name), true, hooks)
        subprocess.run([launcher, *create], env=env, check=True)  # writes the index
        results[name] = _timed_runs({"runc": [true, *create], "launcher": [launcher, *create]}, env, calls)
    return results


def runc_wrapper_containerd(workdir: str, args: argparse.Namespace) -> dict[str, Any]:
    """Pod start (RunPodSandbox, CreateContainer, StartContainer) on real containerd with runc as the
    runtime's binary, and with the fast launcher in front of it and a hook file that matches nothing.

    The two runtime handlers alternate block by block. Needs root, containerd and runc (``nox -s e2e``
    installs them) and the sandbox script; otherwise says why not.
    """
    runc = shutil.which("runc")
    if os.geteuid() != 0 or not os.path.exists(SANDBOX_SCRIPT) or runc is None:
        return {"skipped": "not root" if os.geteuid() else "no sandbox script or no runc"}
    try:
        with _sandbox(workdir, "wrapper-containerd") as (sandbox, state, cgroup_parent):
            # The sandbox's config names this path as BinaryName of the runtime handler "krproxy-oci".
            _wrapper_install(os.path.join(sandbox, "krproxy-oci"), runc, {"never.json": _NO_MATCH_HOOK})
            pods: dict[str, list[float]] = {"runc": [], "launcher": []}
            for _ in range(max(args.wrapper_blocks, 1)):
                for name, handler in (("runc", ""), ("launcher", "krproxy-oci")):
                    got = _client(
                        "pod-create", "--target", state["socket"], "--pods", str(args.wrapper_pods),
                        "--image", state["busybox_image"], "--cgroup-parent", cgroup_parent,
                        "--runtime-handler", handler,
                    )  # fmt: skip
                    pods[name] += got["latencies_us"]
            return {
                "pod_start": {k: _summary(v) for k, v in pods.items()},
                "containerd": state.get("containerd_version", "?"),
            }
    except _NoSandbox as err:
        return {"skipped": str(err)}


WRAPPER_TARGET_MS = 10.0


def report_runc_wrapper(r: dict[str, Any]) -> list[str]:
    """Rows for :func:`runc_wrapper`'s figures: added ms per runc call, launcher and entry point."""
    if "skipped" in r:
        return [f"runc wrapper                      not measured: {r['skipped']}"]
    lines = []
    for name, label in (
        ("version", "runc --version"),
        ("state", "runc state"),
        ("create", "create, hook, no match"),
        ("create_python", "create, hasBindMounts hook"),
    ):
        runs = r.get(name)
        if runs is None:
            continue
        plain = runs["runc"]
        for variant in ("launcher", "entry_point"):
            if variant not in runs:
                continue
            v = runs[variant]
            added = v["median_ms"] - plain["median_ms"]
            if variant == "entry_point":
                target = "(Python entry point; no target)"
            elif name == "create_python":
                target = "(the index cannot rule it out: Python runs; info)"
            else:
                target = f"added <={WRAPPER_TARGET_MS:g} ms: {_check(added <= WRAPPER_TARGET_MS)}"
            lines.append(
                f"{'wrapper ' + variant[:8] + ' ' + label:<33} {plain['median_ms']:7.3f}/{plain['p99_ms']:7.3f}"
                f"   {v['median_ms']:7.3f}/{v['p99_ms']:7.3f}   {v['median_ms'] / plain['median_ms']:5.2f}"
                f"   {added:8.3f}   {target}"
            )
    if "create" in r:
        lines.append("  (create rows: runc replaced by `true`, so the difference is all the wrapper's)")
    return lines


def report_runc_wrapper_containerd(r: dict[str, Any]) -> list[str]:
    """Rows for :func:`runc_wrapper_containerd`: pod start with runc vs the launcher (medians/p99 in ms)."""
    if "skipped" in r:
        return [f"runc wrapper on containerd        not measured: {r['skipped']}"]
    plain, launcher = r["pod_start"]["runc"], r["pod_start"]["launcher"]
    return [
        f"pod start, containerd {r['containerd']}, runc vs fast launcher (hook file, no match), ms median/p99:",
        f"  runc {plain['median_ms']:.1f}/{plain['p99_ms']:.1f}   launcher {launcher['median_ms']:.1f}/"
        f"{launcher['p99_ms']:.1f}   added {launcher['median_ms'] - plain['median_ms']:+.1f} "
        f"(n={plain['n']}+{launcher['n']}; info)",
    ]
