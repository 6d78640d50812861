"""The daemon's configuration: one frozen value built from the command line."""

from __future__ import annotations

import enum
import ipaddress
import os
import re
from collections.abc import Iterable

import attrs

from krproxy.hooks.required import Requirements
from krproxy.routing import unhooked_path

DEFAULT_LISTEN = "/var/run/koord-runtimeproxy/runtimeproxy.sock"
DEFAULT_RUNTIME_ENDPOINT = "/var/run/containerd/containerd.sock"
DEFAULT_HOOK_DIR = "/etc/runtime/hookserver.d"
DEFAULT_SKIP_LABEL = ("runtimeproxy.koordinator.sh/skip-hookserver", "true")


class BackendMode(enum.Enum):
    """Which runtime API sits behind the proxy (koord-runtime-proxy's ``--backend-runtime-mode``)."""

    CONTAINERD = "Containerd"
    DOCKER = "Docker"


#: The longest path a unix socket can have on Linux (``sun_path`` is 108 bytes, NUL included).
MAX_SOCKET_PATH = 107


def socket_path(endpoint: str) -> str:
    """``unix:///x.sock``, ``unix:/x.sock`` and ``/x.sock`` name the socket ``/x.sock``; anything
    else (another scheme, a relative path, a path too long for a unix socket) is refused — the
    same rules as registration files.

    Raises:
        ValueError: saying what is wrong and what would be right.
    """
    # As krproxy.unixsock.strip_unix_scheme, which the pure core cannot import (it binds sockets).
    path = endpoint.removeprefix("unix://")
    if path.startswith("unix:"):
        path = path.removeprefix("unix:")
    if not path:
        raise ValueError("an endpoint must name a unix socket path")
    if "://" in path or re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", path):
        raise ValueError(f"only unix sockets are supported, not {endpoint!r}")
    if not path.startswith("/"):
        raise ValueError(f"a socket path must be absolute, not {endpoint!r}")
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH:
        raise ValueError(
            f"{path!r} is {size} bytes long, longer than a unix socket path can be "
            f"({MAX_SOCKET_PATH} bytes): choose a shorter path"
        )
    return path


def absolute_dir(path: str) -> str:
    """``path`` itself if it is absolute (a daemon's directories must not depend on its cwd).

    Raises:
        ValueError: for a relative path.
    """
    if not os.path.isabs(path):
        raise ValueError(f"a directory must be an absolute path, not {path!r}")
    return path


def _absolute_dirs(paths: Iterable[str]) -> tuple[str, ...]:
    return tuple(absolute_dir(p) for p in paths)


def _optional_socket_path(endpoint: str) -> str:
    return socket_path(endpoint) if endpoint else ""


#: Where ``krproxy status`` looks for a daemon when not told (the address the deploy files use).
DEFAULT_METRICS_ADDRESS = "127.0.0.1:9722"


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT`` for IPv6; empty HOST: every interface) → ``(host, port)``.

    Raises:
        ValueError: not of that form, or the port is not 0..65535.
    """
    host, sep, port = text.rpartition(":")
    if not sep:
        raise ValueError(f"{text!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{text!r}: write IPv6 addresses in brackets, as [::1]:PORT")
    if not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{text!r}: the port must be a number in 0..65535")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether *host* names this machine's loopback only (``localhost``, ``127.0.0.0/8``, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_metrics_address(value: str, allow_remote: bool) -> None:
    """Refuse an admin endpoint address beyond loopback unless allowed (``serve`` and ``nri`` alike)."""
    if not value:
        return
    host, _ = parse_address(value)
    if not allow_remote and not is_loopback(host):
        raise ValueError(
            f"metrics address {value!r} is not a loopback address; the endpoint has no "
            "authentication, so exposing it beyond this node needs --metrics-allow-remote"
        )


@attrs.frozen
class ProxyConfig:
    """Everything ``krproxy serve`` needs to know.

    Attributes:
        listen: socket path kubelet connects to (``unix://`` prefix stripped).
        runtime_endpoint: the backend RuntimeService socket.
        image_endpoint: the backend ImageService socket; the runtime socket when empty.
        backend_mode: the backend's API: Containerd (CRI) or Docker (``runtime_endpoint`` is then
            dockerd's API socket; see docs/docker-mode.md).
        hook_dir: directory of plugin registration files.
        skip_label: pods carrying this label key=value bypass all hooks.
        socket_mode: permission bits of the listening socket.
        socket_group: group id of the listening socket, unchanged when None.
        grace_period: seconds in-flight calls may take to finish after SIGTERM.
        recovery_grace: seconds after start that a call at a hook point waits for store recovery
            (docs/operations.md, "Store recovery"; :mod:`krproxy.hooks.startup`).
        max_request_message_size: largest request message (bytes) a caller may send; a larger
            one gets RESOURCE_EXHAUSTED from its length prefix, before it is buffered.
        metrics_allow_remote: allow a ``metrics_address`` that is not loopback.
        metrics_address: ``HOST:PORT`` of the HTTP endpoint (``/metrics``, ``/healthz``,
            ``/readyz``, ``/status``); none when empty. Loopback only unless allowed: the
            endpoint has no authentication and reveals the node's plugins and pod counts.
        insecure_registration_files: read registration files whatever their owner and mode
            (by default only root-owned files not writable by others are used).
        record: trace file every CRI call is recorded into (docs/trace-format.md); none when empty.
        record_max_bytes: rotate the trace file at this size (0: never).
        record_keep: rotated trace files kept (FILE.1 ... FILE.N).
        record_paused: with ``record``, start with recording off (SIGUSR1 toggles it).
        oci_hook_dirs: hooks.d directories of OCI hook files (docs/oci-hooks.md), least preferred
            first; empty (the default): no OCI hooks at the proxy.
        requirements: required hook servers (``--required-hook-server``), the annotations pods name
            them with, and the start-up grace (docs/hooks.md, "Required hook servers").
        forward_unhooked_methods: methods our protos lack that are forwarded unhooked even while
            required hook servers are configured (``--forward-unhooked-method``; bare names are
            RuntimeService's, paths as given; :func:`krproxy.routing.unhooked_path`).
    """

    listen: str = attrs.field(default=DEFAULT_LISTEN, converter=socket_path)
    runtime_endpoint: str = attrs.field(default=DEFAULT_RUNTIME_ENDPOINT, converter=socket_path)
    image_endpoint: str = attrs.field(default="", converter=_optional_socket_path)
    backend_mode: BackendMode = attrs.field(default=BackendMode.CONTAINERD, converter=BackendMode)
    hook_dir: str = attrs.field(default=DEFAULT_HOOK_DIR, converter=absolute_dir)
    skip_label: tuple[str, str] = DEFAULT_SKIP_LABEL
    socket_mode: int = 0o660
    socket_group: int | None = None
    grace_period: float = attrs.field(default=10.0)
    recovery_grace: float = attrs.field(default=10.0, validator=attrs.validators.ge(0))
    max_request_message_size: int = attrs.field(default=16 << 20, validator=attrs.validators.ge(1024))
    metrics_allow_remote: bool = False
    metrics_address: str = attrs.field(default="")
    insecure_registration_files: bool = False
    record: str = ""
    record_max_bytes: int = attrs.field(default=64 << 20, validator=attrs.validators.ge(0))
    record_keep: int = attrs.field(default=3, validator=attrs.validators.ge(0))
    record_paused: bool = False
    oci_hook_dirs: tuple[str, ...] = attrs.field(default=(), converter=_absolute_dirs)
    requirements: Requirements = attrs.field(factory=Requirements)
    forward_unhooked_methods: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    @forward_unhooked_methods.validator
    def _check_unhooked(self, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]) -> None:
        for name in value:
            unhooked_path(name)  # ValueError names the bad one

    @metrics_address.validator
    def _check_metrics_address(self, attribute: attrs.Attribute[str], value: str) -> None:
        check_metrics_address(value, self.metrics_allow_remote)

    @requirements.validator
    def _check_requirements(self, attribute: attrs.Attribute[Requirements], value: Requirements) -> None:
        if value.servers and self.backend_mode is BackendMode.DOCKER:
            raise ValueError(
                "--required-hook-server is not supported with --backend-runtime-mode=Docker: Docker mode "
                "would hold no call for it (docs/docker-mode.md); use CRI mode, or drop the flag"
            )

    @grace_period.validator
    def _check_grace(self, attribute: attrs.Attribute[float], value: float) -> None:
        if value < 0:
            raise ValueError("grace period must not be negative")

    @property
    def image_socket(self) -> str:
        return self.image_endpoint or self.runtime_endpoint
