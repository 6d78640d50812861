"""The SDK's NRI stub run as a program: a sample plugin's ``raise SystemExit(stub.main())``.

It serves until the runtime closes the connection, or until the first SIGINT, SIGTERM or SIGHUP (caught
before it connects), then logs ``nri_stub_stopped``: exit 0. A socket it cannot connect to (or an
``NRI_PLUGIN_SOCKET`` that is no descriptor) is one ``nri_stub_failed`` line naming it, exit 1.
``log_level``: krproxy's log format on stderr at that level, as ``krproxy hooks serve`` logs (``None``
leaves logging as the caller set it up).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from krproxy import log
from krproxy._supervise import exception_leaves, watch_signals

LOGGER = logging.getLogger("krproxy.hookserver.nri")


def run_program(run: Callable[[], Awaitable[None]], plugin: str, where: str, log_level: str | None) -> int:
    """Serve (``run``: the stub's) until the runtime or a signal ends it; the program's exit status.

    ``plugin`` and ``where`` (its socket, or the descriptor's variable) name it in the lines logged."""
    if log_level is not None:
        log.configure(log_level)

    async def supervised() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(watch_signals, nursery.cancel_scope.cancel)
            await run()
            nursery.cancel_scope.cancel()  # the runtime closed the connection

    try:
        trio.run(supervised)
    except BaseException as err:
        leaves = exception_leaves(err)
        if not all(isinstance(leaf, (OSError, ValueError)) for leaf in leaves):
            raise
        reason = "; ".join(getattr(leaf, "strerror", None) or str(leaf) for leaf in leaves)
        log.error(LOGGER, "nri_stub_failed", plugin=plugin, socket=where, error=reason)
        return 1
    log.event(LOGGER, "nri_stub_stopped", plugin=plugin)
    return 0
