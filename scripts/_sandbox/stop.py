"""containerd-sandbox ``stop`` and ``status``: pods first, then containerd and its shims, then
what they leave behind (runc state, the CNI cache, mounts, cgroups, the directory).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from _sandbox.common import CGROUP_ROOT, CNI_CACHE, CNI_NETWORK, DEFAULT_CGROUP_PARENT, MARKER, Paths, log
from _sandbox.config import _is_our_registry
from _sandbox.processes import _ctr, _our_shims, _read_state, _running_pid, _signal, _wait_gone

# --------------------------------------------------------------------------- stop


def _remove_pods(p: Paths) -> None:
    """Remove every pod/container of the k8s.io namespace while containerd runs."""
    crictl = shutil.which("crictl")
    if crictl:
        ep = ["-r", f"unix://{p.sock}", "-i", f"unix://{p.sock}"]
        subprocess.run([crictl, *ep, "rmp", "--all", "--force"], capture_output=True, timeout=120)
    # ctr also catches anything crictl missed (or does all the work without it).
    tasks = _ctr(p, "tasks", "ls", "-q", check=False).stdout.split()
    for task in tasks:
        _ctr(p, "tasks", "kill", "-a", "-s", "SIGKILL", task, check=False)
    for task in tasks:
        _ctr(p, "tasks", "delete", "-f", task, check=False)
    containers = _ctr(p, "containers", "ls", "-q", check=False).stdout.split()
    if containers:
        _ctr(p, "containers", "delete", *containers, check=False)
    if tasks or containers:
        log(f"removed {len(tasks)} task(s), {len(containers)} container(s)")


def _runc_cleanup(p: Paths) -> None:
    """Force-delete containers runc still knows about (e.g. containerd crashed).

    Killing only the shims would orphan the container processes (pause and
    the workloads keep running, holding their cgroups and rootfs mounts).
    The runc state dirs live in DIR/run (bound over /run inside containerd's
    mount namespace), so they are reachable from here; `runc delete --force`
    SIGKILLs the container and removes its cgroups.
    """
    runc = shutil.which("runc")
    base = p.run / "containerd" / "runc"
    if not runc or not base.is_dir():
        return
    for ns_root in sorted(base.iterdir()):
        r = subprocess.run(
            [runc, "--root", str(ns_root), "list", "-q"], capture_output=True, text=True, timeout=30
        )
        ids = r.stdout.split() if r.returncode == 0 else []
        for cid in ids:
            subprocess.run(
                [runc, "--root", str(ns_root), "delete", "--force", cid], capture_output=True, timeout=30
            )
        if ids:
            log(f"runc: force-deleted {len(ids)} leftover container(s) in {ns_root.name}")


def _cleanup_cni_cache(state: dict[str, Any]) -> None:
    """Undo libcni's writes to the host's /var/lib/cni.

    Cache files are named <network>-<sandbox id>-<ifname>; ours use our own
    network name, and containerd adds a "cni-loopback" network whose files we
    recognise by the sandbox ids found in ours.  The directories are removed
    only if they did not exist before ``start`` and are empty now.
    """
    results = CNI_CACHE / "results"
    ours = sorted(results.glob(f"{CNI_NETWORK}-*")) if results.is_dir() else []
    for f in ours:
        sandbox_id = f.name[len(CNI_NETWORK) + 1 :].rsplit("-", 1)[0]
        for lo in results.glob(f"cni-loopback-{sandbox_id}-*"):
            lo.unlink(missing_ok=True)
        f.unlink(missing_ok=True)
    if state.get("cni") and state.get("cni_cache_existed") is False:
        for d in (results, CNI_CACHE):
            with contextlib.suppress(OSError):
                d.rmdir()


def _unmount_under(path: Path) -> list[str]:
    """Lazily unmount everything mounted at or below *path*; return what is left."""

    def mounts() -> list[str]:
        found = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                mp = line.split()[4].encode().decode("unicode_escape")
                if mp == str(path) or mp.startswith(str(path) + "/"):
                    found.append(mp)
        return found

    for mp in sorted(set(mounts()), key=len, reverse=True):
        subprocess.run(["umount", "-n", "-l", mp], capture_output=True)
    return mounts()


def _remove_cgroups(parent: str) -> list[str]:
    """rmdir empty cgroups under /sys/fs/cgroup/*/<parent>, deepest first."""
    parent = parent.strip("/")
    if not parent or not CGROUP_ROOT.is_dir():
        return []
    left = []
    for hierarchy in sorted(CGROUP_ROOT.iterdir()):
        top = hierarchy / parent
        if not top.is_dir() or top.is_symlink():
            continue
        dirs = [Path(d) for d, _, _ in os.walk(top)]
        for d in sorted(dirs, key=lambda x: len(x.parts), reverse=True):
            try:
                d.rmdir()
            except OSError:
                left.append(str(d))
    return left


def _stop(p: Paths) -> int:
    """Stop containerd and its shims, unmount, remove cgroups and DIR."""
    t0 = time.monotonic()
    if not p.dir.exists():
        log(f"{p.dir} does not exist; nothing to stop")
        return 0
    if not p.marker.exists() and any(p.dir.iterdir()):
        log(f"{p.dir} is not a sandbox dir (no {MARKER}); refusing to touch it")
        return 1
    state = _read_state(p)
    pid = _running_pid(p)
    if pid:
        try:
            _remove_pods(p)
        except (subprocess.SubprocessError, OSError) as exc:
            log(f"pod removal failed ({exc}); killing processes instead")
        _signal([pid], signal.SIGTERM)
        if _wait_gone([pid], 10):
            _signal([pid], signal.SIGKILL)
            _wait_gone([pid], 5)
        log(f"containerd pid {pid} stopped")
    registry = state.get("registry_pid")
    if isinstance(registry, int) and _is_our_registry(registry, p):
        _signal([registry], signal.SIGTERM)
        if _wait_gone([registry], 5):
            _signal([registry], signal.SIGKILL)
            _wait_gone([registry], 5)
    _runc_cleanup(p)
    shims = _our_shims(p)
    if shims:
        # Normally none are left after the pods were removed.
        log(f"killing leftover shims {shims}")
        _signal(shims, signal.SIGKILL)
        _wait_gone(shims, 5)
    _cleanup_cni_cache(state)
    left_mounts = _unmount_under(p.dir)
    left_cgroups = _remove_cgroups(state.get("cgroup_parent", DEFAULT_CGROUP_PARENT))
    if left_cgroups:
        log("cgroups still in use, kept: " + ", ".join(left_cgroups))
    if left_mounts:
        log("mounts still present, keeping the dir: " + ", ".join(left_mounts))
        return 1
    shutil.rmtree(p.dir, ignore_errors=True)
    if p.dir.exists():
        log(f"could not fully remove {p.dir}")
        return 1
    log(f"stopped and removed {p.dir} in {time.monotonic() - t0:.2f}s")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    return _stop(Paths(args.dir))


# --------------------------------------------------------------------------- status


def cmd_status(args: argparse.Namespace) -> int:
    p = Paths(args.dir)
    state = _read_state(p)
    pid = _running_pid(p)
    print(f"dir:      {p.dir}{'' if p.dir.exists() else ' (absent)'}")
    print(f"running:  {'yes' if pid else 'no'}")
    if state:
        print(f"pid:      {state.get('pid')}")
        print(f"socket:   {state.get('socket')}")
        print(f"cgroup parent: /{state.get('cgroup_parent')}")
    if pid:
        r = _ctr(p, "images", "ls", "-q", check=False)
        images = [i for i in r.stdout.split() if not i.startswith("sha256:")]
        print("images:   " + (", ".join(images) if images else "(none)"))
    shims = _our_shims(p) if p.dir.exists() else []
    if shims or pid:
        print(f"shims:    {shims}")
    if shims and not pid:
        print("warning:  containerd is gone but shims are left; run stop to clean up")
    return 0 if pid else 3
