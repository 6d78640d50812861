"""Helpers shared by the CRI daemon (:mod:`krproxy.daemon`) and Docker mode (:mod:`krproxy.docker`): retrying
recovery on trio, loading what it rebuilt, watching signals, saying they are ready."""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from krproxy import log

if TYPE_CHECKING:
    from krproxy.config import ProxyConfig
    from krproxy.docker.hooks import DockerHooks
    from krproxy.docker.recovery import Recovered as DockerRecovered
    from krproxy.hooks.recovery import Recovered
    from krproxy.hooks.runtime import HookRuntime
    from krproxy.metrics import Metrics

LOGGER = logging.getLogger("krproxy.recovery")

#: Retry delays of store recovery while the runtime is unreachable: doubling up to a cap.
RECOVERY_BACKOFF = (0.1, 5.0)

T = TypeVar("T")


def store_recovered(
    hooks: HookRuntime | DockerHooks,
    recovered: Recovered | DockerRecovered,
    metrics: Metrics,
    logger: logging.Logger,
    **details: Any,
) -> None:
    """Load what recovery rebuilt into the store, let the hooked calls through, set the ``recovered`` gauge,
    and log ``store_recovered`` (the counts, then *details*, orphans and seconds) to *logger*.

    Records the store holds already are kept over recovered ones: calls after the start-up grace
    (:mod:`krproxy.hooks.startup`) kept them, and they are newer than recovery's lists."""
    pods, containers = dict(recovered.pods), dict(recovered.containers)
    pods.update(hooks.store.pods())
    containers.update(hooks.store.containers())
    hooks.store.load(pods.items(), containers.items())
    hooks.mark_recovered()
    metrics.recovered.set(1)
    log.event(
        logger,
        "store_recovered",
        pods=len(recovered.pods),
        containers=len(recovered.containers),
        **details,
        orphans=recovered.orphans,
        seconds=round(recovered.seconds, 3),
    )


async def retry(
    attempt: Callable[[], Awaitable[T]],
    *,
    retry_on: tuple[type[Exception], ...],
    backoff: tuple[float, float] = RECOVERY_BACKOFF,
    **fields: Any,
) -> T:
    """Await ``attempt()`` until it succeeds, sleeping between failures. Errors outside ``retry_on``
    propagate.

    Failures are logged as ``recovery_retry`` with ``fields``, backing off: the first of a run of the same
    error, then only the 2nd, 4th, 8th... repeat, each with ``still=N`` (the failures so far), so that a
    runtime down for an hour is a dozen lines, not one every 5 s. A different error is logged at once and
    starts a new run."""
    delay, cap = backoff
    failures, last_error = 0, ""
    while True:
        try:
            return await attempt()
        except retry_on as err:
            error = f"{type(err).__name__}: {err}"
            failures = 1 if error != last_error else failures + 1
            last_error = error
            if failures == 1:
                log.warning(LOGGER, "recovery_retry", **fields, error=error, retry_in=delay)
            elif failures & (failures - 1) == 0:  # a power of two
                log.warning(LOGGER, "recovery_retry", **fields, still=failures, error=error, retry_in=delay)
        await trio.sleep(delay)
        delay = min(delay * 2, cap)


async def watch_signals(
    request_shutdown: Callable[[], None], *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Call ``request_shutdown`` on the first SIGTERM, SIGINT or SIGHUP, then return.

    SIGHUP stops gracefully too: the daemon has nothing to reload (it watches its registration
    files), and left to its default action the signal would kill it at once, calls cut, trace
    records unwritten and the socket file left behind.

    Reports started once the signals are caught (start it with ``nursery.start``, so that a
    daemon that says it is ready also stops gracefully on a SIGTERM sent at once).
    """
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        task_status.started()
        async for signum in signals:
            log.event(LOGGER.getChild("signal"), "signal", signal=signal.Signals(signum).name)
            request_shutdown()
            return


def log_ready(
    logger: logging.Logger,
    config: ProxyConfig,
    plugins: int,
    *,
    mode: str | None = None,
    image: str | None = None,
) -> None:
    """Log ``event=ready`` (docs/operations.md): the daemon's socket accepts calls. The fields keep the
    order each mode logged before they shared this: Docker mode names itself first (``mode``), the CRI
    daemon its image socket (``image``) after the runtime's."""
    fields: dict[str, Any] = {} if mode is None else {"mode": mode}
    fields.update(listen=config.listen, runtime=config.runtime_endpoint)
    if image is not None:
        fields["image"] = image
    log.event(logger, "ready", **fields, hook_dir=config.hook_dir, plugins=plugins)


def exception_leaves(err: BaseException) -> list[BaseException]:
    """The exceptions inside ``err``: itself, or every leaf of trio's (nested) exception groups. A command
    tells a user's mistake (every leaf an OSError: a socket in use, a path that is a directory) from a bug
    by them."""
    if isinstance(err, BaseExceptionGroup):
        return [leaf for sub in err.exceptions for leaf in exception_leaves(sub)]
    return [err]
