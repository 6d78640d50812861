"""What every part of containerd-sandbox shares: its defaults, the containerd versions it runs,
its log, and the files of one sandbox directory (:class:`Paths`).
"""

from __future__ import annotations

import sys
from pathlib import Path

DEFAULT_DIR = "/tmp/krproxy-containerd"
DEFAULT_CGROUP_PARENT = "krproxy-e2e"
K8S_NS = "k8s.io"
MARKER = ".krproxy-containerd-sandbox"
CGROUP_ROOT = Path("/sys/fs/cgroup")

# Debian packages and the file that proves each one is installed.
PACKAGES = {"containerd": "containerd", "runc": "runc", "busybox-static": "/bin/busybox"}
CNI_PACKAGE = "containernetworking-plugins"
CNI_BIN_DIR = Path("/usr/lib/cni")
CNI_NETWORK = "krproxy-e2e"
#: The containerd versions the e2e matrix runs: label -> (Debian suite, version prefix it must have).
#: 1.6 is the machine's own package (bookworm); the others are fetched, never installed.
VERSIONS = {
    "1.6": ("bookworm", "1.6."),
    "1.7": ("trixie", "1.7."),
    "2.x": ("sid", "2."),
}
#: scripts/, where the helper scripts containerd-sandbox runs are.
SCRIPTS = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = "/var/cache/krproxy-debs"  # fetch-debian-package's
# libcni (inside containerd) caches ADD results here; containerd 1.6 has no
# setting to move it.  See _cleanup_cni_cache.
CNI_CACHE = Path("/var/lib/cni")


def log(msg: str) -> None:
    """Progress goes to stderr; stdout is reserved for values scripts consume."""
    print(f"[containerd-sandbox] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- paths


class Paths:
    """All the files of one sandbox directory."""

    def __init__(self, root: str) -> None:
        self.dir = Path(root).resolve()
        self.config = self.dir / "config.toml"
        self.root = self.dir / "root"
        self.state = self.dir / "state"
        self.run = self.dir / "run"
        self.opt = self.dir / "opt"
        self.sock = self.dir / "containerd.sock"
        self.ttrpc = self.dir / "containerd.sock.ttrpc"
        self.log = self.dir / "containerd.log"
        self.images = self.dir / "images"
        self.cni_conf = self.dir / "cni" / "conf"
        self.cni_bin = self.dir / "cni" / "bin"
        self.cni_data = self.dir / "cni" / "ipam"
        self.state_file = self.dir / "sandbox.json"
        self.certs = self.dir / "certs.d"  # containerd's registry host configs (config_path)
        self.registry_log = self.dir / "registry.log"
        self.marker = self.dir / MARKER
