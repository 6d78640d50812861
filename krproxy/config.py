"""The daemon's configuration: one frozen value built from the command line."""

from __future__ import annotations

import enum

import attrs

from krproxy._grpc import strip_unix_scheme

DEFAULT_LISTEN = "/var/run/koord-runtimeproxy/runtimeproxy.sock"
DEFAULT_RUNTIME_ENDPOINT = "/var/run/containerd/containerd.sock"
DEFAULT_HOOK_DIR = "/etc/runtime/hookserver.d"
DEFAULT_SKIP_LABEL = ("runtimeproxy.koordinator.sh/skip-hookserver", "true")


class BackendMode(enum.Enum):
    """Which runtime API sits behind the proxy (koord-runtime-proxy's ``--backend-runtime-mode``)."""

    CONTAINERD = "Containerd"
    DOCKER = "Docker"


def _socket_path(endpoint: str) -> str:
    path = strip_unix_scheme(endpoint)
    if not path:
        raise ValueError("an endpoint must name a unix socket path")
    if "://" in path:
        raise ValueError(f"only unix sockets are supported, not {endpoint!r}")
    return path


def _optional_socket_path(endpoint: str) -> str:
    return _socket_path(endpoint) if endpoint else ""


@attrs.frozen
class ProxyConfig:
    """Everything ``krproxy serve`` needs to know.

    Attributes:
        listen: socket path kubelet connects to (``unix://`` prefix stripped).
        runtime_endpoint: the backend RuntimeService socket.
        image_endpoint: the backend ImageService socket; the runtime socket when empty.
        backend_mode: the backend's API; only Containerd is served today.
        hook_dir: directory of plugin registration files.
        skip_label: pods carrying this label key=value bypass all hooks.
        socket_mode: permission bits of the listening socket.
        socket_group: group id of the listening socket, unchanged when None.
        grace_period: seconds in-flight calls may take to finish after SIGTERM.
    """

    listen: str = attrs.field(default=DEFAULT_LISTEN, converter=_socket_path)
    runtime_endpoint: str = attrs.field(default=DEFAULT_RUNTIME_ENDPOINT, converter=_socket_path)
    image_endpoint: str = attrs.field(default="", converter=_optional_socket_path)
    backend_mode: BackendMode = attrs.field(default=BackendMode.CONTAINERD, converter=BackendMode)
    hook_dir: str = DEFAULT_HOOK_DIR
    skip_label: tuple[str, str] = DEFAULT_SKIP_LABEL
    socket_mode: int = 0o660
    socket_group: int | None = None
    grace_period: float = attrs.field(default=10.0)

    @grace_period.validator
    def _check_grace(self, attribute: attrs.Attribute[float], value: float) -> None:
        if value < 0:
            raise ValueError("grace period must not be negative")

    @property
    def image_socket(self) -> str:
        return self.image_endpoint or self.runtime_endpoint
