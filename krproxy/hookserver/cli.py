"""``krproxy hooks serve`` and ``krproxy hooks standalone``.

Mount under the main CLI with :func:`add_subcommands`; each parsed namespace carries its
handler in ``args.func(args) -> int``. :func:`main` runs this CLI on its own.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

import trio

from krproxy import _argparse, log
from krproxy._supervise import exception_leaves, watch_signals
from krproxy.unixsock import print_socket_errors

from ._app import DEFAULT_CGROUP_ROOT, DEFAULT_RESCTRL_ROOT, RECONCILE_INTERVAL, HookServer
from ._context import QOS_LABEL
from ._executor import Executor
from ._registry import FailurePolicy, Stage
from ._service import ServeOptions, serve
from ._standalone import PodSelector, run_standalone
from .policies import install_all

DEFAULT_HOOK_DIR = "/etc/runtime/hookserver.d"
DEFAULT_SOCKET = "/var/run/krproxy-hookserver/hookserver.sock"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", metavar="FILE", help="node policy file (YAML/JSON), watched live")
    p.add_argument(
        "--cgroup-root", default=DEFAULT_CGROUP_ROOT, metavar="DIR", help="the node's cgroup v1/v2 mount"
    )
    p.add_argument(
        "--resctrl-root", default=DEFAULT_RESCTRL_ROOT, metavar="DIR", help="the node's resctrl mount (RDT)"
    )
    p.add_argument(
        "--proc-stat", default="/proc/stat", metavar="FILE", help="node CPU counters for cpu suppress"
    )
    p.add_argument(
        "--plugin-failure-policy",
        choices=[p.value for p in FailurePolicy],
        default="Ignore",
        help="Fail: stop a stage at the first failing plugin and answer with an error",
    )
    p.add_argument("--no-builtin", action="store_true", help="do not install the built-in policies")
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE and call its register(app); repeatable",
    )
    p.add_argument(
        "--metrics-textfile",
        metavar="FILE",
        help="write krproxy_hookserver_feature_active (Prometheus text) here at start and on every policy"
        " change, for node_exporter's textfile collector",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log at debug level")


def add_subcommands(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``hooks {serve,standalone}`` to ``subparsers`` (from ``add_subparsers()``)."""
    hooks: argparse.ArgumentParser = subparsers.add_parser(
        "hooks",
        help="run a hook server (SDK built-in policies)",
        description="Run the SDK's hook server with its built-in policies: `serve` behind krproxy or "
        "koord-runtime-proxy, `standalone` without a proxy.",
    )
    sub = hooks.add_subparsers(dest="hooks_command", required=True, metavar="COMMAND")

    s = sub.add_parser(
        "serve",
        help="serve RuntimeHookService for krproxy / koord-runtime-proxy",
        description="Serve the hook protocol on a unix socket and register it in the proxy's hook directory.",
    )
    s.add_argument("--socket", default=DEFAULT_SOCKET, metavar="PATH", help="unix socket to listen on")
    s.add_argument(
        "--host-endpoint", metavar="PATH", help="socket path as the proxy sees it (default: --socket)"
    )
    s.add_argument(
        "--hook-dir", default=DEFAULT_HOOK_DIR, metavar="DIR", help="the proxy's hook directory (--hook-dir)"
    )
    s.add_argument("--name", default="krproxy-hookserver", help="registration file is <hook-dir>/<name>.json")
    s.add_argument(
        "--failure-policy",
        choices=[p.value for p in FailurePolicy],
        default="Ignore",
        help="written into the registration file: what the proxy does when this server fails a call",
    )
    stages = [s.value for s in Stage]
    s.add_argument(
        "--disable-stages",
        nargs="*",
        default=[],
        choices=stages,
        metavar="STAGE",
        help=f"stages not to register for, any of: {', '.join(stages)}",
    )
    _common(s)
    s.set_defaults(func=_serve)

    st = sub.add_parser(
        "standalone",
        help="apply the policies by reconciling pods listed from the CRI",
        description="Without a proxy: list pods and containers from the runtime every --interval "
        "seconds and apply the policies to their cgroups.",
    )
    st.add_argument(
        "--cri-endpoint",
        default="unix:///run/containerd/containerd.sock",
        metavar="SOCKET",
        help="the runtime's CRI socket",
    )
    st.add_argument(
        "--interval",
        type=float,
        default=RECONCILE_INTERVAL,
        metavar="SECONDS",
        help="seconds between two reconciliations",
    )
    st.add_argument(
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="only pods in this namespace; repeatable (default: every namespace)",
    )
    st.add_argument(
        "--selector",
        "-l",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="only pods with these labels; repeatable",
    )
    st.add_argument(
        "--all-pods",
        action="store_true",
        help=f"also pods without the {QOS_LABEL} label (by default only Koordinator-QoS-labelled pods"
        " are touched: on a shared node the others are not ours to change)",
    )
    _common(st)
    st.set_defaults(func=_standalone)
    return hooks


def build_app(args: argparse.Namespace) -> HookServer:
    app = HookServer(
        executor=Executor.for_roots(args.cgroup_root, args.resctrl_root),
        plugin_failure_policy=FailurePolicy(args.plugin_failure_policy),
    )
    app.features.textfile = args.metrics_textfile
    if not args.no_builtin:
        install_all(app, proc_stat=args.proc_stat)
    for name in args.plugin:
        importlib.import_module(name).register(app)
    return app


def _logging(args: argparse.Namespace) -> None:
    log.configure("debug" if args.verbose else "info")


def _serve(args: argparse.Namespace) -> int:
    _logging(args)
    app = build_app(args)
    options = ServeOptions(
        socket=args.socket,
        hook_dir=args.hook_dir,
        name=args.name,
        endpoint=args.host_endpoint,
        failure_policy=FailurePolicy(args.failure_policy),
        policy_path=args.policy,
        disabled_stages=tuple(Stage(s) for s in args.disable_stages),
    )

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(watch_signals, nursery.cancel_scope.cancel)
            await serve(app, options)

    return _run(run, "serve")


def _standalone(args: argparse.Namespace) -> int:
    try:
        selector = PodSelector.parse(args.namespace, args.selector, all_pods=args.all_pods)
    except ValueError as exc:
        print(f"krproxy hooks standalone: --selector: {exc}", file=sys.stderr)
        return 2
    _logging(args)
    app = build_app(args)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(watch_signals, nursery.cancel_scope.cancel)
            await run_standalone(
                app, args.cri_endpoint, interval=args.interval, policy_path=args.policy, selector=selector
            )

    return _run(run, "standalone")


def _run(fn: Any, command: str) -> int:
    """``trio.run(fn)``; an OS error (also inside trio's exception groups) is printed, exit 1.

    SIGINT, SIGTERM and SIGHUP stop the server gracefully (``watch_signals`` cancels it: the
    registration file is removed before the socket closes), exit 0. Before, SIGINT was trio's
    KeyboardInterrupt, raised inside the nursery's exception group: a traceback and exit 1, and the
    registration file left naming a dead socket."""
    try:
        trio.run(fn)
    except (KeyboardInterrupt, OSError, BaseExceptionGroup) as err:
        errors = exception_leaves(err)
        if all(isinstance(e, KeyboardInterrupt) for e in errors):
            return 130  # Ctrl-C before the signals were caught: nothing was registered yet
        if not all(isinstance(e, OSError) for e in errors):
            raise
        print_socket_errors(errors, f"krproxy hooks {command}: error")
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``krproxy hooks …`` on its own: ``main(["hooks", "serve", "--socket", …])``."""
    parser = _argparse.Parser(prog="krproxy")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_subcommands(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))
