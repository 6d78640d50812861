"""``python -m krproxy.fakes.plugin --socket PATH --hook-dir DIR``: run a fake hook plugin until SIGINT or SIGTERM.

On start it serves the socket, then writes ``DIR/<name>.json`` registering itself; on a signal it
removes that file, stops serving and exits 0. It echoes every hook request as koordlet does, with
the changes asked for by the ``--set-*``/``--add-*`` flags.

The hook servers a required-server check must tell apart: absent (not running), slow (``--delay S``:
each hook answer S seconds late), and registered but not answering (``--not-answering``: the socket
accepts connections and nothing is ever answered; ``--answer-after S``: the same for S seconds, then
it serves as usual).
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import signal
from collections.abc import Sequence

import trio

from krproxy import _argparse
from krproxy.fakes.plugin.registration import remove_registration, write_registration
from krproxy.fakes.plugin.server import Changes, FakePlugin, Misbehaviour, run_fake_plugin
from krproxy.hooks.points import HookPoint
from krproxy.unixsock import strip_unix_scheme

LOGGER = logging.getLogger("krproxy.fakes.plugin")


def _hooks(value: str) -> tuple[HookPoint, ...]:
    hooks = []
    for name in filter(None, (n.strip() for n in value.split(","))):
        point = HookPoint.from_name(name)
        if point is None:
            known = ",".join(p.value for p in HookPoint)
            raise argparse.ArgumentTypeError(f"unknown hook {name!r} (known: {known})")
        hooks.append(point)
    return tuple(hooks)


def _key_value(value: str) -> tuple[str, str]:
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {value!r}")
    return key, val


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, not {value!r}")
    return seconds


def _parser() -> argparse.ArgumentParser:
    parser = _argparse.Parser(
        prog="python -m krproxy.fakes.plugin",
        description="Serve a fake runtime hook plugin on a unix socket and register it in a hook directory.",
    )
    parser.add_argument("--socket", required=True, help="unix socket path (a unix:// prefix is accepted)")
    parser.add_argument("--hook-dir", required=True, help="the proxy's hook directory")
    parser.add_argument("--name", default="fake-plugin", help="registration file name, without .json")
    parser.add_argument(
        "--hooks",
        type=_hooks,
        default=tuple(HookPoint),
        help="comma-separated hook names (default: all seven)",
    )
    parser.add_argument(
        "--failure-policy",
        choices=["Fail", "Ignore"],
        default="Ignore",
        help="written into the registration file",
    )
    parser.add_argument("--set-cpu-quota", type=int, metavar="N", help="container cpu_quota to set")
    parser.add_argument("--set-memory-limit", type=int, metavar="N", help="container memory limit (bytes)")
    parser.add_argument("--set-cpuset", metavar="CPUS", help="container cpuset_cpus to set, e.g. 0-1")
    parser.add_argument(
        "--add-annotation",
        type=_key_value,
        action="append",
        default=[],
        metavar="K=V",
        help="annotation to add (pod and container hooks); repeatable",
    )
    parser.add_argument("--delay", type=float, default=0.0, metavar="S", help="seconds before each answer")
    silent = parser.add_mutually_exclusive_group()
    silent.add_argument(
        "--answer-after",
        type=_seconds,
        default=0.0,
        metavar="S",
        help="registered and listening at once, but answer nothing for S seconds (a server still starting)",
    )
    silent.add_argument(
        "--not-answering",
        action="store_const",
        const=math.inf,
        dest="answer_after",
        help="registered and listening, but never answer (a hung server: connects succeed, calls time out)",
    )
    levels = ["DEBUG", "INFO", "WARNING", "ERROR"]
    parser.add_argument(
        "--log-level", default="INFO", type=_argparse.choice_of(levels), choices=levels, help="any case"
    )
    return parser


async def _serve(args: argparse.Namespace, plugin: FakePlugin) -> None:
    """Serve and stay registered until SIGINT or SIGTERM."""
    socket = strip_unix_scheme(args.socket)
    # Watch the signals first: one arriving during start-up must not be lost.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(run_fake_plugin, answer_after=args.answer_after), socket, plugin
            )
            path = write_registration(
                args.hook_dir, args.name, socket, args.hooks, failure_policy=args.failure_policy
            )
            try:
                LOGGER.info("event=registered file=%s socket=%s", path, socket)
                async for signum in signals:
                    LOGGER.info("event=shutdown signal=%s", signal.Signals(signum).name)
                    break
            finally:
                remove_registration(args.hook_dir, args.name)
            nursery.cancel_scope.cancel()
    LOGGER.info("event=stopped socket=%s", socket)  # unregistered, the socket closed


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments and serve until a signal arrives."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    plugin = FakePlugin(
        Changes(
            cpu_quota=args.set_cpu_quota,
            memory_limit=args.set_memory_limit,
            cpuset_cpus=args.set_cpuset,
            annotations=dict(args.add_annotation),
        )
    )
    if args.delay:
        plugin.misbehave(Misbehaviour(delay=args.delay))
    trio.run(_serve, args, plugin)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
