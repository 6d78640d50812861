"""``krproxy trace show|replay|serve``.

Mount under the main CLI with :func:`add_subcommands`; each parsed namespace carries its
handler in ``args.func(args) -> int``.

Exit status: 0 success (replay: every call identical); 1 replay found differences, or show left
out a damaged record (named on stderr; every good one is shown); 2 usage error, a trace that cannot
be read (the message names file and record; replay and serve refuse a damaged record), or a replay
target that accepts no connection; 130 (SIGINT, Ctrl-C) or 143 (SIGTERM) replay interrupted: 128 plus the
signal's number, as a shell reports a command its signal ended, with no report for the partial replay.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TextIO

import trio

from krproxy import _argparse, log, rpc
from krproxy.trace import messages
from krproxy.trace.backend import TraceBackend
from krproxy.trace.files import Loaded, TraceFileError, load
from krproxy.trace.format import TraceRecord
from krproxy.trace.replay import SENT, ChannelTransport, ReplayReport, Transport, replay
from krproxy.trace.show import Filter, parse_time, show
from krproxy.unixsock import (
    SocketInUseError,
    bind_unix_socket,
    strip_unix_scheme,
    unlink_if_ours,
    unreachable,
)

LOGGER = logging.getLogger("krproxy.trace.serve")


def _time(text: str) -> float:
    try:
        return parse_time(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a time (ISO 8601 such as 2024-05-01T10:00:00Z, or seconds since the epoch)"
        ) from None


def add_subcommands(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``trace {show,replay,serve}`` to ``subparsers`` (from ``add_subparsers()``)."""
    trace: argparse.ArgumentParser = subparsers.add_parser(
        "trace",
        help="list, replay or serve recorded CRI traces (krproxy serve --record)",
        description="Work with CRI traces recorded by `krproxy serve --record FILE`. "
        "Several FILEs are read in the order given (e.g. FILE.2 FILE.1 FILE after rotation).",
    )
    sub = trace.add_subparsers(dest="trace_command", required=True, metavar="COMMAND")

    s = sub.add_parser("show", help="list recorded calls", description="List recorded calls, decoded.")
    s.add_argument("files", nargs="+", metavar="FILE", help="trace files, oldest first")
    s.add_argument(
        "--method", action="append", default=[], metavar="M", help="method name or path; repeatable"
    )
    s.add_argument("--pod", default="", metavar="ID", help="sandbox ID prefix, namespace/name or pod name")
    s.add_argument("--container", default="", metavar="ID", help="container ID prefix or name")
    s.add_argument("--since", type=_time, metavar="TIME", help="calls started at or after TIME (UTC)")
    s.add_argument("--until", type=_time, metavar="TIME", help="calls started at or before TIME (UTC)")
    s.add_argument("--json", action="store_true", help="one JSON object per call and line")
    s.add_argument(
        "-d", "--details", action="store_true", help="show hook changes and decoded messages under each call"
    )
    s.set_defaults(func=_logged(_show, "warning"))

    r = sub.add_parser(
        "replay",
        help="send the recorded requests to a proxy or runtime and compare the answers",
        description="Send the recorded requests, in the order the calls started, to ENDPOINT; map the "
        "IDs it assigns; compare each answer to the recorded one with volatile fields normalised. "
        "Exit 0 when all are identical, 1 on any difference.",
    )
    r.add_argument("files", nargs="+", metavar="FILE", help="trace files, oldest first")
    r.add_argument(
        "--target", required=True, metavar="ENDPOINT", help="unix socket of a CRI runtime or proxy"
    )
    r.add_argument(
        "--send",
        choices=SENT,
        default="caller",
        help="which recorded request to send: caller, what kubelet sent (for a target that is a "
        "krproxy); runtime, what the runtime received, krproxy's additions and the hooks' changes "
        "included (for a proxy's trace replayed straight at a runtime)",
    )
    r.add_argument("--timing", action="store_true", help="keep the recorded gaps between calls")
    r.add_argument(
        "--speed",
        type=_argparse.above(0),
        default=1.0,
        metavar="X",
        help="with --timing: play this many times faster",
    )
    r.add_argument(
        "--timeout", type=_argparse.above(0), default=30.0, metavar="SECONDS", help="deadline of each call"
    )
    r.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="FIELD",
        help="also treat this field name as volatile; repeatable",
    )
    r.add_argument(
        "--progress",
        choices=("auto", "always", "never"),
        default="auto",
        help="progress bar on stderr; auto: when stderr is a terminal",
    )
    r.set_defaults(func=_logged(_replay, "warning"))

    v = sub.add_parser(
        "serve",
        help="answer CRI calls from a trace (a runtime stand-in)",
        description="Serve CRI on a unix socket, answering each call with a recorded one of the same "
        "method (matching requests first, then in recorded order), until SIGINT/SIGTERM.",
    )
    v.add_argument("files", nargs="+", metavar="FILE", help="trace files, oldest first")
    v.add_argument("--socket", required=True, metavar="PATH", help="unix socket to listen on")
    v.add_argument("--timing", action="store_true", help="answer after the recorded backend time")
    v.set_defaults(func=_logged(_serve, "info"))
    return trace


def _load(files: list[str], *, skip_corrupt: bool = False) -> Loaded | None:
    try:
        return load(
            files,
            warn=lambda note: print(f"krproxy trace: warning: {note}", file=sys.stderr),
            skip_corrupt=skip_corrupt,
        )
    except TraceFileError as err:
        print(f"krproxy trace: error: {err}", file=sys.stderr)
        return None


def _show(args: argparse.Namespace) -> int:
    """Every good record is shown; a damaged one is named on stderr and left out, exit 1 (a trace is
    forensics: one bad record must not hide the rest). A file that cannot be read at all: exit 2."""
    loaded = _load(args.files, skip_corrupt=True)
    if loaded is None:
        return 2
    selection = Filter(tuple(args.method), args.pod, args.container, args.since, args.until)
    try:
        for line in show(loaded.records, selection, as_json=args.json, details=args.details):
            print(line)
    except BrokenPipeError:  # `| head`
        sys.stderr.close()
    return 1 if loaded.damaged else 0


def progress_bar(out: TextIO, width: int = 30) -> Callable[[int, int, TraceRecord], None]:
    """A one-line progress bar redrawn in place: ``[#####.....] 12/40 CreateContainer``."""

    def draw(done: int, total: int, record: TraceRecord) -> None:
        filled = width * done // total if total else width
        label = "done" if done == total else record.method
        out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<32.32}")
        if done == total:
            out.write("\n")
        out.flush()

    return draw


def _replay(args: argparse.Namespace) -> int:
    loaded = _load(args.files)
    if loaded is None:
        return 2
    records = loaded.records
    target = strip_unix_scheme(args.target)
    problem = unreachable(target)
    if problem is not None:  # else every call would be one more UNAVAILABLE "difference"
        print(
            f"krproxy trace replay: cannot reach {target}: {problem} "
            "(--target names the unix socket of a running runtime or proxy)",
            file=sys.stderr,
        )
        return 2
    show_progress = args.progress == "always" or (args.progress == "auto" and sys.stderr.isatty())
    replaying = functools.partial(
        replay,
        records,
        timing=args.timing,
        speed=args.speed,
        timeout=args.timeout,
        volatile=messages.VOLATILE | frozenset(args.ignore),
        send=args.send,
        progress=progress_bar(sys.stderr) if show_progress else None,
    )
    stopped = _Stopped()
    try:
        report = trio.run(_replay_to, args.target, replaying, stopped)
    except KeyboardInterrupt:  # SIGINT before the receiver was open (or after it closed)
        stopped.signum = signal.SIGINT
        report = None
    if report is None or stopped.signum is not None:  # the call in flight is reset; no partial report
        signum = stopped.signum or signal.SIGINT
        end_bar = "\n" if show_progress else ""  # the bar's line is left unfinished
        print(f"{end_bar}krproxy trace replay: interrupted by {signum.name}", file=sys.stderr)
        return 128 + signum
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1


class _Stopped:
    """The signal that stopped a replay, if one did."""

    signum: signal.Signals | None = None


async def _replay_to(
    target: str, replaying: Callable[..., ReplayReport], stopped: _Stopped
) -> ReplayReport | None:
    """Run the (blocking) replay in a worker thread, its calls on a channel of this trio run, until it ends
    or SIGINT/SIGTERM arrives: then the call in flight is cancelled, the thread's wait between calls
    (``--timing``) ends at once, and None is returned with the signal in ``stopped``."""
    stop = threading.Event()
    report: ReplayReport | None = None
    # Signals can be caught in the main thread only (tests run the command in others: no stopping there).
    in_main = threading.current_thread() is threading.main_thread()
    receiver = (
        trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) if in_main else contextlib.nullcontext()
    )
    with receiver as signals:
        async with rpc.Channel(strip_unix_scheme(target)) as channel:
            transport = _StoppableTransport(ChannelTransport(channel), stop)
            async with trio.open_nursery() as nursery:

                async def watch(signals: AsyncIterator[int]) -> None:
                    async for signum in signals:
                        stopped.signum = signal.Signals(signum)
                        stop.set()
                        nursery.cancel_scope.cancel()
                        return

                if signals is not None:
                    nursery.start_soon(watch, signals)
                with contextlib.suppress(_Interrupted):
                    report = await trio.to_thread.run_sync(
                        functools.partial(replaying, transport, sleep=_waiter(stop))
                    )
                nursery.cancel_scope.cancel()
    return None if stopped.signum is not None else report


def _waiter(stop: threading.Event) -> Callable[[float], None]:
    """A sleep for the replay's thread that ends early once ``stop`` is set."""

    def wait(seconds: float) -> None:
        stop.wait(seconds)

    return wait


class _Interrupted(Exception):
    """Raised in the replay's thread once a signal stopped the replay."""


class _StoppableTransport:
    """A transport that refuses calls once ``stop`` is set (the replay's thread then ends)."""

    def __init__(self, transport: Transport, stop: threading.Event) -> None:
        self._transport, self._stop = transport, stop

    def __call__(self, path: str, request: bytes, timeout: float) -> Any:
        if self._stop.is_set():
            raise _Interrupted
        try:
            return self._transport(path, request, timeout)
        except trio.Cancelled:  # the call in flight, cancelled by the signal
            raise _Interrupted from None


async def _serve_trace(backend: TraceBackend, socket: str) -> None:
    server = rpc.Server({}, fallback=backend.fallback)
    sock = bind_unix_socket(socket)  # here, so that a socket in use is a plain error (see _serve)
    inode = os.stat(socket).st_ino
    try:
        # Signals are ours before anyone is told we serve: a SIGTERM right after "serving" stops
        # us cleanly (statistics printed) instead of killing the process.
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(server.serve_socket, sock)
                log.event(LOGGER, "serving", socket=socket, methods=len(backend.answers.paths))
                async for _ in signals:
                    break
                nursery.cancel_scope.cancel()
    finally:
        sock.close()
        unlink_if_ours(socket, inode)
    log.event(LOGGER, "stopped", socket=socket)


def _serve(args: argparse.Namespace) -> int:
    loaded = _load(args.files)
    if loaded is None:
        return 2
    backend = TraceBackend(loaded.records, timing=args.timing)
    try:
        trio.run(_serve_trace, backend, strip_unix_scheme(args.socket))
    except SocketInUseError as err:
        print(
            f"krproxy trace serve: error: {err}; stop that process first, or choose another --socket",
            file=sys.stderr,
        )
        return 1
    except OSError as err:
        print(f"krproxy trace serve: error: --socket {args.socket}: {err}", file=sys.stderr)
        return 1
    stats = backend.answers.statistics()
    print(
        f"answered: {stats.exact} matching, {stats.sequential} in recorded order, "
        f"{stats.repeated} repeated, {stats.missing} not in the trace",
        file=sys.stderr,
    )
    return 0


def _logged(command: Callable[[argparse.Namespace], int], level: str) -> Callable[[argparse.Namespace], int]:
    """``command`` with logging set up first (the main CLI leaves that to subcommands like this)."""

    def run(args: argparse.Namespace) -> int:
        log.configure(level, "logfmt")
        return command(args)

    return run
