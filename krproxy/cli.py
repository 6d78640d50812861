"""The ``krproxy`` command line.

``krproxy serve`` runs the daemon; called with flags but no subcommand (as the
koord-runtime-proxy binary is), ``krproxy`` means ``krproxy serve``, so existing unit files
and manifests work unchanged.
"""

from __future__ import annotations

import argparse
import grp
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from krproxy import __version__, _argparse, config, log

if TYPE_CHECKING:
    from krproxy.admin import AddressUnavailable

LOGGER = logging.getLogger("krproxy.cli")


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


def _add_logging(parser: argparse.ArgumentParser) -> None:
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


def _add_serve(subparsers: argparse._SubParsersAction[Any]) -> None:
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
    _add_hook_dir(p)
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
        "--oci-hooks-dir",
        dest="oci_hook_dirs",
        action="append",
        default=[],
        metavar="DIR",
        help="run OCI hooks (hooks.d JSON files, docs/oci-hooks.md) from DIR around container "
        "start/stop; repeatable, a later DIR wins on the same file name (CRI-O's order is "
        "/usr/share/containers/oci/hooks.d then /etc/containers/oci/hooks.d); default: none, off",
    )
    _add_required(p)
    _add_record(p)
    _add_admin(p)
    _add_logging(p)


def _required_server(text: str) -> Any:
    from krproxy.hooks.required import parse_required_server

    try:
        return parse_required_server(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _requirements(args: argparse.Namespace) -> Any:
    """The :class:`~krproxy.hooks.required.Requirements` of ``serve``'s or ``nri``'s flags."""
    from krproxy.hooks.required import Requirements

    return Requirements(
        servers=tuple(args.required_servers),
        annotation=args.required_plugins_annotation,
        tolerate_annotation=args.tolerate_missing_plugins_annotation,
        startup_grace=args.required_startup_grace,
    )


def _add_required(p: argparse.ArgumentParser) -> None:
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


def _add_admin(p: argparse.ArgumentParser) -> None:
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


def _add_hook_dir(p: argparse.ArgumentParser) -> None:
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


def _add_nri(subparsers: argparse._SubParsersAction[Any]) -> None:
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
    _add_hook_dir(p)
    _add_required(p)
    _add_admin(p)
    _add_logging(p)


def _nri(args: argparse.Namespace) -> int:
    import functools

    import trio

    from krproxy import _supervise
    from krproxy.nri import plugin
    from krproxy.nri.validator import check_containerd_config

    try:
        cfg = plugin.NriConfig(
            socket=args.nri_socket.removeprefix("unix://"),
            plugin_name=args.plugin_name,
            plugin_index=args.plugin_index,
            hook_dir=args.hook_dir,
            skip_label=(args.runtime_hook_server_key, args.runtime_hook_server_val),
            insecure_registration_files=args.insecure_registration_files,
            metrics_address=args.metrics_address,
            metrics_allow_remote=args.metrics_allow_remote,
            requirements=_requirements(args),
            containerd_config=args.containerd_config,
        )
        if cfg.containerd_config:  # an unreadable file is an error at start, not in the event loop
            check_containerd_config(cfg.containerd_config, cfg.plugin_name, cfg.plugin_index)
    except ValueError as err:  # ConfigError too
        print(f"krproxy nri: error: {err}", file=sys.stderr)
        return 2
    from krproxy import admin

    try:  # bound before trio runs, so that "address in use" is a plain error
        admin_sock = admin.bind(cfg.metrics_address) if cfg.metrics_address else None
    except admin.AddressUnavailable as err:
        return _admin_unavailable(err)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(plugin.serve, cfg, admin_sock=admin_sock))
            await _supervise.watch_signals(nursery.cancel_scope.cancel)

    trio.run(run)
    log.event(LOGGER, "stopped", mode="nri")
    return 0


def _add_record(p: argparse.ArgumentParser) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    parser = _argparse.Parser(
        prog="krproxy",
        description="krproxy: a CRI runtime proxy with hook plugins for Kubernetes nodes.",
        epilog="Flags without a COMMAND mean `krproxy serve` (as koord-runtime-proxy is invoked): "
        "`krproxy --remote-runtime-service-endpoint=...` is `krproxy serve --remote-runtime-service-endpoint=...`. "
        "Run `krproxy COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"krproxy {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve(subparsers)
    _add_nri(subparsers)
    demo = subparsers.add_parser(
        "demo",
        help="run a pod lifecycle through the proxy in front of the bundled fake containerd",
        description="Start the fake containerd and the proxy on temporary sockets, drive a pod "
        "lifecycle through the proxy with an independent CRI client, print what happened, exit.",
    )
    _add_logging(demo)
    demo.set_defaults(log_level="warning")
    subparsers.add_parser("version", help="print the version", description="Print krproxy's version.")
    launcher = subparsers.add_parser(
        "oci-launcher",
        help="write the fast krproxy-runc-wrapper launcher (a containerd runtime's BinaryName)",
        description="Write a /bin/sh launcher for the runc wrapper at PATH: runc commands that no "
        "OCI hook can concern go straight to runc, without starting Python (see docs/oci-hooks.md). "
        "runc, the hook directories and the log are resolved now, from krproxy-runc-wrapper.conf "
        "next to PATH, then PATH.",
    )
    launcher.add_argument(
        "path", metavar="PATH", help="where to write it, e.g. /usr/local/bin/krproxy-runc-wrapper"
    )
    launcher.add_argument("--runc", metavar="FILE", help="the real runc (default: as the wrapper finds it)")
    launcher.add_argument(
        "--index",
        metavar="FILE",
        help="where the launcher keeps the index that lets a create no hook can match skip Python "
        "(default: /run/krproxy/oci-hooks-<hash of PATH>.index; written by the wrapper)",
    )
    from krproxy.hookserver.cli import add_subcommands as add_hooks

    add_hooks(subparsers)
    from krproxy.trace.cli import add_subcommands as add_trace

    add_trace(subparsers)
    from krproxy.admin import add_status_subcommand

    add_status_subcommand(subparsers)
    return parser


#: The flags naming paths, and the check each value must pass (config's own converters).
_PATH_FLAGS = (
    ("--koord-runtimeproxy-endpoint", "listen", config.socket_path),
    ("--remote-runtime-service-endpoint", "runtime", config.socket_path),
    ("--remote-image-service-endpoint", "image", config.socket_path),
    ("--hook-dir", "hook_dir", config.absolute_dir),
)


def _check_paths(args: argparse.Namespace) -> str:
    """The first bad path flag's error, naming the flag; empty when all are good."""
    checks = [(flag, getattr(args, dest), check) for flag, dest, check in _PATH_FLAGS]
    checks += [("--oci-hooks-dir", d, config.absolute_dir) for d in args.oci_hook_dirs]
    for flag, value, check in checks:
        if not value:
            continue
        try:
            check(value)
        except ValueError as err:
            return f"{flag}: {err}"
    return ""


def _check_record(path: str) -> str:
    """Why the trace file cannot be written (created empty if missing); empty when it can."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    except OSError as err:
        return f"--record {path}: cannot write the trace file ({err.strerror}); choose a writable path"
    return ""


def _admin_unavailable(err: AddressUnavailable) -> int:
    """Log that ``--metrics-address`` could not be listened on (serve and nri); exit status 1."""
    log.event(
        LOGGER,
        "startup_failed",
        level=logging.ERROR,
        flag="--metrics-address",
        address=err.filename,
        error=f"{err.strerror}: {err.hint()}",
    )
    return 1


def _serve(args: argparse.Namespace) -> int:
    from krproxy import admin, daemon
    from krproxy.unixsock import SocketInUseError

    def usage_error(message: str) -> int:
        print(f"krproxy serve: error: {message}", file=sys.stderr)
        return 2

    bad_path = _check_paths(args)
    if bad_path:
        return usage_error(bad_path)
    try:
        cfg = config.ProxyConfig(
            listen=args.listen,
            runtime_endpoint=args.runtime,
            image_endpoint=args.image,
            backend_mode=args.backend_runtime_mode,
            hook_dir=args.hook_dir,
            skip_label=(args.runtime_hook_server_key, args.runtime_hook_server_val),
            socket_mode=args.socket_mode,
            socket_group=args.socket_group,
            grace_period=args.grace_period,
            max_request_message_size=args.max_request_message_size,
            oci_hook_dirs=tuple(args.oci_hook_dirs),
            record=args.record,
            record_max_bytes=args.record_max_bytes,
            record_keep=args.record_keep,
            record_paused=args.record_paused,
            metrics_address=args.metrics_address,
            metrics_allow_remote=args.metrics_allow_remote,
            insecure_registration_files=args.insecure_registration_files,
            requirements=_requirements(args),
        )
    except ValueError as err:
        return usage_error(str(err))
    if cfg.record:
        unwritable = _check_record(cfg.record)
        if unwritable:
            return usage_error(unwritable)
    try:
        daemon.run(cfg)
    except SocketInUseError as err:
        log.event(
            LOGGER,
            "socket_in_use",
            level=logging.ERROR,
            listen=err.filename,
            error=f"{err.strerror}: stop that process first, or choose another --koord-runtimeproxy-endpoint",
        )
        return 1
    except admin.AddressUnavailable as err:
        return _admin_unavailable(err)
    except OSError as err:
        flag = "--koord-runtimeproxy-endpoint" if err.filename == cfg.listen else ""
        log.event(
            LOGGER,
            "startup_failed",
            level=logging.ERROR,
            flag=flag,
            path=err.filename or "",
            error=err.strerror or str(err),
        )
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0].startswith("-") and args_list[0] not in ("-h", "--help", "--version"):
        args_list.insert(0, "serve")  # koord-runtime-proxy style: flags only
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "version":
        print(f"krproxy {__version__}")
        return 0
    if args.command == "oci-launcher":
        from krproxy.ocihooks.wrapper import write_launcher

        try:
            write_launcher(args.path, runc=args.runc, index=args.index)
        except OSError as err:
            print(f"krproxy oci-launcher: error: {err}", file=sys.stderr)
            return 1
        print(f"wrote {args.path}")
        return 0
    if args.command in ("hooks", "trace", "status"):
        result: int = args.func(args)  # configures its own logging
        return result
    log.configure(args.log_level, args.log_format)
    if args.command == "serve":
        return _serve(args)
    if args.command == "nri":
        return _nri(args)
    if args.command == "demo":
        from krproxy import demo

        return demo.main()
    parser.error(f"unknown command {args.command}")  # argparse validated it; exits


if __name__ == "__main__":
    sys.exit(main())
