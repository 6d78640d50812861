"""The flags of ``krproxy serve`` and ``krproxy nri``: their parsers' pieces and value types
(:mod:`krproxy.cli` builds the command line from them)."""

from __future__ import annotations

import argparse
import grp
from typing import TYPE_CHECKING, Any

from krproxy import _argparse, config, log

if TYPE_CHECKING:
    pass


def _octal(text: str) -> int:
    try:
        return int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal mode like 0660") from None


def _group(text: str) -> int:
    if text.isdigit():
        return int(text)
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise argparse.ArgumentTypeError(f"no group named {text!r}") from None


def _address(text: str) -> str:
    """``HOST:PORT`` as given, once it parses (so the error names ``--metrics-address``); empty: off."""
    if not text:
        return text
    try:
        config.parse_address(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def add_logging(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        type=_argparse.choice_of(log.LEVELS),
        choices=log.LEVELS,
        default="info",
        help="the least severe events logged (any case)",
    )
    parser.add_argument(
        "--log-format",
        type=_argparse.choice_of(log.FORMATS),
        choices=log.FORMATS,
        default="logfmt",
        help="one event per line as key=value pairs (logfmt) or JSON; default: %(default)s",
    )


def add_serve(subparsers: argparse._SubParsersAction[Any]) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the proxy daemon",
        description="Serve CRI on a unix socket, forward every call to the backend runtime, "
        "and call registered hook plugins at pod and container lifecycle points. "
        "Endpoints accept an optional unix:// prefix.",
    )
    p.add_argument(
        "--koord-runtimeproxy-endpoint",
        dest="listen",
        default=config.DEFAULT_LISTEN,
        metavar="SOCKET",
        help="socket kubelet connects to (kubelet's --container-runtime-endpoint); default: %(default)s",
    )
    p.add_argument(
        "--remote-runtime-service-endpoint",
        dest="runtime",
        default=config.DEFAULT_RUNTIME_ENDPOINT,
        metavar="SOCKET",
        help="the real runtime's CRI socket (Docker mode: dockerd's API socket); default: %(default)s",
    )
    p.add_argument(
        "--remote-image-service-endpoint",
        dest="image",
        default="",
        metavar="SOCKET",
        help="the real image service socket; default: the runtime service endpoint",
    )
    p.add_argument(
        "--backend-runtime-mode",
        choices=[m.value for m in config.BackendMode],
        default=config.BackendMode.CONTAINERD.value,
        help="backend API: Containerd (CRI over gRPC) or Docker (HTTP proxy in front of dockerd: pass "
        "--remote-runtime-service-endpoint=unix:///var/run/docker.sock); default: %(default)s",
    )
    add_hook_dir(p)
    p.add_argument(
        "--socket-mode",
        type=_octal,
        default=0o660,
        metavar="MODE",
        help="permissions of the proxy socket, in octal; default: 0660",
    )
    p.add_argument(
        "--socket-group",
        type=_group,
        default=None,
        metavar="GROUP",
        help="group (name or gid) owning the proxy socket; default: the daemon's group",
    )
    p.add_argument(
        "--max-request-message-size",
        type=_argparse.at_least(1024),
        default=16 << 20,
        metavar="BYTES",
        help="largest request message a caller may send (a larger one gets RESOURCE_EXHAUSTED "
        "before it is buffered; containerd's own limit is the default); default: %(default)s",
    )
    p.add_argument(
        "--grace-period",
        type=_argparse.at_least(0, float),
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT/SIGHUP, how long in-flight calls may take before they are cancelled; "
        "default: %(default)s",
    )
    p.add_argument(
        "--recovery-grace",
        type=_argparse.at_least(0, float),
        default=10.0,
        metavar="SECONDS",
        help="after start, how long a call at a hook point waits for the hook store to be recovered from "
        "the runtime; then it goes on with the store as it is (a call on a pod or container the store lacks "
        "is refused where a required hook server or a Fail plugin needs its record); default: %(default)s",
    )
    p.add_argument(
        "--oci-hooks-dir",
        dest="oci_hook_dirs",
        action="append",
        default=[],
        metavar="DIR",
        help="run OCI hooks (hooks.d JSON files, docs/oci-hooks.md) from DIR around container "
        "start/stop; repeatable, a later DIR wins on the same file name (CRI-O's order is "
        "/usr/share/containers/oci/hooks.d then /etc/containers/oci/hooks.d); default: none, off",
    )
    add_required(p)
    p.add_argument(
        "--forward-unhooked-method",
        dest="forward_unhooked_methods",
        type=_unhooked_method,
        action="append",
        default=[],
        metavar="NAME",
        help="with --required-hook-server, a method krproxy's protos lack is refused with UNIMPLEMENTED "
        "(krproxy cannot run hooks for it); NAME (a RuntimeService method, e.g. ListPodSandboxFoo, or a "
        "path /package.Service/Method) is forwarded unhooked instead; repeatable; default: none",
    )
    add_record(p)
    add_admin(p)
    add_logging(p)


def _unhooked_method(text: str) -> str:
    from krproxy.routing import unhooked_path

    try:
        unhooked_path(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _required_server(text: str) -> Any:
    from krproxy.hooks.required import parse_required_server

    try:
        return parse_required_server(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def requirements(args: argparse.Namespace) -> Any:
    """The :class:`~krproxy.hooks.required.Requirements` of ``serve``'s or ``nri``'s flags."""
    from krproxy.hooks.required import Requirements

    return Requirements(
        servers=tuple(args.required_servers),
        annotation=args.required_plugins_annotation,
        tolerate_annotation=args.tolerate_missing_plugins_annotation,
        startup_grace=args.required_startup_grace,
    )


def shared_config(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration fields ``serve`` (``ProxyConfig``) and ``nri`` (``NriConfig``) both take from the
    flags they share (:func:`add_hook_dir`, :func:`add_admin`, :func:`add_required`)."""
    return {
        "hook_dir": args.hook_dir,
        "skip_label": (args.runtime_hook_server_key, args.runtime_hook_server_val),
        "insecure_registration_files": args.insecure_registration_files,
        "metrics_address": args.metrics_address,
        "metrics_allow_remote": args.metrics_allow_remote,
        "requirements": requirements(args),
    }


def add_required(p: argparse.ArgumentParser) -> None:
    """Required hook servers (docs/hooks.md, "Required hook servers")."""
    from krproxy.hooks.required import DEFAULT_STARTUP_GRACE, REQUIRED_PLUGINS_ANNOTATION

    p.add_argument(
        "--required-hook-server",
        dest="required_servers",
        type=_required_server,
        action="append",
        default=[],
        metavar="NAME[=POINT,...]",
        help="the hook server registered as NAME.json must be registered and answering, or calls at its "
        "hook points (all, or the POINTs listed, e.g. koordlet=PreRunPodSandbox,PreCreateContainer) "
        "fail with UNAVAILABLE and the runtime does nothing (krproxy nri: at PreCreateContainer, "
        "PreUpdateContainerResources and, NRI 0.12, PreUpdatePodSandboxResources only); repeatable; "
        "default: none",
    )
    p.add_argument(
        "--required-plugins-annotation",
        default=REQUIRED_PLUGINS_ANNOTATION,
        metavar="KEY",
        help="pod annotation (also KEY/pod and KEY/container.NAME) listing hook servers the pod requires, "
        "as NRI reads it; empty: ignored; default: %(default)s",
    )
    p.add_argument(
        "--tolerate-missing-plugins-annotation",
        default="",
        metavar="KEY",
        help="pod annotation (also KEY/pod and KEY/container.NAME) that, set to true, exempts the pod or "
        "container from required hook servers (NRI's tolerate_missing_plugins_annotation); default: none",
    )
    p.add_argument(
        "--required-startup-grace",
        type=_argparse.at_least(0, float),
        default=DEFAULT_STARTUP_GRACE,
        metavar="SECONDS",
        help="after start, how long a call needing a missing required hook server waits for it before it "
        "fails; default: %(default)s",
    )


def add_admin(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics-address",
        type=_address,
        default="",
        metavar="HOST:PORT",
        help="serve /metrics, /healthz, /readyz and /status over HTTP at HOST:PORT (loopback only "
        f"unless --metrics-allow-remote; e.g. {config.DEFAULT_METRICS_ADDRESS}); default: off",
    )
    p.add_argument(
        "--metrics-allow-remote",
        action="store_true",
        help="allow a non-loopback --metrics-address: the endpoint has no authentication and shows "
        "plugin sockets and pod counts, so only with a firewall or network policy in front",
    )


def add_hook_dir(p: argparse.ArgumentParser) -> None:
    """The hook directory and the skip label: the same for ``serve`` and ``nri``."""
    p.add_argument(
        "--hook-dir",
        default=config.DEFAULT_HOOK_DIR,
        metavar="DIR",
        help="directory of plugin registration files (*.json); default: %(default)s",
    )
    p.add_argument(
        "--runtime-hook-server-key",
        default=config.DEFAULT_SKIP_LABEL[0],
        metavar="KEY",
        help="pods labelled KEY=VAL bypass hooks (so a hook server can run as a pod); default: %(default)s",
    )
    p.add_argument(
        "--runtime-hook-server-val",
        default=config.DEFAULT_SKIP_LABEL[1],
        metavar="VAL",
        help="see --runtime-hook-server-key; default: %(default)s",
    )
    p.add_argument(
        "--insecure-registration-files",
        action="store_true",
        help="use registration files whatever their owner and mode (default: only files owned by "
        "root and not world-writable); for tests and development",
    )


def add_nri(subparsers: argparse._SubParsersAction[Any]) -> None:
    from krproxy.nri import DEFAULT_SOCKET

    p = subparsers.add_parser(
        "nri",
        help="run the hook plugins through the runtime's NRI (containerd >= 1.7) instead of a proxy",
        description="Register with the runtime as an external NRI plugin and call the hook plugins of the "
        "hook directory at NRI's pod and container events (docs/nri.md). kubelet talks to the runtime "
        "directly: no proxy socket.",
    )
    p.add_argument(
        "--nri-socket",
        default=DEFAULT_SOCKET,
        metavar="SOCKET",
        help="the runtime's NRI socket; default: %(default)s",
    )
    p.add_argument("--plugin-name", default="krproxy", help="name to register under; default: %(default)s")
    p.add_argument(
        "--containerd-config",
        default="",
        metavar="PATH",
        help="containerd's configuration file (with its imports): read at start to say whether containerd's "
        "NRI default validator requires this plugin (required_plugins), in the log and krproxy status; "
        "default: not checked",
    )
    p.add_argument(
        "--plugin-index",
        default="50",
        metavar="NN",
        help="two-digit index: NRI calls plugins in ascending index order; default: %(default)s",
    )
    add_hook_dir(p)
    add_required(p)
    add_admin(p)
    add_logging(p)


def add_record(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--record",
        default="",
        metavar="FILE",
        help="record every CRI call into the trace FILE (see `krproxy trace`); SIGUSR1 toggles recording",
    )
    p.add_argument(
        "--record-max-bytes",
        type=_argparse.at_least(0),
        default=64 << 20,
        metavar="N",
        help="rotate the trace file at N bytes (0: never); default: %(default)s",
    )
    p.add_argument(
        "--record-keep",
        type=_argparse.at_least(0),
        default=3,
        metavar="N",
        help="rotated trace files kept; default: %(default)s",
    )
    p.add_argument(
        "--record-paused", action="store_true", help="with --record: start with recording off until SIGUSR1"
    )
