"""The pure parts of the e2e scripts: containerd configs per version, the matrix's counts, version prefixes."""

from __future__ import annotations

import ast
import hashlib
import http.client
import importlib.machinery
import importlib.util
import sys
import threading
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load(name: str) -> ModuleType:
    """Import ``scripts/<name>`` (with or without a .py suffix) as a module."""
    loader = importlib.machinery.SourceFileLoader(
        name.removesuffix(".py").replace("-", "_"), str(SCRIPTS / name)
    )
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # dataclasses look their module up there
    before, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ in scripts/
    try:
        loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = before
    return module


@pytest.fixture(scope="module")
def sandbox() -> ModuleType:
    return load("containerd-sandbox")


class TestContainerdConfig:
    def config(self, sandbox: ModuleType, tmp_path: Path, major: int, minor: int = 6) -> dict[str, Any]:
        text = sandbox.render_config(sandbox.Paths(str(tmp_path)), "krproxy.local/pause:latest", major, minor)
        return tomllib.loads(text)

    def test_nri_on_for_1_7_only(self, sandbox: ModuleType, tmp_path: Path) -> None:
        """containerd 1.7 gets NRI turned on (it ships it off; 2.x has it on by default); 1.6 has none to turn on."""
        nri = self.config(sandbox, tmp_path, 1, 7)["plugins"]["io.containerd.nri.v1.nri"]
        assert (False, False) == (nri["disable"], nri["disable_connections"])
        assert "io.containerd.nri.v1.nri" not in self.config(sandbox, tmp_path, 1, 6)["plugins"]

    def test_version_2_for_containerd_1(self, sandbox: ModuleType, tmp_path: Path) -> None:
        config = self.config(sandbox, tmp_path, 1)
        assert 2 == config["version"]
        cri = config["plugins"]["io.containerd.grpc.v1.cri"]
        assert ("krproxy.local/pause:latest", True) == (cri["sandbox_image"], cri["restrict_oom_score_adj"])
        assert "overlayfs" == cri["containerd"]["snapshotter"]
        runtimes = cri["containerd"]["runtimes"]
        assert runtimes["runc"]["options"]["SystemdCgroup"] is False
        assert (
            f"{tmp_path}/krproxy-oci/krproxy-runc-wrapper" == runtimes["krproxy-oci"]["options"]["BinaryName"]
        )
        assert str(tmp_path / "cni" / "bin") == cri["cni"]["bin_dir"]
        assert sandbox.STATS_COLLECT_PERIOD == cri["stats_collect_period"]
        assert str(tmp_path / "certs.d") == cri["registry"]["config_path"]
        assert "io.containerd.cri.v1.runtime" not in config["plugins"]

    def test_version_3_for_containerd_2(self, sandbox: ModuleType, tmp_path: Path) -> None:
        """The same settings under 2.x's plugin names; nothing left in 1.x's places but the stream server."""
        config = self.config(sandbox, tmp_path, 2)
        assert 3 == config["version"]
        plugins = config["plugins"]
        images, runtime = plugins["io.containerd.cri.v1.images"], plugins["io.containerd.cri.v1.runtime"]
        assert "krproxy.local/pause:latest" == images["pinned_images"]["sandbox"]
        assert ("overlayfs", sandbox.STATS_COLLECT_PERIOD) == (
            images["snapshotter"],
            images["stats_collect_period"],
        )
        assert str(tmp_path / "certs.d") == images["registry"]["config_path"]
        assert runtime["restrict_oom_score_adj"] is True
        runtimes = runtime["containerd"]["runtimes"]
        assert runtimes["runc"]["options"]["SystemdCgroup"] is False
        assert ["krproxy.e2e/*"] == runtimes["krproxy-oci"]["pod_annotations"]
        assert [str(tmp_path / "cni" / "bin")] == runtime["cni"]["bin_dirs"]
        assert {"stream_server_address", "stream_server_port"} == set(plugins["io.containerd.grpc.v1.cri"])
        assert "io.containerd.nri.v1.nri" not in plugins  # NRI as 2.x's default has it

    @pytest.mark.parametrize("major", [1, 2])
    def test_every_path_inside_the_sandbox_dir(self, sandbox: ModuleType, tmp_path: Path, major: int) -> None:
        config = self.config(sandbox, tmp_path, major)
        paths = [config["root"], config["state"], config["grpc"]["address"], config["ttrpc"]["address"]]
        paths.append(config["plugins"]["io.containerd.internal.v1.opt"]["path"])
        assert all(Path(p).is_relative_to(tmp_path) for p in paths), paths


def test_matrix_counts_from_junit(tmp_path: Path) -> None:
    matrix = load("e2e-matrix")
    junit = tmp_path / "r.xml"
    junit.write_text(
        "<testsuites><testsuite>"
        '<testcase name="a"/><testcase name="b"/>'
        '<testcase name="c"><failure message="boom"/></testcase>'
        '<testcase name="d"><error message="setup"/></testcase>'
        '<testcase name="e"><skipped message="containerd 1.7 cannot be had here: no root&#10;more"/></testcase>'
        '<testcase name="f"><skipped message="containerd 1.7 cannot be had here: no root"/></testcase>'
        "</testsuite></testsuites>"
    )
    found = matrix.counts(junit)
    assert (2, 2, 2) == (found.passed, found.failed, found.skipped)
    assert ["containerd 1.7 cannot be had here: no root"] == found.reasons
    job = matrix.Job("containerd-1.7", [], {}, version="1.7.24~ds1")
    lines = matrix.summary([matrix.Result(job, 0, 12.4, tmp_path / "log", found)], 20.0).splitlines()
    assert lines[1].split() == [
        *(
            "containerd-1.7",
            "(1.7.24~ds1)",
            "passed",
            "2",
            "failed",
            "2",
            "skipped",
            "2",
            "(12",
            "s,",
            "exit",
            "0)",
        ),
    ]
    assert "skipped: containerd 1.7 cannot be had here: no root" == lines[2].strip()
    assert "wall time 20 s" == lines[3].strip()
    missing = matrix.counts(tmp_path / "absent.xml")
    assert (0, 0, 0, ["no JUnit report: pytest did not finish"]) == (
        missing.passed,
        missing.failed,
        missing.skipped,
        missing.reasons,
    )


def test_fetch_debian_package_version_prefix(tmp_path: Path) -> None:
    """A ``*`` prefix finds the newest unpacked match and never a half-unpacked one."""
    fetch = load("fetch-debian-package")
    for name in (
        "containerd_1.7.9-1",
        "containerd_1.7.24~ds1-6",
        "containerd_1.7.30.partial",
        "containerd_2.1.9-5",
    ):
        (tmp_path / name / "usr").mkdir(parents=True)
    assert str(tmp_path / "containerd_1.7.24~ds1-6") == fetch._unpacked(str(tmp_path), "containerd", "1.7.*")
    assert str(tmp_path / "containerd_2.1.9-5") == fetch._unpacked(str(tmp_path), "containerd", "2.*")
    assert fetch._unpacked(str(tmp_path), "containerd", "1.8.*") is None
    assert str(tmp_path / "containerd_1.7.9-1") == fetch._unpacked(str(tmp_path), "containerd", "1.7.9-1")


def test_the_matrix_is_debian_s_containerd(sandbox: ModuleType) -> None:
    """The matrix runs what the machine's Debian archive provides: bookworm's 1.6, trixie's 1.7 and
    sid's 2.x, no prebuilt archive beside the repository."""
    assert ("1.6", "1.7", "2.x") == load("e2e-matrix").VERSIONS
    assert {"1.6": ("bookworm", "1.6."), "1.7": ("trixie", "1.7."), "2.x": ("sid", "2.")} == sandbox.VERSIONS


def test_pull_registry_serves_only_pulls(tmp_path: Path) -> None:
    """Manifest by tag and digest, blobs of that repository; 404 for anything unknown, 405 for writes."""
    images = load("build_images.py")
    registry = load("pull_registry.py")
    layer = images._LayerWriter()
    layer.file("hello", b"hi\n")
    tarball = str(tmp_path / "img.tar")
    manifest_digest = images.write_oci_tar(tarball, "x/y:z", layer.finish(), cmd=["/hello"])
    store = registry.Store()
    store.add("krproxy/test:pull", tarball)
    server = registry.ThreadingHTTPServer(("127.0.0.1", 0), registry.handler(store))
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:

        def call(method: str, path: str) -> tuple[int, dict[str, str], bytes]:
            conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
            try:
                conn.request(method, path)
                reply = conn.getresponse()
                return reply.status, dict(reply.getheaders()), reply.read()
            finally:
                conn.close()

        assert 200 == call("GET", "/v2/")[0]
        status, headers, body = call("HEAD", "/v2/krproxy/test/manifests/pull")
        assert (200, manifest_digest, b"") == (status, headers["Docker-Content-Digest"], body)
        status, headers, body = call("GET", f"/v2/krproxy/test/manifests/{manifest_digest}")
        assert "sha256:" + hashlib.sha256(body).hexdigest() == manifest_digest
        config = registry.json.loads(body)["config"]["digest"]
        status, _, blob = call("GET", f"/v2/krproxy/test/blobs/{config}")
        assert (200, config) == (status, "sha256:" + hashlib.sha256(blob).hexdigest())
        assert 404 == call("GET", f"/v2/other/repo/blobs/{config}")[0]
        assert 404 == call("GET", "/v2/krproxy/test/manifests/latest")[0]
        assert 405 == call("PUT", "/v2/krproxy/test/manifests/pull")[0]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class TestSandboxSmokeDeadlines:
    def test_every_cri_call_has_kubelets_deadline(self) -> None:
        """Each CRI call of sandbox_smoke.py passes a deadline taken from krproxy.kubelet (kubelet's
        own, with its default flags), never a literal number of seconds and never none at all."""
        tree = ast.parse((SCRIPTS / "sandbox_smoke.py").read_text())
        calls = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in ("rt", "img")
        ]
        calls += [  # the clean-up loop calls the stub methods through a variable
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "call"
        ]
        assert len(calls) >= 14
        wrong = []
        for call in calls:
            deadline = next((k.value for k in call.keywords if k.arg == "timeout"), None)
            if deadline is None or "kubelet." not in ast.unparse(deadline):
                wrong.append(
                    f"line {call.lineno}: {ast.unparse(call.func)}(timeout={ast.unparse(deadline) if deadline else None})"
                )
        assert [] == wrong
