#!/usr/bin/env python3
"""Build tiny OCI image tarballs locally, with no registry and no network.

The end-to-end sandbox (``scripts/containerd-sandbox``) needs two images:

* a **busybox** image: a single uncompressed layer holding Debian's
  ``busybox-static`` binary as ``/bin/busybox`` plus one symlink per applet
  (``sh``, ``sleep``, ``cat``, ``echo``, ``ls``, ...), a minimal
  ``/etc/passwd`` / ``/etc/group`` and a world-writable ``/tmp``;
* a **pause** image used as the CRI ``sandbox_image``.  When ``gcc`` can link
  statically we compile a few-line C program (pause(2) in a loop, exit 0 on
  SIGTERM/SIGINT, reap children on SIGCHLD).  Otherwise we fall back to the
  busybox binary running ``sleep`` for a very long time; that works the same
  for the CRI (the sandbox is always stopped with SIGKILL) but is ~1 MB bigger.

The tarballs use the OCI image layout (``oci-layout``, ``index.json``,
``blobs/sha256/...``) and carry the image name in the
``io.containerd.image.name`` annotation, so ``ctr images import`` registers the
image under that name without extra flags.

Traps handled here:

* The busybox binary must be static: the image has no libc.  A dynamically
  linked ``/bin/busybox`` (Debian's ``busybox`` package instead of
  ``busybox-static``) would give containers that fail with "no such file or
  directory" at exec.  We check the ELF program headers for ``PT_INTERP``.
* Everything is deterministic (sorted entries, mtime 0, uid/gid 0), so the
  digests only change when the inputs change.
* Layers are stored uncompressed, so the layer digest equals its diff_id.

Usable as a module (``build_busybox_image``, ``build_pause_image``) or as a
script: ``python3 build_images.py OUTDIR``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass

BUSYBOX_IMAGE = "krproxy.local/busybox:latest"
PAUSE_IMAGE = "krproxy.local/pause:latest"

MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER = "application/vnd.oci.image.layer.v1.tar"
MT_INDEX = "application/vnd.oci.image.index.v1+json"

# Applets linked when `busybox --list` cannot be run (it always can for a
# working static busybox; this is only a safety net).
FALLBACK_APPLETS = [
    "sh",
    "ash",
    "sleep",
    "cat",
    "echo",
    "ls",
    "true",
    "false",
    "env",
    "ps",
    "kill",
    "id",
    "mkdir",
    "rm",
    "touch",
    "date",
    "head",
    "tail",
    "grep",
    "wc",
    "hostname",
    "ip",
    "nproc",
    "printf",
    "test",
    "[",
    "sed",
    "awk",
    "tee",
]

PAUSE_C_SOURCE = r"""
/* Minimal pause process for a pod sandbox: sleep until killed. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) { (void)sig; _exit(0); }
static void on_chld(int sig) { (void)sig; while (waitpid(-1, 0, WNOHANG) > 0) {} }

int main(void) {
    signal(SIGTERM, on_term);
    signal(SIGINT, on_term);
    signal(SIGCHLD, on_chld);
    for (;;) pause();
}
"""


@dataclass(frozen=True)
class BuiltImage:
    """What was written: image name, tarball path, manifest digest, how built."""

    name: str
    tar_path: str
    manifest_digest: str
    note: str


def oci_arch() -> str:
    """Map the kernel's machine name to the OCI/Go architecture name."""
    machine = platform.machine()
    return {
        "x86_64": "amd64",
        "aarch64": "arm64",
        "armv7l": "arm",
        "ppc64le": "ppc64le",
        "s390x": "s390x",
        "i686": "386",
    }.get(machine, machine)


def elf_is_static(path: str) -> bool:
    """True if *path* is an ELF file without a PT_INTERP program header.

    A binary with PT_INTERP needs a dynamic loader (and a libc) in the image.
    """
    with open(path, "rb") as f:
        ident = f.read(16)
        if ident[:4] != b"\x7fELF":
            return False
        is64 = ident[4] == 2
        endian = "<" if ident[5] == 1 else ">"
        if is64:
            f.seek(0x20)
            (phoff,) = struct.unpack(endian + "Q", f.read(8))
            f.seek(0x36)
        else:
            f.seek(0x1C)
            (phoff,) = struct.unpack(endian + "I", f.read(4))
            f.seek(0x2A)
        phentsize, phnum = struct.unpack(endian + "HH", f.read(4))
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            (p_type,) = struct.unpack(endian + "I", f.read(4))
            if p_type == 3:  # PT_INTERP
                return False
    return True


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class _LayerWriter:
    """Deterministic in-memory tar builder for one image layer."""

    def __init__(self) -> None:
        self._buf = io.BytesIO()
        # Closed in finish(): the writer is a builder, not a context manager.
        self._tar = tarfile.open(fileobj=self._buf, mode="w", format=tarfile.PAX_FORMAT)  # noqa: SIM115

    def _info(self, name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.type = kind
        ti.mode = mode
        ti.mtime = 0
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = "root"
        return ti

    def dir(self, name: str, mode: int = 0o755) -> None:
        self._tar.addfile(self._info(name, tarfile.DIRTYPE, mode))

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        ti = self._info(name, tarfile.REGTYPE, mode)
        ti.size = len(data)
        self._tar.addfile(ti, io.BytesIO(data))

    def symlink(self, name: str, target: str) -> None:
        ti = self._info(name, tarfile.SYMTYPE, 0o777)
        ti.linkname = target
        self._tar.addfile(ti)

    def hardlink(self, name: str, target: str) -> None:
        ti = self._info(name, tarfile.LNKTYPE, 0o644)
        ti.linkname = target
        self._tar.addfile(ti)

    def tree(self, root: str, skip: frozenset[str] = frozenset()) -> None:
        """Add every directory, file and symlink under ``root`` (sorted; mode kept, owner 0, mtime 0).

        ``skip``: paths relative to ``root`` left out with all below them. Device nodes, FIFOs and
        sockets are left out (the runtime provides /dev); a file's further hard links are tar
        hard links to its first name.
        """
        first_names: dict[tuple[int, int], str] = {}
        for here, dirs, files in os.walk(root):
            rel_here = os.path.relpath(here, root)
            dirs[:] = sorted(d for d in dirs if os.path.normpath(os.path.join(rel_here, d)) not in skip)
            for entry in [*dirs, *sorted(files)]:
                path = os.path.join(here, entry)
                name = os.path.normpath(os.path.join(rel_here, entry))
                if name in skip:
                    continue
                st = os.lstat(path)
                mode = st.st_mode & 0o7777
                if os.path.islink(path):
                    self.symlink(name, os.readlink(path))
                elif os.path.isdir(path):
                    self.dir(name, mode)
                elif os.path.isfile(path):
                    if st.st_nlink > 1 and (st.st_dev, st.st_ino) in first_names:
                        self.hardlink(name, first_names[(st.st_dev, st.st_ino)])
                        continue
                    first_names[(st.st_dev, st.st_ino)] = name
                    with open(path, "rb") as f:
                        self.file(name, f.read(), mode)

    def finish(self) -> bytes:
        self._tar.close()
        return self._buf.getvalue()


def write_oci_tar(
    out_path: str,
    name: str,
    layer: bytes,
    *,
    entrypoint: list[str] | None = None,
    cmd: list[str] | None = None,
    env: list[str] | None = None,
) -> str:
    """Write a one-layer OCI layout tarball; return the manifest digest."""
    arch = oci_arch()
    layer_digest = _sha256(layer)
    config_obj = {
        "architecture": arch,
        "os": "linux",
        "config": {
            "Env": env or ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
            "Entrypoint": entrypoint,
            "Cmd": cmd,
            "WorkingDir": "/",
        },
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created_by": "krproxy scripts/build_images.py"}],
    }
    config = json.dumps(config_obj, sort_keys=True, separators=(",", ":")).encode()
    manifest_obj = {
        "schemaVersion": 2,
        "mediaType": MT_MANIFEST,
        "config": {"mediaType": MT_CONFIG, "digest": _sha256(config), "size": len(config)},
        "layers": [{"mediaType": MT_LAYER, "digest": layer_digest, "size": len(layer)}],
    }
    manifest = json.dumps(manifest_obj, sort_keys=True, separators=(",", ":")).encode()
    manifest_digest = _sha256(manifest)
    tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else "latest"
    index_obj = {
        "schemaVersion": 2,
        "mediaType": MT_INDEX,
        "manifests": [
            {
                "mediaType": MT_MANIFEST,
                "digest": manifest_digest,
                "size": len(manifest),
                "platform": {"architecture": arch, "os": "linux"},
                "annotations": {
                    # ctr/containerd use this one as the full image name.
                    "io.containerd.image.name": name,
                    "org.opencontainers.image.ref.name": tag,
                },
            }
        ],
    }
    index = json.dumps(index_obj, sort_keys=True, separators=(",", ":")).encode()

    outer = _LayerWriter()
    outer.file("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
    outer.dir("blobs")
    outer.dir("blobs/sha256")
    blobs = {layer_digest: layer, _sha256(config): config, manifest_digest: manifest}
    for digest in sorted(blobs):
        outer.file("blobs/sha256/" + digest.split(":", 1)[1], blobs[digest])
    outer.file("index.json", index)
    data = outer.finish()

    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = out_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, out_path)
    return manifest_digest


def _busybox_applets(busybox: str) -> list[str]:
    try:
        out = subprocess.run(
            [busybox, "--list"], check=True, capture_output=True, text=True, timeout=10
        ).stdout
        applets = [a.strip() for a in out.split() if a.strip()]
    except (OSError, subprocess.SubprocessError):
        applets = []
    return sorted(set(applets or FALLBACK_APPLETS) - {"busybox"})


def _base_rootfs(layer: _LayerWriter) -> None:
    """Directories and files every image here gets."""
    for d in ("bin", "dev", "etc", "proc", "sys", "root", "usr", "usr/bin", "var"):
        layer.dir(d, 0o700 if d == "root" else 0o755)
    layer.dir("tmp", 0o1777)
    layer.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
    layer.file("etc/group", b"root:x:0:\nnogroup:x:65534:\n")


def build_busybox_image(
    out_path: str, busybox: str = "/bin/busybox", name: str = BUSYBOX_IMAGE, env: list[str] | None = None
) -> BuiltImage:
    """Image with a static busybox and a symlink per applet in /bin (``env``: the config's Env)."""
    if not os.path.exists(busybox):
        raise FileNotFoundError(f"{busybox} not found (apt-get install busybox-static)")
    if not elf_is_static(busybox):
        raise RuntimeError(f"{busybox} is dynamically linked; install busybox-static")
    with open(busybox, "rb") as f:
        binary = f.read()
    layer = _LayerWriter()
    _base_rootfs(layer)
    layer.file("bin/busybox", binary, 0o755)
    for applet in _busybox_applets(busybox):
        if "/" in applet:
            continue
        layer.symlink("bin/" + applet, "busybox")
    digest = write_oci_tar(out_path, name, layer.finish(), cmd=["sh"], env=env)
    return BuiltImage(name, out_path, digest, f"busybox from {busybox}")


def _compile_pause(workdir: str) -> bytes | None:
    """Compile the C pause program statically; None if gcc/libc.a is missing."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if not gcc:
        return None
    src = os.path.join(workdir, "pause.c")
    exe = os.path.join(workdir, "pause")
    with open(src, "w") as f:
        f.write(PAUSE_C_SOURCE)
    try:
        subprocess.run(
            [gcc, "-static", "-Os", "-s", "-o", exe, src],
            check=True,
            capture_output=True,
            timeout=120,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if not elf_is_static(exe):
        return None
    with open(exe, "rb") as f:
        return f.read()


def build_pause_image(out_path: str, busybox: str = "/bin/busybox", name: str = PAUSE_IMAGE) -> BuiltImage:
    """Pause image: compiled static pause binary, else busybox `sleep`."""
    layer = _LayerWriter()
    _base_rootfs(layer)
    with tempfile.TemporaryDirectory(prefix="krproxy-pause-") as tmp:
        binary = _compile_pause(tmp)
    if binary is not None:
        layer.file("pause", binary, 0o755)
        entrypoint = ["/pause"]
        note = "static C pause binary built with gcc"
    else:
        if not elf_is_static(busybox):
            raise RuntimeError(f"no gcc and {busybox} is not static: cannot build pause")
        with open(busybox, "rb") as f:
            layer.file("bin/busybox", f.read(), 0o755)
        # ~68 years; `sleep infinity` needs a busybox build option.
        entrypoint = ["/bin/busybox", "sleep", "2147483647"]
        note = "busybox sleep fallback (gcc -static unavailable)"
    digest = write_oci_tar(out_path, name, layer.finish(), entrypoint=entrypoint)
    return BuiltImage(name, out_path, digest, note)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", help="directory for busybox.tar and pause.tar")
    ap.add_argument("--busybox", default="/bin/busybox")
    args = ap.parse_args(argv)
    for img in (
        build_busybox_image(os.path.join(args.outdir, "busybox.tar"), args.busybox),
        build_pause_image(os.path.join(args.outdir, "pause.tar"), args.busybox),
    ):
        print(f"{img.name} -> {img.tar_path} ({img.manifest_digest}; {img.note})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
