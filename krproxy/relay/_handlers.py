"""The tasks calls' handlers run in (:class:`HandlerTasks`, a transport's ``handlers``): a task whose
handler is over parks, and the next call's handler runs in it.

Starting a trio task cost ~35 µs on the caller's reader of every intercepted call (each hooked
CreateContainer), and entering a cancel scope of its own in it ~50 Python calls more: a parked task is
woken with ``reschedule`` and runs its handlers in one cancel scope, which it gives to each. At most
:data:`MAX_IDLE` stay parked (a burst's others end as they did), and the transport's stop ends them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from krproxy import calls

__all__ = ["MAX_IDLE", "Handler", "HandlerTasks"]

#: Handler tasks kept parked once their call is over, for the next calls' handlers: calls one after the
#: other need one; more would stay in the transport's task count after a burst.
MAX_IDLE = 2

#: A call's handler, run by :meth:`HandlerTasks.start` in the cancel scope it is given.
Handler = Callable[[trio.CancelScope], Awaitable[object]]


class _Parked:
    """A handler task (its :class:`HandlerTasks`'s), and the handler it is woken for."""

    __slots__ = ("fn", "task")

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.fn: Handler | None = None


class HandlerTasks:
    """The handler tasks of a transport, started in its ``nursery`` (the transport's, once it runs)."""

    __slots__ = ("idle", "nursery")

    def __init__(self) -> None:
        self.nursery: trio.Nursery = None  # type: ignore[assignment]  # set by Transport.run()
        self.idle: list[_Parked] = []  # newest last

    def start(self, fn: Handler) -> None:
        """Run ``fn(scope)`` in a handler task: a parked one, else a new one. As ``nursery.start_soon``:
        it runs once the current task waits, in a context where no call is current.

        ``scope`` is the task's cancel scope, which *fn* may cancel (its next checkpoint raises then, and
        the task takes a new scope after it), and must not keep once it returns: the task's next handler
        runs in it too."""
        idle = self.idle
        if idle:
            parked = idle.pop()
            parked.fn = fn
            trio.lowlevel.reschedule(parked.task)
        else:
            self.nursery.start_soon(self._run, fn)

    async def _run(self, fn: Handler) -> None:
        """Run handlers in a cancel scope until one cancels it (then in a new one), parking between them;
        keep nothing of a handler once it is over (its call would stay alive)."""
        parked = _Parked(trio.lowlevel.current_task())
        parked.fn = fn
        del fn
        while True:
            with trio.CancelScope() as scope:
                while not scope.cancel_called:
                    handler: Handler | None
                    handler, parked.fn = parked.fn, None
                    assert handler is not None  # (start set it)
                    try:
                        await handler(scope)
                    finally:
                        handler = None  # (also when it raised: the scope's cancel, caught below)
                    calls.CURRENT.set(None)  # the call is over
                    if not scope.cancel_called and not await self._park(parked):
                        return
            calls.CURRENT.set(None)
            if not await self._park(parked):
                return

    async def _park(self, parked: _Parked) -> bool:
        """Wait, parked, for :meth:`start`'s next handler; False: enough tasks are parked."""
        idle = self.idle
        if len(idle) >= MAX_IDLE:
            return False

        def abort(_: object) -> trio.lowlevel.Abort:  # cancelled while parked: the transport stops
            idle.remove(parked)
            return trio.lowlevel.Abort.SUCCEEDED

        idle.append(parked)
        await trio.lowlevel.wait_task_rescheduled(abort)
        return True
