"""The deployment files in deploy/ agree with the CLI: their flags parse and mean what the docs say."""

from __future__ import annotations

import configparser
import copy
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from krproxy import cli

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
MANIFESTS = ["daemonset.yaml", "daemonset-nri.yaml"]
PROXY_SOCKET = "/var/run/koord-runtimeproxy/runtimeproxy.sock"


def serve_args(argv: list[str]) -> Any:
    """Parse a `krproxy serve ...` command line with the real parser."""
    assert "serve" == argv[0]
    return cli.build_parser().parse_args(argv)


#: What a probe's ``krproxy status`` may take to start on a loaded node, beyond its ``--timeout`` for the
#: answer: measured in the image, 0.3 s at a load of 12 (1.1-1.4 s before it left the hooks and trace
#: parsers out); a node under heavier load took over 10 s then, so about 25 times the figure.
PROBE_STARTUP_ALLOWANCE = 7.0


def unit() -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((DEPLOY / "krproxy.service").read_text().replace("\\\n", " "))
    return parser


def daemonset() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((DEPLOY / "daemonset.yaml").read_text())
    return document


class TestSystemdUnit:
    def test_exec_start_flags_parse(self) -> None:
        """ExecStart is a valid `krproxy serve` command with the koord-compatible endpoints."""
        command = shlex.split(unit()["Service"]["ExecStart"])
        args = serve_args(command[1:])
        assert ("/usr/local/bin/krproxy", f"unix://{PROXY_SOCKET}", "127.0.0.1:9722") == (
            command[0],
            args.listen,
            args.metrics_address,
        )

    def test_ordering_and_restart(self) -> None:
        """Started after containerd and before kubelet, restarted always, given time to drain."""
        parsed = unit()
        assert ("always", "kubelet.service", "20") == (
            parsed["Service"]["Restart"],
            parsed["Unit"]["Before"],
            parsed["Service"]["TimeoutStopSec"],
        )
        assert "containerd.service" in parsed["Unit"]["After"].split()

    def test_socket_unit_listens_where_the_service_serves(self) -> None:
        """krproxy.socket (socket activation) listens on the path the service's ExecStart names,
        for the service, which wants it."""
        socket_unit = configparser.RawConfigParser(strict=False)
        socket_unit.optionxform = str  # type: ignore[assignment,method-assign]
        socket_unit.read_string((DEPLOY / "krproxy.socket").read_text())
        assert (PROXY_SOCKET, "krproxy.service", "0660") == (
            socket_unit["Socket"]["ListenStream"],
            socket_unit["Socket"]["Service"],
            socket_unit["Socket"]["SocketMode"],
        )
        assert "krproxy.socket" in unit()["Unit"]["Wants"].split()

    def test_restarting_the_service_leaves_the_socket_alone(self) -> None:
        """``systemctl restart krproxy`` must not restart krproxy.socket: that would close the
        listening socket (and the connections waiting in its backlog) exactly when it is to
        outlive the process. PartOf=, BindsTo= or Requires= on the service would propagate the
        restart or stop to the socket (systemd.unit(5))."""
        socket_unit = configparser.RawConfigParser(strict=False)
        socket_unit.optionxform = str  # type: ignore[assignment,method-assign]
        socket_unit.read_string((DEPLOY / "krproxy.socket").read_text())
        tying = {
            key: socket_unit["Unit"][key]
            for key in ("PartOf", "BindsTo", "Requires")
            if "krproxy.service" in socket_unit["Unit"].get(key, "").split()
        }
        assert {} == tying


class TestDaemonSet:
    def test_container_args_parse(self) -> None:
        """The container runs a valid `krproxy serve` on the proxy socket kubelet is switched to."""
        [container] = daemonset()["spec"]["template"]["spec"]["containers"]
        args = serve_args(container["args"])
        assert (["krproxy"], f"unix://{PROXY_SOCKET}") == (container["command"], args.listen)

    def test_probe_uses_status(self) -> None:
        """The readiness probe is `krproxy status` at the daemon's metrics address."""
        [container] = daemonset()["spec"]["template"]["spec"]["containers"]
        probe = container["readinessProbe"]["exec"]["command"]
        parsed = cli.build_parser().parse_args(probe[1:])
        assert ("status", serve_args(container["args"]).metrics_address) == (
            parsed.command,
            parsed.metrics_address,
        )

    def test_host_paths(self) -> None:
        """The proxy socket directory, containerd's socket directory and the hook directory come from the host."""
        spec = daemonset()["spec"]["template"]["spec"]
        paths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
        assert {"/var/run/koord-runtimeproxy", "/run/containerd", "/etc/runtime/hookserver.d"} <= paths
        assert (False, "OnDelete") == (spec["hostPID"], daemonset()["spec"]["updateStrategy"]["type"])


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_probe_timeout_covers_start_and_answer(manifest: str) -> None:
    """The readiness probe's timeoutSeconds leaves `krproxy status` its --timeout for the answer and
    PROBE_STARTUP_ALLOWANCE for starting on a loaded node (5 s was cut short there), within the period."""
    document = yaml.safe_load((DEPLOY / manifest).read_text())
    [container] = document["spec"]["template"]["spec"]["containers"]
    probe = container["readinessProbe"]
    status = cli.build_parser().parse_args(probe["exec"]["command"][1:])
    assert status.timeout + PROBE_STARTUP_ALLOWANCE <= probe["timeoutSeconds"] <= probe["periodSeconds"]


class TestNriDaemonSet:
    def document(self) -> dict[str, Any]:
        loaded: dict[str, Any] = yaml.safe_load((DEPLOY / "daemonset-nri.yaml").read_text())
        return loaded

    def test_args_parse_and_validate(self) -> None:
        """The container runs a valid `krproxy nri` on containerd's default NRI socket, with a probe of its status."""
        from krproxy.nri.plugin import NriConfig

        [container] = self.document()["spec"]["template"]["spec"]["containers"]
        args = cli.build_parser().parse_args(container["args"])
        assert ("nri", "unix:///var/run/nri/nri.sock") == (args.command, args.nri_socket)
        config = NriConfig(
            socket=args.nri_socket.removeprefix("unix://"),
            plugin_name=args.plugin_name,
            plugin_index=args.plugin_index,
            metrics_address=args.metrics_address,
        )
        probe = cli.build_parser().parse_args(container["readinessProbe"]["exec"]["command"][1:])
        assert ("status", config.metrics_address) == (probe.command, probe.metrics_address)

    def test_host_paths(self) -> None:
        """The NRI socket directory and the hook directory come from the host at the same paths."""
        spec = self.document()["spec"]["template"]["spec"]
        paths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
        assert {"/var/run/nri", "/etc/runtime/hookserver.d"} <= paths
        mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert {"/var/run/nri", "/etc/runtime/hookserver.d"} <= mounts


def manifest(name: str) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((DEPLOY / name).read_text())
    return document


def documented_plugin_sockets() -> set[str]:
    """Every plugin socket path the docs tell plugin authors and operators to use."""
    found = set()
    for doc in ("plugin-authoring.md", "nri.md", "operations.md"):
        text = (REPO / "docs" / doc).read_text()
        found |= set(re.findall(r"--socket[ =](/\S+\.sock)", text))
        found |= set(re.findall(r'"remote-endpoint":\s*"(?:unix://)?(/[^"]+)"', text))
        found |= set(re.findall(r"(/var/run/koordlet/\S+\.sock)", text))
    return found


@pytest.mark.parametrize("name", MANIFESTS)
def test_daemonset_mounts_documented_plugin_sockets(name: str) -> None:
    """Each plugin socket the docs name is in a host directory the DaemonSet mounts at the same path."""
    sockets = documented_plugin_sockets()
    spec = manifest(name)["spec"]["template"]["spec"]
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
    unmounted = [
        socket
        for socket in sorted(sockets)
        if not any(
            socket.startswith(path + "/") and host.get(volume) == path for path, volume in mounts.items()
        )
    ]
    assert "/run/krproxy-plugins/first-plugin.sock" in sockets, "the tutorial's socket is no longer found"
    assert [] == unmounted


@pytest.fixture
def validator() -> Any:
    """kubernetes-validate (PyPI; Kubernetes' OpenAPI schemas as JSON schemas, per release)."""
    return pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate (the test extra) is not installed for this Python"
    )


#: The oldest Kubernetes release still supported upstream when this was written, and the newest
#: the validator knows ("latest").
KUBERNETES = ["1.32", "latest"]


@pytest.mark.parametrize("version", KUBERNETES)
@pytest.mark.parametrize("name", MANIFESTS)
def test_daemonset_valid_for_kubernetes(validator: Any, name: str, version: str) -> None:
    """The DaemonSet validates strictly (no unknown field) against Kubernetes' OpenAPI schema."""
    release = validator.latest_version() if version == "latest" else version
    validator.validate(manifest(name), release, strict=True)


def test_misspelt_daemonset_field_refused(validator: Any) -> None:
    """The schema check sees a misspelt field in a volume mount, so a passing check means something."""
    document = copy.deepcopy(manifest("daemonset.yaml"))
    document["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountpath"] = "/x"
    with pytest.raises(validator.ValidationError, match="'mountpath' was unexpected"):
        validator.validate(document, validator.latest_version(), strict=True)


def systemd_verify(tmp_path: Path, service: str) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze verify`` of ``service`` and deploy/krproxy.socket, copied to ``tmp_path``.

    ExecStart's /usr/local/bin/krproxy is replaced by this environment's krproxy: verify checks
    that the program exists, and the node install puts it at /usr/local/bin.
    """
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian's systemd package)")
    krproxy = Path(sys.executable).with_name("krproxy")
    assert krproxy.exists(), f"no krproxy console script next to {sys.executable}"
    (tmp_path / "krproxy.service").write_text(service.replace("/usr/local/bin/krproxy", str(krproxy)))
    shutil.copy(DEPLOY / "krproxy.socket", tmp_path / "krproxy.socket")
    units = [str(tmp_path / "krproxy.service"), str(tmp_path / "krproxy.socket")]
    return subprocess.run([analyze, "verify", *units], capture_output=True, text=True, timeout=60)


def test_systemd_units_verify_clean(tmp_path: Path) -> None:
    """`systemd-analyze verify` accepts krproxy.service and krproxy.socket without a warning."""
    done = systemd_verify(tmp_path, (DEPLOY / "krproxy.service").read_text())
    assert (0, "") == (done.returncode, done.stderr)


def test_systemd_verify_sees_unknown_key(tmp_path: Path) -> None:
    """A misspelt directive in the unit shows in verify's output, so a clean verify means something."""
    service = (DEPLOY / "krproxy.service").read_text().replace("KillSignal=", "KilSignal=")
    assert "Unknown key 'KilSignal'" in systemd_verify(tmp_path, service).stderr
