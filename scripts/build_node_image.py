#!/usr/bin/env python3
"""Build the DaemonSets' image (deploy/daemonset*.yaml) from this repository, offline, with no Docker.

    python3 scripts/build_node_image.py [--out krproxy-image.tar] [--name krproxy.local/krproxy:0.1.0]
    python3 scripts/build_node_image.py --base-only         # the cached base alone
    ctr -n k8s.io images import krproxy-image.tar        # on each node, or push it (both as root)

The base is a Debian bookworm root made by ``debootstrap --variant=minbase --include=python3``
from the machine's Debian archive (scripts/fetch-debian-package finds it), built once and kept in
the cache (``--cache``, default $KRPROXY_IMAGE_CACHE or /var/cache/krproxy-image). Each build
copies it, installs krproxy's wheel (built from this checkout) and its dependencies from PyPI
into /usr/local/lib/krproxy with pip (``--target``, binary wheels for bookworm's CPython 3.11),
puts a ``krproxy`` launcher in /usr/local/bin, compiles every module to hash-checked .pyc (the
DaemonSet's root filesystem is read-only, so Python cannot write them at start), leaves out what
a daemon never reads (docs, man pages, locales, apt's lists and caches, dpkg's own data, Perl,
iconv's modules) and packs
the tree as a one-layer OCI image layout tarball with scripts/build_images.py's deterministic
packer. The tarball carries its name in ``io.containerd.image.name``, so ``ctr images import``
registers it under that name. ``--base-only`` makes the cached base and stops (scripts/host-setup
runs it once per test run, so that the e2e session's first image build does not debootstrap).

Needs root (debootstrap, chroot) and, for the first build, the Debian archive and PyPI (or pip's
cache). Exit 2 with one line saying why when the image cannot be built here.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.machinery
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import build_images  # noqa: E402 - needs the line above

SUITE = "bookworm"
#: bookworm's python3 is CPython 3.11: the wheels pip picks must be for it.
PYTHON_VERSION = "3.11"
#: bookworm's glibc is 2.36; pip does not widen a --platform to older manylinux tags, so name them all.
PLATFORMS = [f"manylinux_2_{minor}_{platform.machine()}" for minor in range(36, 16, -1)]
PLATFORMS.append(f"manylinux2014_{platform.machine()}")
PACKAGES = ["python3"]
IMAGE_NAME = "krproxy.local/krproxy:0.1.0"
DEFAULT_CACHE = os.environ.get("KRPROXY_IMAGE_CACHE", "/var/cache/krproxy-image")
MARKER = ".krproxy-base-complete"
LIB = "usr/local/lib/krproxy"
LAUNCHER = f"""#!/usr/bin/python3 -sE
# krproxy's console script in the image: its packages live in /{LIB}.
import sys

sys.path.insert(0, "/{LIB}")
from krproxy.cli import main

sys.exit(main())
"""
#: Left out of the layer: never read by a daemon (paths relative to the root).
SKIP = frozenset(
    {
        "usr/share/doc",
        "usr/share/man",
        "usr/share/info",
        "usr/share/locale",
        "usr/share/lintian",
        "usr/share/common-licenses",
        "var/cache/apt",
        "var/cache/debconf",
        "var/lib/apt/lists",
        "var/lib/dpkg",
        "var/log",
        # Perl, apt and iconv's modules: Debian's tools use them, Python and krproxy do not.
        "usr/bin/perl",
        "usr/bin/perl5.36.0",
        "usr/share/perl5",
        "usr/lib/x86_64-linux-gnu/perl-base",
        "usr/lib/x86_64-linux-gnu/gconv",
        "usr/lib/apt",
        "usr/lib/python3.11/ensurepip",
        "usr/lib/python3.11/idlelib",
        "usr/lib/python3.11/lib2to3",
        "usr/lib/python3.11/pydoc_data",
        "usr/lib/python3.11/turtledemo",
        "usr/lib/python3.11/unittest",
        "debootstrap",
        MARKER,
    }
)


class Unavailable(Exception):
    """The image cannot be built on this machine; the message says why and how to fix it."""


def log(message: str) -> None:
    print(f"build_node_image: {message}", file=sys.stderr, flush=True)


def _fetcher() -> ModuleType:
    """scripts/fetch-debian-package as a module: it knows the machine's Debian archive."""
    path = str(REPO / "scripts" / "fetch-debian-package")
    loader = importlib.machinery.SourceFileLoader("fetch_debian_package", path)
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    if os.geteuid() != 0:
        raise Unavailable("building the image needs root (debootstrap and chroot); run it as root")
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Unavailable(
            f"cannot make the cache directory {cache} ({exc.strerror}); pass --cache DIR"
        ) from None
    with open(cache / "lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # one base build at a time
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(command: list[str], what: str, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr, env=env)
    if done.returncode != 0:
        raise Unavailable(f"{what} failed (exit {done.returncode}, output above): {' '.join(command)}")


def ensure_base(cache: Path, rebuild: bool = False) -> Path:
    """The cached debootstrapped root (built on first use); its path."""
    with _locked(cache):
        return _ensure_base(cache, rebuild)


def _ensure_base(cache: Path, rebuild: bool) -> Path:
    root = cache / f"base-{SUITE}"
    if (root / MARKER).exists() and not rebuild:
        return root
    debootstrap = shutil.which("debootstrap") or (
        "/usr/sbin/debootstrap" if os.path.exists("/usr/sbin/debootstrap") else None
    )
    if debootstrap is None:
        raise Unavailable("debootstrap is not installed: apt-get install debootstrap")
    try:
        mirror, keyring = _fetcher().archive_uri()
    except LookupError as exc:
        raise Unavailable(str(exc)) from None
    if root.exists():
        subprocess.run(["rm", "-rf", "--one-file-system", str(root)], check=True)
    log(f"building the base: debootstrap {SUITE} from {mirror} into {root} (once)")
    command = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", debootstrap]
    command += ["--variant=minbase", f"--include={','.join(PACKAGES)}"]
    if os.path.exists(keyring):
        command.append(f"--keyring={keyring}")
    _run([*command, SUITE, str(root), mirror], f"debootstrap {SUITE}")
    (root / MARKER).write_text(json.dumps({"suite": SUITE, "packages": PACKAGES, "mirror": mirror}))
    return root


def _install_krproxy(stage: Path, work: Path) -> None:
    """krproxy's wheel from this checkout and its dependencies' wheels into ``stage / LIB``."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # At a fixed path: pip records the wheel's URL in the image (dist-info/direct_url.json).
    wheels = work.parent / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    # The wheel's zip timestamps from SOURCE_DATE_EPOCH (1980-01-01, zip's first date): the same
    # checkout gives the same wheel, whose hash pip records, so the same image.
    reproducible = {**os.environ, "SOURCE_DATE_EPOCH": "315532800"}
    _run([*pip, "wheel", "--no-deps", "-w", str(wheels), str(REPO)], "building krproxy's wheel", reproducible)
    (wheel,) = wheels.glob("krproxy-*.whl")
    target = stage / LIB
    _run(
        [
            *(
                *pip,
                "install",
                "--no-compile",
                "--no-warn-conflicts",
                "--target",
                str(target),
                "--only-binary=:all:",
            ),
            *(arg for tag in PLATFORMS for arg in ("--platform", tag)),
            *("--python-version", PYTHON_VERSION, "--implementation", "cp"),
            str(wheel),
        ],
        "installing krproxy's dependencies",
    )
    shutil.rmtree(target / "bin", ignore_errors=True)  # console scripts with the builder's shebang
    launcher = stage / "usr/local/bin/krproxy"
    launcher.parent.mkdir(parents=True, exist_ok=True)
    launcher.write_text(LAUNCHER)
    launcher.chmod(0o755)
    # Hash-checked .pyc: the layer's mtimes are 0, so timestamp-checked ones would never match.
    compile_all = ["chroot", str(stage), "python3", "-m", "compileall", "-q", "-f"]
    compile_all += [
        "--invalidation-mode",
        "unchecked-hash",
        "/usr/lib/python3",
        "/usr/lib/python3.11",
        f"/{LIB}",
    ]
    _run(compile_all, "compiling the modules")


def build(out: Path, name: str = IMAGE_NAME, cache: Path = Path(DEFAULT_CACHE)) -> build_images.BuiltImage:
    """Build the image tarball at ``out``; raises :class:`Unavailable` saying why it cannot."""
    with _locked(cache):  # one build at a time per cache (the e2e matrix runs in parallel)
        return _build(out, name, cache)


def _build(out: Path, name: str, cache: Path) -> build_images.BuiltImage:
    base = _ensure_base(cache, rebuild=False)
    with tempfile.TemporaryDirectory(prefix="krproxy-image-", dir=cache) as tmp:
        work = Path(tmp)
        stage = work / "root"
        _run(["cp", "-a", str(base), str(stage)], "copying the base")
        _install_krproxy(stage, work)
        layer = build_images._LayerWriter()
        layer.tree(str(stage), SKIP)
        digest = build_images.write_oci_tar(
            str(out),
            name,
            layer.finish(),
            cmd=["krproxy", "--help"],
            env=["PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONDONTWRITEBYTECODE=1"],
        )
    return build_images.BuiltImage(name, str(out), digest, f"Debian {SUITE} minbase + python3 + krproxy")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", default="krproxy-image.tar", help="the OCI tarball to write (default %(default)s)"
    )
    ap.add_argument("--name", default=IMAGE_NAME, help="the image's name (default %(default)s)")
    ap.add_argument(
        "--cache", default=DEFAULT_CACHE, help="where the base root is kept (default %(default)s)"
    )
    ap.add_argument("--rebuild-base", action="store_true", help="debootstrap the base again")
    ap.add_argument(
        "--base-only",
        action="store_true",
        help="make the cached base only, no image (scripts/host-setup does, once per test run)",
    )
    args = ap.parse_args(argv)
    started = time.monotonic()
    try:
        if args.rebuild_base or args.base_only:
            cached = (Path(args.cache) / f"base-{SUITE}" / MARKER).exists() and not args.rebuild_base
            base = ensure_base(Path(args.cache), rebuild=args.rebuild_base)
        if args.base_only:
            how = "cached" if cached else f"built in {time.monotonic() - started:.0f} s"
            print(f"the image base {base} ({how})")
            return 0
        image = build(Path(args.out), args.name, Path(args.cache))
    except Unavailable as exc:
        print(f"build_node_image: cannot build the image: {exc}", file=sys.stderr)
        return 2
    size = os.path.getsize(image.tar_path)
    print(f"{image.name} -> {image.tar_path} ({image.manifest_digest}; {size / 1e6:.1f} MB; "
          f"{time.monotonic() - started:.0f} s; {image.note})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
