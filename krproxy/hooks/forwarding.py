"""What follows the forward of a hooked Start, Stop or Remove: its post hooks, and the store forgetting the
object once the runtime is done with it. Used by :mod:`krproxy.hooks.runtime`'s interceptors."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from krproxy.forward import BackendError, Forward, Reply
from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks import watched

__all__ = ["forward_then", "forward_then_forget"]


async def forward_then(forward: Forward, data: bytes, post: Callable[[], Awaitable[None]]) -> Reply:
    """Forward, then run the post hooks — after the runtime's answer, also an error one.

    Not after a cancellation (kubelet gave up, or shutdown cancelled the call): nobody would
    wait for the result, and hooks running then would outlive the grace period.
    """
    try:
        reply = await forward(data)
    except GRPCError as err:
        if err.status is Status.DEADLINE_EXCEEDED and not isinstance(err, BackendError):
            raise  # the caller's deadline passed at the proxy: kubelet gave up, as for a cancellation
        await post()
        raise
    await post()
    return reply


async def forward_then_forget(
    call: Awaitable[Reply], forget: Callable[[], object], *, gone: Callable[[], object] | None = None
) -> Reply:
    """Await a Stop or Remove call, then ``forget`` its store entry if the object is done with.

    Forgotten when the runtime succeeded, or answered NOT_FOUND (the object is gone: no later
    call can need its record; ``gone``, if given, is called instead of ``forget`` then: a sandbox
    the runtime no longer has took its containers with it, and kubelet sends no RemoveContainer
    for containers the runtime does not list). Kept after any other failure — an error status, an unreachable
    runtime, a deadline, a cancellation — since kubelet retries a failed Stop, and the retry's
    PostStop hooks need the full record. (koord-runtime-proxy drops the entry before knowing the
    outcome, so a retried Stop runs no hooks; its fix, koordinator#3142, drops on success only.)
    A kept entry is not leaked: the retry, or kubelet's Remove, drops it.
    """
    try:
        reply = await call
    except BackendError as err:
        watched.forget_when_done(err.status, forget, gone)
        raise
    forget()
    return reply
