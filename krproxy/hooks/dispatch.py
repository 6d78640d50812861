"""Calling hook plugins over gRPC (``runtime.v1alpha1.RuntimeHookService``).

:meth:`Dispatcher.run` calls every plugin registered for a hook point, in registry order,
handing each the request as the previous plugins left it (koord-runtime-proxy calls one
random plugin instead). Each call has the plugin's own timeout.

Error handling: a plugin is an untrusted peer. Whatever goes wrong with one call — it is
unreachable, hangs past its timeout, answers an error status or bytes that do not decode —
becomes a :class:`HookFailure`; so does a pre hook's answer that breaks a rule of
:mod:`krproxy.hooks.validate` (cause ``invalid answer: ...``), before any of it is applied.
With failure policy ``Fail`` on a pre hook the CRI call is rejected (:class:`HookRejected`, a
gRPC status naming plugin, hook and cause); otherwise the failure is logged and the chain goes
on without that plugin's changes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

import trio

from krproxy import log
from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks import answers
from krproxy.hooks.convert import WRONG_TYPES, answer_from_hook, wrong_types
from krproxy.hooks.merge import Change, Merged
from krproxy.hooks.model import ContainerAnswer, PodAnswer
from krproxy.hooks.outcomes import (
    ChainResult,
    HookFailure,
    HookRejected,
    Outcome,
    RequiredFailed,
    RequiredMissing,
)
from krproxy.hooks.points import HookPoint, Stage
from krproxy.hooks.registration import FailurePolicy, PluginRegistration, Registry
from krproxy.hooks.required import Availability, State
from krproxy.hooks.validate import INVALID_ANSWER, check_answer
from krproxy.proto.runtime import v1alpha1 as hookapi
from krproxy.relay import Relay
from krproxy.relay.rpc import UpstreamError

LOGGER = logging.getLogger("krproxy.hooks.dispatch")

#: The method :meth:`Dispatcher.probe` calls: in no hook server's service, so a server answers it
#: (UNIMPLEMENTED, or whatever its health service says) without doing any work.
PROBE_PATH = "/grpc.health.v1.Health/Check"

#: Largest plugin answer accepted (as grpc-go's default receive limit, which the reference's
#: plugin client has): a larger one is that plugin's failure, under its failure policy.
MAX_PLUGIN_ANSWER = 4 * 1024 * 1024

Request = hookapi.PodSandboxHookRequest | hookapi.ContainerResourceHookRequest
Response = hookapi.PodSandboxHookResponse | hookapi.ContainerResourceHookResponse
Record = TypeVar("Record")


class InvalidAnswer(Exception):
    """A pre hook's answer broke a rule of :mod:`krproxy.hooks.validate`; handled as a plugin failure."""

    def __init__(self, violations: Sequence[str]) -> None:
        super().__init__(f"{INVALID_ANSWER}: " + "; ".join(violations))
        self.violations = tuple(violations)


def _check_types(answer: Response) -> None:
    """Refuse an answer that decoded only loosely (:func:`krproxy.hooks.convert.wrong_types`)."""
    wrong = wrong_types(answer)
    if wrong:
        raise InvalidAnswer([f"{WRONG_TYPES} ({', '.join(wrong)})"])


def _reply_type(point: HookPoint) -> type[Any]:
    return hookapi.PodSandboxHookResponse if point.is_pod_level else hookapi.ContainerResourceHookResponse


def _record(answer: PodAnswer | ContainerAnswer | Response) -> PodAnswer | ContainerAnswer:
    """The record of an answer :func:`krproxy.hooks.answers.read` gave; raises :class:`InvalidAnswer` for
    one that decoded only loosely (:func:`krproxy.hooks.convert.wrong_types`)."""
    if isinstance(answer, (PodAnswer, ContainerAnswer)):
        return answer
    _check_types(answer)
    return answer_from_hook(answer)


def _serialized(request: Request | bytes) -> bytes:
    return request if isinstance(request, bytes) else bytes(request.SerializeToString())


class UnusableEndpoint(OSError):
    """The plugin's registration names no socket that can be dialed (:attr:`PluginRegistration.unusable`):
    each call fails as an unreachable server's does."""


class NoTimeLeft(Exception):
    """The caller's deadline (kubelet's, NRI's request timeout) left no time for this plugin; handled
    as a plugin failure."""


def _describe(err: BaseException, plugin: PluginRegistration, within: float) -> str:
    if isinstance(err, (InvalidAnswer, NoTimeLeft)):
        return str(err)
    if isinstance(err, TimeoutError):
        return f"no answer within {within:g}s"
    if isinstance(err, GRPCError) and err.status is Status.DEADLINE_EXCEEDED:
        # The plugin enforced the deadline we sent it (grpc-timeout, rounded down) first.
        return f"no answer within {within:g}s (the plugin gave up: DEADLINE_EXCEEDED)"
    if isinstance(err, GRPCError):
        return f"{err.status.name}: {err.message or ''}".rstrip(": ")
    if isinstance(err, UnusableEndpoint):
        return str(err)
    if isinstance(err, (ConnectionRefusedError, FileNotFoundError)):
        return f"unreachable at {plugin.endpoint} ({err.strerror or err})"  # no strerror: backlog full
    if isinstance(err, UpstreamError):  # its message says what happened: connection lost, bad answer...
        return str(err)
    return f"{type(err).__name__}: {err}"


class Dispatcher:
    """Holds the current plugin registry; calls plugins through ``relay`` (a connection per endpoint).

    Use in the trio thread the relay runs in. ``observe`` is told every :class:`Outcome`.
    """

    def __init__(
        self,
        relay: Relay,
        observe: Callable[[Outcome], None] = lambda outcome: None,
        *,
        on_outcome: Callable[[Outcome], None] = lambda outcome: None,
        call_deadline: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.registry = Registry()
        self._relay = relay
        self._endpoints: set[str] = set()  # endpoints the relay keeps a route to for us
        self._observe = observe
        self._on_outcome = on_outcome
        self._call_deadline = call_deadline

    def publish(self, registry: Registry) -> None:
        """Switch to a new registry; connections to endpoints no longer registered are closed."""
        self.registry = registry
        endpoints = {p.endpoint for p in registry.plugins.values()}
        for endpoint in self._endpoints - endpoints:
            self._relay.drop_route(endpoint)
        self._endpoints &= endpoints

    def close(self) -> None:
        for endpoint in self._endpoints:
            self._relay.drop_route(endpoint)
        self._endpoints.clear()

    def plugins_for(self, point: HookPoint) -> Sequence[PluginRegistration]:
        return self.registry.plugins_for(point)

    def check_required(
        self, point: HookPoint, required: Collection[str], hooked: Collection[str] = ()
    ) -> None:
        """Refuse a call whose required hook servers the current registry would not call at *point*:
        one of *required* no longer registered (its file went away after the guard saw it up), or one of
        *hooked* registered without *point* in its ``runtime-hooks``.

        Raises:
            RequiredMissing: UNAVAILABLE naming each such server, as the guard's refusal.
        """
        if not required and not hooked:
            return
        plugins = {p.name: p for p in self.registry.plugins.values()}
        missing: list[tuple[str, Availability]] = []
        for name in dict.fromkeys([*required, *hooked]):
            plugin = plugins.get(name)
            if plugin is None:
                error = self.registry.error_for(f"{name}.json")
                missing.append(
                    (name, Availability(State.MISSING, error or "its registration file went away"))
                )
            elif name in hooked and not plugin.handles(point):
                listed = ", ".join(p.value for p in plugin.hooks) or "nothing"
                detail = f"{plugin.file} lists {listed}"
                missing.append((name, Availability(State.NOT_HOOKED, detail)))
        if missing:
            raise RequiredMissing(point, missing)

    async def probe(self, plugin: PluginRegistration, within: float) -> None:
        """Check that *plugin* answers gRPC calls: call :data:`PROBE_PATH`, a method no hook server
        implements, and take any status as an answer (UNIMPLEMENTED is the usual one).

        Raises:
            OSError: the socket cannot be reached (absent, refused).
            TimeoutError: nothing came back within ``within`` seconds.
            UpstreamError: the connection ended, or the answer was not gRPC.
        """
        with contextlib.suppress(GRPCError):  # an answer, whatever it says
            await self._unary(plugin, PROBE_PATH, b"", within)

    async def _unary(self, plugin: PluginRegistration, path: str, request: bytes, within: float) -> bytes:
        if plugin.unusable is not None:
            raise UnusableEndpoint(f"unreachable: {plugin.unusable}")
        endpoint = plugin.endpoint
        # Only endpoints of the current registry keep their connection: a chain that began before
        # its plugin was unregistered must not leave one behind that nobody closes.
        registered = False
        for registration in self.registry.plugins.values():  # (a loop: no generator, no any())
            if registration.endpoint == endpoint:
                registered = True
                break
        route = self._relay.route_to(endpoint, f"plugin {plugin.name} at {endpoint}")
        if registered:
            self._endpoints.add(endpoint)
        try:
            return await self._relay.transport.call(
                route, path, request, within=within, max_answer=MAX_PLUGIN_ANSWER
            )
        finally:
            if not registered and endpoint not in self._endpoints:
                self._relay.drop_route(endpoint)

    async def run(
        self,
        point: HookPoint,
        record: Record,
        to_request: Callable[[Record], Request | bytes],
        merge: Callable[[Record, Any], Merged[Record]],
        *,
        target: str = "",
        deadline: float | None = None,
        required: Collection[str] = (),
        hooked: Collection[str] = (),
    ) -> ChainResult[Record]:
        """Call every plugin registered for ``point`` in order, threading ``record`` through them.

        Each plugin gets ``to_request(record)`` (a message, or one already serialized); a pre
        hook's answer is folded in with ``merge(record, answer)``, whose changes are kept in the
        plugin's :class:`Outcome`. A merge that changes nothing keeps the record as it was, so the
        next plugin's request is not built and serialized again.
        Post hooks' answers are ignored. Every outcome goes to ``observe`` (metrics) and
        ``on_outcome`` (the current call's record). ``target`` (a pod or
        container id) only goes into the logs.

        ``deadline`` (trio time) bounds the whole chain, for callers that must answer by then (NRI
        drops a plugin that misses the runtime's request timeout); by default it is the current
        CRI call's deadline (``call_deadline``: kubelet's, so a plugin is never told it has longer
        than kubelet will wait, as koord-runtime-proxy passes kubelet's context on). Each plugin
        gets its own timeout or what is left before the deadline, whichever is shorter, and a
        plugin reached with no time left fails (its failure policy applies) without being called.

        ``required`` names the plugins this call must not go without (required hook servers,
        :mod:`krproxy.hooks.required`): one of them failing a pre hook rejects the call whatever its
        failure policy, with UNAVAILABLE (:class:`RequiredFailed`), since kubelet's retry may find it back.
        At a pre hook, before any plugin is called, :meth:`check_required` refuses the call if one of them
        is not in the registry the chain runs with, or one of ``hooked`` is not registered for ``point``.

        Raises:
            HookRejected: a ``Fail`` plugin failed a pre hook; later plugins are not called.
            RequiredFailed: a required plugin failed a pre hook; later plugins are not called.
            RequiredMissing: a required plugin would not be called (see above); no plugin is called.
        """
        if deadline is None:
            deadline = self._call_deadline()
        outcomes: list[Outcome] = []
        request: tuple[Record, bytes] | None = None  # the serialized request of `record`
        plugins = self.plugins_for(point)  # the same registry as the check's: no await in between
        pre = point.stage is Stage.PRE
        rpc_path = point.rpc_path
        if pre:
            self.check_required(point, required, hooked)
        for plugin in plugins:
            started = time.perf_counter()
            changes: tuple[Change, ...] = ()
            within = plugin.timeout
            if deadline is not None:
                within = min(within, deadline - trio.current_time())
            try:
                if within <= 0:
                    raise NoTimeLeft("not called: no time left before the caller's deadline")
                if request is None or request[0] is not record:
                    request = (record, _serialized(to_request(record)))
                # Read straight into the record where upb can (a post hook's answer too: one that does not
                # decode is the plugin's failure).
                answer = answers.read(
                    _reply_type(point), await self._unary(plugin, rpc_path, request[1], within)
                )
                if pre:
                    read = _record(answer)
                    violations = check_answer(record, read)
                    if violations:
                        raise InvalidAnswer(violations)
                    merged = merge(record, read)
                    changes = merged.changes
                    value = merged.value
                    # Changes say the value differs (Merged); without them it is compared, since a
                    # merge may hand back an equal copy (then the record, and its request, stay).
                    if value is not record and (changes or value != record):
                        record = value
            except Exception as err:  # the plugin is an untrusted peer: every failure is handled
                failure = HookFailure(plugin.name, point, _describe(err, plugin, within))
                needed = plugin.name in required and pre
                rejected = needed or (plugin.failure_policy is FailurePolicy.FAIL and pre)
                outcome = Outcome(
                    plugin.name,
                    point,
                    "rejected" if rejected else "failed",
                    time.perf_counter() - started,
                    failure.cause,
                )
                self._report(outcomes, outcome)
                log.warning(
                    LOGGER,
                    "hook_failed",
                    plugin=plugin.name,
                    hook=point.value,
                    target=target,
                    policy="required" if needed else plugin.failure_policy.value,
                    cause=failure.cause,
                )
                if needed:
                    raise RequiredFailed(failure) from None
                if rejected:
                    raise HookRejected(failure) from None
                continue
            self._report(
                outcomes, Outcome(plugin.name, point, "ok", time.perf_counter() - started, "", changes)
            )
        return ChainResult(record, tuple(outcomes))

    def _report(self, outcomes: list[Outcome], outcome: Outcome) -> None:
        outcomes.append(outcome)
        self._observe(outcome)
        self._on_outcome(outcome)
        if LOGGER.isEnabledFor(logging.DEBUG):  # `--log-level debug`: one line per plugin call
            log.debug(
                LOGGER,
                "hook_call",
                plugin=outcome.plugin,
                hook=outcome.point.value,
                result=outcome.result,
                ms=round(outcome.seconds * 1000, 3),
                changes=",".join(c.field for c in outcome.changes),
                detail=outcome.detail,
            )
