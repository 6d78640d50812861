"""The ``krproxy`` command line.

``krproxy serve`` runs the daemon; called with flags but no subcommand (as the
koord-runtime-proxy binary is), ``krproxy`` means ``krproxy serve``, so existing unit files
and manifests work unchanged.
"""

from __future__ import annotations

import argparse
import grp
import logging
import sys
from collections.abc import Sequence

from krproxy import __version__, config, log

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


def _add_logging(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", choices=log.LEVELS, default="info", help="default: %(default)s")
    parser.add_argument(
        "--log-format",
        choices=log.FORMATS,
        default="logfmt",
        help="one event per line as key=value pairs (logfmt) or JSON; default: %(default)s",
    )


def _add_serve(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
        help="the real runtime's CRI socket; default: %(default)s",
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
        help="backend API: Containerd (CRI); Docker is not supported yet; default: %(default)s",
    )
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
        "--grace-period",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long in-flight calls may take before they are cancelled; "
        "default: %(default)s",
    )
    _add_logging(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="krproxy",
        description="krproxy: a CRI runtime proxy with hook plugins for Kubernetes nodes.",
        epilog="Run `krproxy COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"krproxy {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve(subparsers)
    demo = subparsers.add_parser(
        "demo",
        help="run a pod lifecycle through the proxy in front of the bundled fake containerd",
        description="Start the fake containerd and the proxy on temporary sockets, drive a pod "
        "lifecycle through the proxy with an independent CRI client, print what happened, exit.",
    )
    _add_logging(demo)
    demo.set_defaults(log_level="warning")
    subparsers.add_parser("version", help="print the version")
    from krproxy.hookserver.cli import add_subcommands as add_hooks

    add_hooks(subparsers)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from krproxy import daemon
    from krproxy._grpc import SocketInUseError

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
        )
    except ValueError as err:
        print(f"krproxy serve: error: {err}", file=sys.stderr)
        return 2
    if cfg.backend_mode is not config.BackendMode.CONTAINERD:
        print(
            f"krproxy serve: error: --backend-runtime-mode={cfg.backend_mode.value} is not supported yet",
            file=sys.stderr,
        )
        return 2
    try:
        daemon.run(cfg)
    except SocketInUseError as err:
        log.event(LOGGER, "socket_in_use", level=logging.ERROR, listen=err.filename, error=err.strerror)
        return 1
    except OSError as err:
        log.event(LOGGER, "startup_failed", level=logging.ERROR, error=str(err))
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
    if args.command == "hooks":
        result: int = args.func(args)  # configures its own logging
        return result
    log.configure(args.log_level, args.log_format)
    if args.command == "serve":
        return _serve(args)
    if args.command == "demo":
        from krproxy import demo

        return demo.main()
    parser.error(f"unknown command {args.command}")  # argparse validated it; exits


if __name__ == "__main__":
    sys.exit(main())
