"""ProxyConfig: endpoint spelling rules and validation."""

from __future__ import annotations

import pytest

from krproxy.config import BackendMode, ProxyConfig


class TestEndpoints:
    @pytest.mark.parametrize(
        "endpoint",
        [
            "unix:///run/containerd/containerd.sock",
            "unix:/run/containerd/containerd.sock",
            "/run/containerd/containerd.sock",
        ],
    )
    def test_unix_spellings(self, endpoint: str) -> None:
        """unix://, unix: and a bare absolute path all name the same socket file."""
        assert "/run/containerd/containerd.sock" == ProxyConfig(runtime_endpoint=endpoint).runtime_endpoint

    @pytest.mark.parametrize(
        ("endpoint", "problem"),
        [
            ("tcp://10.0.0.1:2375", "only unix sockets are supported"),
            ("npipe:////./pipe/x", "only unix sockets are supported"),
            ("run/containerd.sock", "must be absolute"),
            ("unix://run/containerd.sock", "must be absolute"),
            ("unix://", "must name a unix socket path"),
        ],
    )
    def test_refused(self, endpoint: str, problem: str) -> None:
        """Other schemes, relative paths and empty paths are refused with a reason."""
        with pytest.raises(ValueError, match=problem):
            ProxyConfig(runtime_endpoint=endpoint)

    def test_image_endpoint_defaults_to_runtime(self) -> None:
        """Without an image endpoint, the image service is the runtime socket."""
        config = ProxyConfig(runtime_endpoint="/run/a.sock")
        assert "/run/a.sock" == config.image_socket
        assert (
            "/run/b.sock"
            == ProxyConfig(runtime_endpoint="/run/a.sock", image_endpoint="unix:///run/b.sock").image_socket
        )

    def test_backend_mode_by_name(self) -> None:
        """The backend mode is given by koord-runtime-proxy's names."""
        assert BackendMode.DOCKER is ProxyConfig(backend_mode="Docker").backend_mode  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="Dockerd"):
            ProxyConfig(backend_mode="Dockerd")  # type: ignore[arg-type]
