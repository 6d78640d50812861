"""The ``krproxy`` command line.

``krproxy serve`` runs the daemon; called with flags but no subcommand (as the
koord-runtime-proxy binary is), ``krproxy`` means ``krproxy serve``, so existing unit files
and manifests work unchanged.
"""

from __future__ import annotations

import argparse
import logging
import os
import stat
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from krproxy import __version__, _argparse, config, log
from krproxy._flags import (
    add_logging,
    add_nri,
    add_serve,
    shared_config,
)

if TYPE_CHECKING:
    from krproxy.admin import AddressUnavailable

LOGGER = logging.getLogger("krproxy.cli")


def _nri(args: argparse.Namespace) -> int:
    import functools

    import trio

    from krproxy import _supervise
    from krproxy.nri import plugin
    from krproxy.nri.validator import check_containerd_config

    bad_path = _check_paths(args, _NRI_PATH_FLAGS)
    if bad_path:
        print(f"krproxy nri: error: {bad_path}", file=sys.stderr)
        return 2
    try:
        cfg = plugin.NriConfig(
            socket=config.socket_path(args.nri_socket),
            plugin_name=args.plugin_name,
            plugin_index=args.plugin_index,
            containerd_config=args.containerd_config,
            **shared_config(args),
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
            # Signals first: start-up (warming the converters up, connecting) takes a few tenths of a
            # second, and a SIGTERM in it used to kill the process, a SIGINT to end in a traceback.
            await nursery.start(_supervise.watch_signals, nursery.cancel_scope.cancel)
            await nursery.start(functools.partial(plugin.serve, cfg, admin_sock=admin_sock))

    trio.run(run)
    log.event(LOGGER, "stopped", mode="nri")
    return 0


#: The subcommands whose parsers stand alone: run as ``krproxy COMMAND ...``, the command line is parsed
#: without ``hooks``' and ``trace``'s parsers, whose modules load trio, protobuf and the SDK (0.9 s of
#: imports idle, 2 to 3 s at a load of 9: ``krproxy status`` is the DaemonSets' probe, run every 10 s).
_STANDALONE = frozenset({"serve", "nri", "demo", "version", "oci-launcher", "status"})


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """krproxy's parser; with ``command`` one of :data:`_STANDALONE` (the subcommand about to be parsed),
    without ``hooks`` and ``trace``, so that their imports are not paid for it; with ``command`` ``hooks``
    without ``trace``, and the other way round (``krproxy trace show`` loaded the hook server's SDK:
    0.86 s of CPU for ``trace --help``, where 0.5 s is trace's own)."""
    parser = _argparse.Parser(
        prog="krproxy",
        description="krproxy: a CRI runtime proxy with hook plugins for Kubernetes nodes.",
        epilog="Flags without a COMMAND mean `krproxy serve` (as koord-runtime-proxy is invoked): "
        "`krproxy --remote-runtime-service-endpoint=...` is `krproxy serve --remote-runtime-service-endpoint=...`, "
        "and a bare `krproxy` is `krproxy serve` on koord-runtime-proxy's default sockets. "
        "Run `krproxy COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"krproxy {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_serve(subparsers)
    add_nri(subparsers)
    demo = subparsers.add_parser(
        "demo",
        help="run a pod lifecycle through the proxy in front of the bundled fake containerd",
        description="Start the fake containerd and the proxy on temporary sockets, drive a pod "
        "lifecycle through the proxy with an independent CRI client, print what happened, exit.",
    )
    add_logging(demo)
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
    if command not in _STANDALONE and command != "trace":
        from krproxy.hookserver.cli import add_subcommands as add_hooks

        add_hooks(subparsers)
    if command not in _STANDALONE and command != "hooks":
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


#: ``krproxy nri``'s: its socket as the proxy's endpoints (``tcp://...`` was taken for a file's path).
_NRI_PATH_FLAGS = (
    ("--nri-socket", "nri_socket", config.socket_path),
    ("--hook-dir", "hook_dir", config.absolute_dir),
)


def _check_paths(args: argparse.Namespace, flags: Sequence[tuple[str, str, Any]] = _PATH_FLAGS) -> str:
    """The first bad path flag's error, naming the flag; empty when all are good."""
    checks = [(flag, getattr(args, dest), check) for flag, dest, check in flags]
    checks += [("--oci-hooks-dir", d, config.absolute_dir) for d in getattr(args, "oci_hook_dirs", ())]
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
        mode: int | None = os.stat(path).st_mode
    except OSError:
        mode = None  # missing (created below), or the open below says what is wrong
    if mode is not None and not stat.S_ISREG(mode):
        return f"--record {path}: not a regular file; give the path of a file (created if missing)"
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK, 0o600))
    except OSError as err:
        return f"--record {path}: cannot write the trace file ({err.strerror}); choose a writable path"
    return ""


def _admin_unavailable(err: AddressUnavailable) -> int:
    """Log that ``--metrics-address`` could not be listened on (serve and nri); exit status 1."""
    log.error(
        LOGGER,
        "startup_failed",
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
            socket_mode=args.socket_mode,
            socket_group=args.socket_group,
            grace_period=args.grace_period,
            recovery_grace=args.recovery_grace,
            max_request_message_size=args.max_request_message_size,
            oci_hook_dirs=tuple(args.oci_hook_dirs),
            record=args.record,
            record_max_bytes=args.record_max_bytes,
            record_keep=args.record_keep,
            record_paused=args.record_paused,
            forward_unhooked_methods=tuple(args.forward_unhooked_methods),
            **shared_config(args),
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
        log.error(
            LOGGER,
            "socket_in_use",
            listen=err.filename,
            error=f"{err.strerror}: stop that process first, or choose another --koord-runtimeproxy-endpoint",
        )
        return 1
    except admin.AddressUnavailable as err:
        return _admin_unavailable(err)
    except OSError as err:
        log.error(
            LOGGER,
            "startup_failed",
            **_flag_of(err.filename, cfg, args),
            path=err.filename or "",
            error=err.strerror or str(err),
        )
        return 1
    return 0


def _flag_of(path: str | None, cfg: config.ProxyConfig, args: argparse.Namespace) -> dict[str, str]:
    """``flag=``: the flag whose path ``path`` is (or is in), and ``default=`` its value when the user gave
    none (a non-root ``krproxy serve`` fails on the default /var/run and /etc paths: it said ``flag=""``)."""
    candidates = [
        ("--koord-runtimeproxy-endpoint", cfg.listen, "listen"),
        ("--hook-dir", cfg.hook_dir, "hook_dir"),
        ("--remote-runtime-service-endpoint", cfg.runtime_endpoint, "runtime"),
        ("--remote-image-service-endpoint", cfg.image_endpoint, "image"),
    ]
    for flag, value, dest in candidates:
        if value and path and (path == value or value.startswith(path.rstrip("/") + "/")):
            if getattr(args, dest, None) == _serve_default(dest):
                return {"flag": flag, "default": value}
            return {"flag": flag}
    return {"flag": ""}


def _serve_default(dest: str) -> Any:
    """The default ``krproxy serve`` gives ``dest`` when its flag is left out."""
    args = build_parser("serve").parse_args(["serve"])
    return getattr(args, dest, None)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list:  # a bare krproxy serves on koord-runtime-proxy's defaults, as that binary does
        args_list = ["serve"]
    elif args_list[0].startswith("-") and args_list[0] not in ("-h", "--help", "--version"):
        args_list.insert(0, "serve")  # koord-runtime-proxy style: flags only
    parser = build_parser(args_list[0])
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
