"""containerd-sandbox ``start``: a private containerd in its own mount and network namespace,
with the test images imported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import build_images

from _sandbox.common import CNI_CACHE, K8S_NS, Paths, log
from _sandbox.config import (
    PULL_IMAGE,
    PULL_IMAGE_ENV,
    render_config,
    start_registry,
    write_cni,
    write_registry_hosts,
)
from _sandbox.install import FetchError, containerd_version
from _sandbox.processes import _ctr, _running_pid, _wait_ready
from _sandbox.stop import _stop


def cmd_start(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    p = Paths(args.dir)
    bin_dir = Path(args.bin_dir).resolve() if args.bin_dir else None
    path = os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]) if bin_dir else None
    for tool in ("containerd", "ctr", "runc", "unshare", "mount"):
        if not shutil.which(tool, path=path):
            log(f"{tool} not found; run `{sys.argv[0]} install` (and `fetch`) first")
            return 1
    try:
        version = containerd_version(str(shutil.which("containerd", path=path)))
    except FetchError as exc:
        log(str(exc))
        return 1
    major = int(version.split(".")[0]) if version.split(".")[0].isdigit() else 1
    parts = version.split(".")
    minor = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    pid = _running_pid(p)
    if pid:
        log(f"containerd already running from {p.dir} (pid {pid}); stop it first")
        return 1
    if p.dir.exists() and any(p.dir.iterdir()):
        log(f"{p.dir} holds a stale sandbox; cleaning it first")
        if _stop(p) != 0:
            return 1

    for d in (p.dir, p.root, p.state, p.run, p.opt, p.images):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(p.dir, 0o711)
    p.marker.write_text("created by scripts/containerd-sandbox\n")

    # Images first: if this fails there is nothing to clean up.
    busybox = build_images.build_busybox_image(str(p.images / "busybox.tar"))
    # The registry's image: busybox's layer with its own config (one more Env entry), so that a
    # pull downloads a manifest and a config blob containerd does not have yet.
    pulled = build_images.build_busybox_image(str(p.images / "pull.tar"), name=PULL_IMAGE, env=PULL_IMAGE_ENV)
    pause = build_images.build_pause_image(str(p.images / "pause.tar"))
    log(f"built {busybox.name} and {pause.name} ({pause.note})")

    cni = write_cni(p)
    write_registry_hosts(p)
    config = render_config(p, pause.name, major, minor)
    if args.config_import:  # e.g. the NRI validator's settings, for a test; top level, before any table
        imports = "imports = [" + ", ".join(f'"{path}"' for path in args.config_import) + "]\n"
        config = config.replace("\nroot = ", f"\n{imports}root = ", 1)
    p.config.write_text(config)

    # unshare execs sh, which execs containerd: the Popen PID is containerd's.
    inner = (
        'set -e; mount -n --bind "$1" /run; '
        "{ ip link set lo up 2>/dev/null || /bin/busybox ip link set lo up; }; "
        'exec containerd --config "$2"'
    )
    with open(p.log, "ab") as logf:
        proc = subprocess.Popen(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "--net",
                "--",
                "/bin/sh",
                "-c",
                inner,
                "sh",
                str(p.run),
                str(p.config),
            ],
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            env=dict(os.environ, PATH=path) if path else None,  # containerd finds its shim on PATH
        )
    state = {
        "pid": proc.pid,
        "dir": str(p.dir),
        "socket": str(p.sock),
        "endpoint": f"unix://{p.sock}",
        "config": str(p.config),
        "config_version": 3 if major >= 2 else 2,
        "containerd_version": version,
        "bin_dir": str(bin_dir) if bin_dir else "",
        "log": str(p.log),
        "namespace": K8S_NS,
        "busybox_image": busybox.name,
        "pause_image": pause.name,
        "pause_note": pause.note,
        "cgroup_parent": args.cgroup_parent,
        "cni": cni,
        "cni_cache_existed": CNI_CACHE.exists(),
        "images_imported": [],
    }
    p.state_file.write_text(json.dumps(state, indent=2) + "\n")
    try:
        _wait_ready(p, proc, args.timeout)
        for img in (pause, busybox):
            _ctr(p, "images", "import", "--snapshotter", "overlayfs", img.tar_path, timeout=120)
            state["images_imported"].append(img.name)
        state["registry_pid"] = start_registry(p, proc.pid, pulled.tar_path)
        state["pull_image"] = PULL_IMAGE
        state["pull_image_env"] = PULL_IMAGE_ENV
        p.state_file.write_text(json.dumps(state, indent=2) + "\n")
    except Exception as exc:  # leave nothing behind on a failed start
        log(f"start failed: {exc}")
        if not args.keep_on_failure:
            _stop(p)
        return 1
    log(f"containerd {version} pid {proc.pid} ready in {time.monotonic() - t0:.2f}s; log {p.log}")
    print(p.sock)
    return 0
