#!/usr/bin/env python3
"""A pull-only OCI registry serving local OCI image tarballs, for CRI PullImage in the e2e sandbox.

    python3 pull_registry.py --listen 127.0.0.1:5000 REPO:TAG=TARBALL [REPO:TAG=TARBALL ...]

Each TARBALL is an OCI image layout tarball as ``build_images.py`` writes it (``index.json``
naming one manifest, ``blobs/sha256/...``); it is served as ``REPO:TAG`` through the read side
of the distribution API, which is all containerd needs to pull:

* ``GET|HEAD /v2/``: 200 (API version check, no authentication);
* ``GET|HEAD /v2/<repo>/manifests/<tag or digest>``: the manifest, with its media type and
  ``Docker-Content-Digest``;
* ``GET|HEAD /v2/<repo>/blobs/<digest>``: a config or layer blob.

Anything else is 404 (unknown name or digest) or 405 (every method but GET and HEAD). Plain
HTTP on loopback: ``containerd-sandbox`` runs it inside containerd's own network namespace and
gives containerd a ``hosts.toml`` that names it as an HTTP host. One line on stderr per request.
Stdlib only; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tarfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


class Store:
    """Manifests by (repo, tag) and (repo, digest); blobs by digest."""

    def __init__(self) -> None:
        self.manifests: dict[tuple[str, str], tuple[str, bytes, str]] = {}  # -> (digest, body, type)
        self.blobs: dict[str, bytes] = {}
        self.repos: dict[str, set[str]] = {}  # repo -> digests of its blobs and manifests

    def add(self, reference: str, tarball: str) -> None:
        repo, sep, tag = reference.rpartition(":")
        if not sep or not repo or "/" in tag:
            raise ValueError(f"{reference!r}: expected REPO:TAG")
        with tarfile.open(tarball) as tar:

            def read(name: str) -> bytes:
                member = tar.extractfile(name)
                if member is None:
                    raise ValueError(f"{tarball}: {name} is not a file")
                return member.read()

            index = json.loads(read("index.json"))
            [descriptor] = index["manifests"]
            digest = descriptor["digest"]
            body = read("blobs/" + digest.replace(":", "/"))
            manifest = json.loads(body)
            owned = {digest}
            for blob in [manifest["config"], *manifest["layers"]]:
                self.blobs[blob["digest"]] = read("blobs/" + blob["digest"].replace(":", "/"))
                owned.add(blob["digest"])
        media_type = descriptor.get("mediaType", MT_MANIFEST)
        self.manifests[(repo, tag)] = self.manifests[(repo, digest)] = (digest, body, media_type)
        self.repos.setdefault(repo, set()).update(owned)


PATH = re.compile(r"^/v2/(?P<repo>.+)/(?P<kind>manifests|blobs)/(?P<ref>[^/]+)$")


def handler(store: Store) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Docker-Distribution-API-Version", "registry/2.0")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, code: int, what: str, message: str) -> None:
            body = json.dumps({"errors": [{"code": what, "message": message}]}).encode()
            self._send(code, body, {"Content-Type": "application/json"})

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path in ("/v2", "/v2/"):
                self._send(200, b"{}", {"Content-Type": "application/json"})
                return
            match = PATH.match(path)
            if not match:
                self._error(404, "NAME_UNKNOWN", f"no such path {path}")
                return
            repo, kind, ref = match["repo"], match["kind"], match["ref"]
            if kind == "manifests":
                found = store.manifests.get((repo, ref))
                if found is None:
                    self._error(404, "MANIFEST_UNKNOWN", f"{repo}:{ref} unknown")
                    return
                digest, body, media_type = found
                self._send(200, body, {"Content-Type": media_type, "Docker-Content-Digest": digest})
            elif ref in store.repos.get(repo, ()) and ref in store.blobs:
                body = store.blobs[ref]
                self._send(
                    200, body, {"Content-Type": "application/octet-stream", "Docker-Content-Digest": ref}
                )
            else:
                self._error(404, "BLOB_UNKNOWN", f"{repo}@{ref} unknown")

        do_HEAD = do_GET

        def _refuse(self) -> None:
            self._error(405, "UNSUPPORTED", "this registry only serves pulls")

        do_POST = do_PUT = do_PATCH = do_DELETE = _refuse

        def log_message(self, format: str, *args: Any) -> None:
            print(
                f"pull_registry: {self.command} {self.path} -> {args[1] if len(args) > 1 else ''}",
                file=sys.stderr,
            )

    return Handler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="pull-only OCI registry for local image tarballs")
    ap.add_argument("--listen", default="127.0.0.1:5000", help="HOST:PORT (loopback)")
    ap.add_argument("images", nargs="+", metavar="REPO:TAG=TARBALL")
    args = ap.parse_args(argv)
    store = Store()
    for item in args.images:
        reference, sep, tarball = item.partition("=")
        if not sep:
            ap.error(f"{item!r}: expected REPO:TAG=TARBALL")
        store.add(reference, tarball)
    host, _, port = args.listen.rpartition(":")
    server = ThreadingHTTPServer((host, int(port)), handler(store))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(
        f"pull_registry: serving {', '.join(sorted({r for r, _ in store.manifests}))} on {args.listen}",
        file=sys.stderr,
        flush=True,
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
