"""containerd-sandbox ``install`` and ``fetch``: the Debian packages it needs, and the bin dir of a
containerd version (bookworm's installed package, or trixie's and sid's unpacked by fetch-debian-package).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from _sandbox.common import CNI_BIN_DIR, CNI_PACKAGE, PACKAGES, SCRIPTS, VERSIONS, log

# --------------------------------------------------------------------------- install


def _dpkg_installed(pkg: str) -> bool:
    r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True)
    return r.returncode == 0 and r.stdout.strip().endswith("install ok installed")


def _present(pkg: str, probe: str) -> bool:
    found = os.path.exists(probe) if probe.startswith("/") else bool(shutil.which(probe))
    return found and (not shutil.which("dpkg-query") or _dpkg_installed(pkg))


def cmd_install(args: argparse.Namespace) -> int:
    wanted = dict(PACKAGES)
    if args.cni:
        wanted[CNI_PACKAGE] = str(CNI_BIN_DIR / "bridge")
    missing = [pkg for pkg, probe in wanted.items() if not _present(pkg, probe)]
    if not missing:
        log("all packages present: " + ", ".join(wanted))
        return 0
    if os.geteuid() != 0:
        log("install needs root")
        return 1
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    log("installing " + " ".join(missing))
    subprocess.run(["apt-get", "update"], check=True, env=env, stdout=sys.stderr)
    subprocess.run(
        ["apt-get", "install", "-y", "--no-install-recommends", *missing],
        check=True,
        env=env,
        stdout=sys.stderr,
    )
    still = [pkg for pkg in missing if not _present(pkg, wanted[pkg])]
    if still:
        log("still missing after apt-get: " + ", ".join(still))
        return 1
    return 0


# --------------------------------------------------------------------------- fetch


class FetchError(Exception):
    """A containerd version cannot be had here; the message says why."""


def containerd_version(binary: str) -> str:
    """The version `containerd --version` reports, e.g. ``1.7.24~ds1`` or ``2.1.9+unknown``."""
    try:
        r = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        raise FetchError(f"{binary} does not run: {exc}") from exc
    # "containerd github.com/containerd/containerd/v2 2.1.9+unknown <commit>"
    words = r.stdout.split()
    if r.returncode != 0 or len(words) < 3:
        raise FetchError(f"{binary} --version failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()}")
    return words[2].lstrip("v")


def fetch(version: str, cache: str) -> Path:
    """The ``usr/bin`` holding containerd ``version`` (fetched into ``cache`` if needed)."""
    suite, prefix = VERSIONS[version]
    if suite == "bookworm":  # the machine's own package, installed by `install`
        binary = shutil.which("containerd")
        if not binary:
            raise FetchError("containerd is not installed; run `containerd-sandbox install`")
        found = containerd_version(binary)
        if not found.startswith(prefix):
            raise FetchError(f"the installed containerd is {found}, not {version}")
        return Path(binary).parent
    # fetch-debian-package: that suite of the machine's own Debian archive, private apt state, dpkg -x.
    script = SCRIPTS / "fetch-debian-package"
    fetched = subprocess.run(
        [sys.executable, str(script), suite, "containerd", f"{prefix}*", cache],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if fetched.returncode != 0:
        reason = fetched.stderr.strip().splitlines()[-1:] or [f"exit {fetched.returncode}"]
        raise FetchError(f"Debian {suite}'s containerd {prefix}*: {reason[0]}")
    bin_dir = Path(fetched.stdout.strip()) / "usr" / "bin"
    found = containerd_version(str(bin_dir / "containerd"))
    if not found.startswith(prefix):
        raise FetchError(f"{bin_dir}/containerd is {found}, not {version}")
    return bin_dir


def cmd_fetch(args: argparse.Namespace) -> int:
    try:
        bin_dir = fetch(args.version, args.cache)
    except FetchError as exc:
        log(f"containerd {args.version} unavailable: {exc}")
        return 2
    print(bin_dir)
    return 0
