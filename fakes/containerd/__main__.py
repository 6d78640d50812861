"""``python -m krproxy.fakes.containerd --socket PATH [--imitate 1.6|1.7|2.1|2.3]``: run a fake containerd
until SIGINT or SIGTERM (imitating containerd 1.6 unless told otherwise).

Exits 0 after a signal, with the socket file removed.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
from collections.abc import Sequence

import trio

from krproxy import _argparse
from krproxy._supervise import exception_leaves
from krproxy.config import socket_path
from krproxy.fakes.containerd.records import list_order
from krproxy.fakes.containerd.server import FakeContainerd, run_fake_containerd
from krproxy.fakes.containerd.state import RuntimeState
from krproxy.fakes.containerd.versions import DEFAULT_VERSION, IMITATIONS
from krproxy.unixsock import print_socket_errors

LOGGER = logging.getLogger("krproxy.fakes.containerd")


#: Logging thresholds, by their logging names.
LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


def _parser() -> argparse.ArgumentParser:
    parser = _argparse.Parser(
        prog="python -m krproxy.fakes.containerd",
        description="Serve a fake containerd CRI runtime and image service on a unix socket.",
    )
    parser.add_argument("--socket", required=True, help="unix socket path (a unix:// prefix is accepted)")
    parser.add_argument("--seed-pods", type=int, default=0, help="READY pods to create at start")
    parser.add_argument("--containers-per-pod", type=int, default=1, help="RUNNING containers per seeded pod")
    parser.add_argument(
        "--list-seed",
        type=int,
        default=None,
        help="seed of the order of list answers, shuffled on every call as containerd's change "
        "(default: $FAKE_CONTAINERD_LIST_SEED, else random)",
    )
    parser.add_argument(
        "--imitate",
        default=DEFAULT_VERSION,
        choices=[*IMITATIONS, "2.x"],
        help=f"the containerd version to answer as where versions differ (default {DEFAULT_VERSION}; 2.x is 2.1)",
    )
    parser.add_argument(
        "--require-pulled-images",
        action="store_true",
        help="CreateContainer of an image nobody pulled is NOT_FOUND, as containerd (default: pulled on the fly)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=_argparse.choice_of(LEVELS),
        choices=LEVELS,
        help="logging threshold, any case (DEBUG logs every request)",
    )
    return parser


async def _serve(path: str, fake: FakeContainerd) -> None:
    # Open the signal receiver first: a signal arriving during start-up must not be lost.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(run_fake_containerd, path, fake)
            async for signum in signals:
                LOGGER.info("event=shutdown signal=%s", signal.Signals(signum).name)
                break
            nursery.cancel_scope.cancel()
    LOGGER.info("event=stopped path=%s", path)  # the socket is closed and removed


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, seed the fake if asked, and serve until a signal arrives.

    A socket path that cannot be used (not a unix path, too long, in a directory that does not exist:
    none is created) is a usage error, exit 2; one that cannot be listened on (in use, a directory, no
    permission) is one line naming it, exit 1. No traceback for either.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        path = socket_path(args.socket)
    except ValueError as err:
        parser.error(f"--socket: {err}")
    if not os.path.isdir(os.path.dirname(path)):
        parser.error(f"--socket {path}: no directory {os.path.dirname(path)}; create it first")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    order = list_order() if args.list_seed is None else random.Random(args.list_seed)
    state = RuntimeState(order=order, imitate=args.imitate, require_pulled_images=args.require_pulled_images)
    fake = FakeContainerd(state)
    if args.seed_pods:
        fake.seed(args.seed_pods, args.containers_per_pod)
    try:
        trio.run(_serve, path, fake)
    except (OSError, BaseExceptionGroup) as err:
        errors = exception_leaves(err)
        if not all(isinstance(e, OSError) for e in errors):
            raise
        print_socket_errors(errors, f"{parser.prog}: error: --socket {path}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
