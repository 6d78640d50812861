"""NRI plugins in Python: a stub that speaks NRI to the runtime itself (no bridge, one hop).

A plugin makes an :class:`NriStub` with its name and two-digit index, decorates its handlers, and runs
:meth:`NriStub.run`::

    stub = NriStub("env-adder", "10")

    @stub.create_container
    def add_env(pod, container):
        return api.ContainerAdjustment(env=[api.KeyValue(key="MODE", value="b")])

    trio.run(stub.run)

Handlers are plain or async functions; they get NRI's own records (``api.PodSandbox``,
``api.Container``, ...; :mod:`krproxy.proto.nri.pkg.api.v1alpha1`) read-only (:mod:`krproxy.nri.records`:
setting a field raises ``FrozenRecordError``, lists are tuples, maps read-only; ``thaw()`` copies one)
and answer with NRI's answers, which they build. A plain handler is answered at once, on the session's
reader (:mod:`krproxy.nri._session`: no task, one write per read): it must only compute. An ``async def``
handler gets a task of its own under the runtime's request timeout and may await. Answers are written by
:func:`krproxy.nri.encoding.encode` (betterproto2's bytes, planned once per class):

=============================  ==========================  =============================================
decorator                      handler's arguments         answer
=============================  ==========================  =============================================
``synchronize``                pods, containers            list of ``ContainerUpdate`` (or None)
``create_container``           pod, container              ``ContainerAdjustment``, or (adjustment,
                                                           updates), or None, or NRI's whole
                                                           ``CreateContainerResponse`` (evictions too)
``update_container``           pod, container, resources   list of ``ContainerUpdate`` (or None), or
                                                           ``UpdateContainerResponse`` (evictions too)
``stop_container``             pod, container              list of ``ContainerUpdate`` (or None)
``update_pod_sandbox``         pod, resources, overhead    None (NRI 0.12; raise to refuse the resize)
``validate_container_adjust``  the request                 None to accept, a reason (str) to refuse
``run_pod_sandbox``, ...       pod (and container)         None (the events without an answer)
=============================  ==========================  =============================================

Connection: the socket ``NRI_PLUGIN_SOCKET`` names as a file descriptor when the runtime started the
plugin (a pre-registered plugin; ``NRI_PLUGIN_NAME`` and ``NRI_PLUGIN_IDX`` then give its name and index,
as NRI's Go stub reads them), else ``socket`` (``/var/run/nri/nri.sock``). The subscription is the events
the plugin has handlers for; a runtime before NRI 0.12 (no version in Configure) is not subscribed to the
0.12 events it lacks, and each such handler is named in a warning; adjustment fields newer than the
runtime's NRI (which it drops), and env vars removed (no NRI release passes the removal on to the
runtime: :mod:`krproxy.nri.versions`), are named in a warning at each creation that sets them. Requests
are decoded by upb straight into the read-only records (:func:`krproxy.nri.records.parse_frozen`). The events without an answer come as
NRI 0.12's dedicated methods or as ``StateChange`` from older runtimes; both reach the same handler.

Evictions (``api.ContainerEviction(container_id=..., reason=...)`` in the ``evict`` of a
``CreateContainerResponse`` or ``UpdateContainerResponse``) are sent as answered, but NRI's adaptation
does not act on them (0.6.1, 0.8.0 and the validator era's, as read: it answers the runtime no eviction),
so each answer with evictions is named in a warning (``nri_stub_evictions_not_applied``). An eviction
without a container id, or of the container being created, is refused as a wrong answer.

Failures: a handler's exception is answered to the runtime as an error naming the plugin (``index-name``)
and the handler, and logged; NRI then fails that event's operation only (a pre event) and the plugin stays
connected. An async handler that outlives the runtime's request timeout is cancelled by the session
(NRI drops a plugin that is late). An answer of the wrong type is reported the same way as an exception.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import betterproto2
import trio

from krproxy import log
from krproxy.grpcstatus import Status
from krproxy.hookserver import _nriprogram
from krproxy.nri import (
    DEFAULT_SOCKET,
    NRI_VERSION,
    PLUGIN_SERVICE,
    RUNTIME_SERVICE,
    _mux,
    check_index,
    check_name,
    encoding,
)
from krproxy.nri._events import warm_up
from krproxy.nri._session import Handler, Session, TtrpcError
from krproxy.nri.encoding import encode
from krproxy.nri.notices import NOTICE_METHODS
from krproxy.nri.records import parse_frozen, prepare
from krproxy.nri.versions import RuntimeNri
from krproxy.proto.nri.pkg.api import v1alpha1 as api

__all__ = ["NriStub", "PluginError"]

LOGGER = logging.getLogger("krproxy.hookserver.nri")

#: NRI's environment for a plugin the runtime starts itself (``pkg/api/plugin.go``).
SOCKET_ENV, NAME_ENV, INDEX_ENV = "NRI_PLUGIN_SOCKET", "NRI_PLUGIN_NAME", "NRI_PLUGIN_IDX"
#: The events a runtime before NRI 0.12 has (0.8's ``ValidEvents``: up to REMOVE_CONTAINER).
_BEFORE_0_12 = frozenset(e for e in api.Event if 0 < e <= api.Event.REMOVE_CONTAINER)
#: Events without an answer of their own: NRI 0.12's method and request message, per event.
NOTICES = NOTICE_METHODS

#: The calls answered with ContainerUpdates: request and response messages.
_UPDATE_CALLS: Mapping[api.Event, tuple[type[Any], type[Any]]] = {
    api.Event.UPDATE_CONTAINER: (api.UpdateContainerRequest, api.UpdateContainerResponse),
    api.Event.STOP_CONTAINER: (api.StopContainerRequest, api.StopContainerResponse),
}

#: The messages the stub reads and writes (and every message they hold), prepared by
#: :func:`~krproxy.nri._events.warm_up` before it registers: betterproto2 resolves a class's type hints at
#: its first use, ~30 ms for a CreateContainer request and its adjustment, which the first pod after each
#: start of the plugin paid inside the runtime's request timeout.
STUB_MESSAGES: tuple[type[betterproto2.Message], ...] = (
    api.ConfigureRequest,
    api.ConfigureResponse,
    api.SynchronizeRequest,
    api.SynchronizeResponse,
    api.CreateContainerRequest,
    api.CreateContainerResponse,
    api.UpdateContainerRequest,
    api.UpdateContainerResponse,
    api.StopContainerRequest,
    api.StopContainerResponse,
    api.UpdatePodSandboxRequest,
    api.UpdatePodSandboxResponse,
    api.ValidateContainerAdjustmentRequest,
    api.ValidateContainerAdjustmentResponse,
    api.StateChangeEvent,
    api.Empty,
    *(request for _, request in NOTICE_METHODS.values()),
)

#: The runtime's requests the stub reads (:func:`~krproxy.nri.records.parse_frozen`).
STUB_REQUESTS = tuple(m for m in STUB_MESSAGES if m.__name__.endswith("Request") or m is api.StateChangeEvent)
#: The answers the stub writes (:func:`~krproxy.nri.encoding.encode`).
STUB_ANSWERS = tuple(m for m in STUB_MESSAGES if m not in STUB_REQUESTS)

AnyHandler = Callable[..., Any]
#: A method's reply: at once, or (an async handler's) once awaited (:data:`krproxy.nri._session.Handler`).
Answer = bytes | Awaitable[bytes]


class PluginError(Exception):
    """A handler failed or answered what NRI cannot take; said to the runtime with the plugin's name."""


@attrs.define(eq=False)
class NriStub:
    """An NRI plugin: its name, index, handlers, and the connection to the runtime (see the module)."""

    name: str = attrs.field(converter=check_name)
    index: str = attrs.field(converter=check_index)
    socket: str = DEFAULT_SOCKET
    #: The runtime's NRI version from Configure ("" before NRI 0.12) and its name and version.
    nri_version: str = attrs.field(default="", init=False)
    runtime: str = attrs.field(default="", init=False)
    #: The events subscribed at the last Configure (NRI's mask).
    subscribed: int = attrs.field(default=0, init=False)
    #: Whether the runtime's NRI is 0.8 or later (its Configure carries timeouts; 0.6.1's does not).
    nri_0_8: bool = attrs.field(default=True, init=False)
    #: What the runtime's NRI applies of an adjustment (from the last Configure).
    runtime_nri: RuntimeNri = attrs.field(factory=RuntimeNri, init=False)
    #: Set once the runtime synchronized the plugin on the current connection.
    synchronized: trio.Event = attrs.field(factory=trio.Event, init=False)
    _handlers: dict[api.Event | str, AnyHandler] = attrs.field(factory=dict, init=False)

    @classmethod
    def from_environment(cls, name: str, index: str, socket: str = DEFAULT_SOCKET) -> NriStub:
        """A stub named by NRI's environment when the runtime started the plugin, else by *name*/*index*."""
        return cls(os.environ.get(NAME_ENV) or name, os.environ.get(INDEX_ENV) or index, socket)

    @property
    def full_name(self) -> str:
        return f"{self.index}-{self.name}"

    # -- decorators ------------------------------------------------------------------------------

    def _on(self, key: api.Event | str) -> Callable[[AnyHandler], AnyHandler]:
        def register(handler: AnyHandler) -> AnyHandler:
            if key in self._handlers:
                raise ValueError(f"NRI plugin {self.full_name} has two handlers of {key}: keep one")
            self._handlers[key] = handler
            return handler

        return register

    def synchronize(self, handler: AnyHandler) -> AnyHandler:
        return self._on("Synchronize")(handler)

    def create_container(self, handler: AnyHandler) -> AnyHandler:
        return self._on(api.Event.CREATE_CONTAINER)(handler)

    def update_container(self, handler: AnyHandler) -> AnyHandler:
        return self._on(api.Event.UPDATE_CONTAINER)(handler)

    def stop_container(self, handler: AnyHandler) -> AnyHandler:
        return self._on(api.Event.STOP_CONTAINER)(handler)

    def update_pod_sandbox(self, handler: AnyHandler) -> AnyHandler:
        return self._on(api.Event.UPDATE_POD_SANDBOX)(handler)

    def validate_container_adjustment(self, handler: AnyHandler) -> AnyHandler:
        return self._on(api.Event.VALIDATE_CONTAINER_ADJUSTMENT)(handler)

    def on(self, event: api.Event) -> Callable[[AnyHandler], AnyHandler]:
        """A handler of an event without an answer (``api.Event.RUN_POD_SANDBOX``, the Post* events, ...)."""
        if event not in NOTICES:
            raise ValueError(f"{event!r} has an answer: use its own decorator (e.g. stub.create_container)")
        return self._on(event)

    # -- running ---------------------------------------------------------------------------------

    def events(self, runtime_has_0_12: bool = True) -> int:
        """The event mask of the handlers, of what the runtime knows."""
        mask = 0
        for key in self._handlers:
            if isinstance(key, api.Event) and (runtime_has_0_12 or key in _BEFORE_0_12):
                mask |= 1 << (key - 1)
        return mask

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect, register and serve until the runtime closes the connection."""
        if not self.events() and "Synchronize" not in self._handlers:
            raise ValueError(f"NRI plugin {self.full_name} has no handlers: decorate at least one")
        warm_up(STUB_MESSAGES)  # before the runtime's first event, not during it
        for read in STUB_REQUESTS:
            prepare(read)
        for answer in STUB_ANSWERS:
            encoding.prepare(answer)
        fd = os.environ.get(SOCKET_ENV, "")
        if fd:
            try:
                sock = socket.socket(fileno=int(fd))
            except (ValueError, OSError) as exc:
                raise ValueError(f"{SOCKET_ENV}={fd!r} is not a socket's file descriptor: {exc}") from None
            stream: trio.abc.Stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        else:
            stream = await trio.open_unix_socket(self.socket)
        session = Session(stream, _mux.PLUGIN_SERVICE_CONN, _mux.RUNTIME_SERVICE_CONN, self._methods())
        self.synchronized = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(session.run)
            request = api.RegisterPluginRequest(
                plugin_name=self.name, plugin_idx=self.index, NRI_version=NRI_VERSION
            )
            with trio.fail_after(5):  # NRI's registration timeout
                await session.call(RUNTIME_SERVICE, "RegisterPlugin", bytes(request))
            log.event(LOGGER, "nri_stub_registered", plugin=self.full_name)
            task_status.started()

    def main(self, log_level: str | None = "info") -> int:
        """Run the stub as a program (a sample's ``raise SystemExit(stub.main())``); its exit status
        (:func:`krproxy.hookserver._nriprogram.run_program`: signals, the lines it logs, exit codes)."""
        fd = os.environ.get(SOCKET_ENV)
        where = f"{SOCKET_ENV}={fd}" if fd else self.socket
        return _nriprogram.run_program(self.run, self.full_name, where, log_level)

    def _methods(self) -> dict[tuple[str, str], Handler]:
        methods: dict[str, Handler] = {
            "Configure": self._configure,
            "Synchronize": self._synchronize,
            "Shutdown": self._shutdown,
            "CreateContainer": self._create_container,
            "UpdateContainer": self._update_container,
            "StopContainer": self._stop_container,
            "UpdatePodSandbox": self._update_pod_sandbox,
            "ValidateContainerAdjustment": self._validate,
            "StateChange": self._state_change,
        }
        for event, (method, request_type) in NOTICES.items():
            if event in self._handlers:  # else Unimplemented, as a Go stub without it answers
                methods[method] = self._notice(event, request_type)
        return {(PLUGIN_SERVICE, name): handler for name, handler in methods.items()}

    def _call(self, key: api.Event | str, args: tuple[Any, ...], then: Callable[[Any], bytes]) -> Answer:
        """The handler of ``key`` called with ``args``, its answer made into the reply by ``then``.

        A plain handler's reply is returned at once (the session answers on its reader's task); an
        awaitable answer (an ``async def`` handler) gives an awaitable of the reply instead.
        """
        handler = self._handlers[key]
        try:
            answer = handler(*args)
        except Exception as exc:
            raise self._failed(handler, exc) from None
        if inspect.isawaitable(answer):
            return self._awaited(handler, answer, then)
        return then(answer)

    async def _awaited(
        self, handler: AnyHandler, answer: Awaitable[Any], then: Callable[[Any], bytes]
    ) -> bytes:
        try:
            done = await answer
        except Exception as exc:
            raise self._failed(handler, exc) from None
        return then(done)

    def _failed(self, handler: AnyHandler, exc: Exception) -> TtrpcError:
        what = getattr(handler, "__name__", repr(handler))
        LOGGER.error("NRI plugin %s: handler %s failed", self.full_name, what, exc_info=exc)
        return TtrpcError(
            Status.UNKNOWN, f"plugin {self.full_name}: {what} failed: {exc or type(exc).__name__}"
        )

    def _refuse(self, key: api.Event | str, answer: Any, wanted: str) -> TtrpcError:
        what = getattr(self._handlers[key], "__name__", "handler")
        return self._wrong(f"{what} answered {type(answer).__name__}; it must answer {wanted}")

    def _wrong(self, problem: str) -> TtrpcError:
        """A handler's answer NRI cannot take, said to the runtime (and logged) with the plugin's name."""
        message = f"plugin {self.full_name}: {problem}"
        LOGGER.error("%s", message)
        return TtrpcError(Status.UNKNOWN, message)

    def _updates(self, key: api.Event | str, answer: Any) -> list[api.ContainerUpdate]:
        if answer is None:
            return []
        if isinstance(answer, (list, tuple)) and all(isinstance(u, api.ContainerUpdate) for u in answer):
            return list(answer)
        raise self._refuse(key, answer, "a list of ContainerUpdate or None")

    def _configure(self, payload: bytes) -> bytes:
        request = api.ConfigureRequest.parse(payload)
        self.runtime_nri = RuntimeNri.configured(request)
        self.nri_version, self.nri_0_8 = self.runtime_nri.version, self.runtime_nri.has_0_8
        self.runtime = f"{request.runtime_name} {request.runtime_version}".strip()
        has_0_12 = self.runtime_nri.has_0_12
        lacking = [
            k.name
            for k in self._handlers
            if isinstance(k, api.Event) and not has_0_12 and k not in _BEFORE_0_12
        ]
        if lacking:
            log.warning(
                LOGGER,
                "nri_stub_events_unavailable",
                plugin=self.full_name,
                events=",".join(lacking),
                reason="the runtime's NRI is older than 0.12 and has no such events",
            )
        self.subscribed = self.events(has_0_12)
        # NRI reads 0 as every event: a plugin with only a Synchronize handler subscribes to the least.
        events = self.subscribed or 1 << (api.Event.REMOVE_POD_SANDBOX - 1)
        return encode(api.ConfigureResponse(events=events))

    def _synchronize(self, payload: bytes) -> Answer:
        request = parse_frozen(api.SynchronizeRequest, payload)

        def answered(answer: Any) -> bytes:
            updates = self._updates("Synchronize", answer)
            if not request.more:
                self.synchronized.set()
            return encode(api.SynchronizeResponse(update=updates, more=request.more))

        if "Synchronize" not in self._handlers:
            return answered(None)
        return self._call("Synchronize", (request.pods, request.containers), answered)

    def _shutdown(self, payload: bytes) -> bytes:
        log.event(LOGGER, "nri_stub_shutdown", plugin=self.full_name)
        return _EMPTY

    def _create_container(self, payload: bytes) -> Answer:
        key = api.Event.CREATE_CONTAINER
        if key not in self._handlers:
            return bytes(api.CreateContainerResponse())
        request = parse_frozen(api.CreateContainerRequest, payload)
        return self._call(key, (request.pod, request.container), lambda a: self._created(request, a))

    def _created(self, request: api.CreateContainerRequest, answer: Any) -> bytes:
        key = api.Event.CREATE_CONTAINER
        adjust, updates, evict = answer, None, []
        if isinstance(answer, api.CreateContainerResponse):
            adjust, updates, evict = answer.adjust, answer.update, list(answer.evict)
        elif isinstance(answer, tuple) and len(answer) == 2:
            adjust, updates = answer
        if adjust is not None and not isinstance(adjust, api.ContainerAdjustment):
            wanted = "a ContainerAdjustment, (adjustment, updates), a CreateContainerResponse or None"
            raise self._refuse(key, answer, wanted)
        if adjust is not None:
            self._say_not_applied(request.container, adjust)
        created = request.container.id if request.container is not None else ""
        self._check_evictions(key, evict, created)
        return encode(
            api.CreateContainerResponse(adjust=adjust, update=self._updates(key, updates), evict=evict)
        )

    def _check_evictions(self, key: api.Event, evict: list[api.ContainerEviction], created: str = "") -> None:
        """Refuse evictions NRI could not name; warn that the runtime's NRI does not act on the rest."""
        what = getattr(self._handlers[key], "__name__", "handler")
        for eviction in evict:
            if not eviction.container_id:
                raise self._wrong(f"{what} asked to evict a container without naming it (container_id)")
            if eviction.container_id == created:
                raise self._wrong(
                    f"{what} asked to evict {created}, the container being created: raise to refuse it"
                )
        if evict:
            log.warning(
                LOGGER,
                "nri_stub_evictions_not_applied",
                plugin=self.full_name,
                containers=",".join(f"{e.container_id} ({e.reason})" for e in evict),
                reason="NRI's adaptation does not act on evictions: the runtime keeps these containers",
            )

    def _say_not_applied(self, container: api.Container | None, adjust: api.ContainerAdjustment) -> None:
        """Warn of what of the adjustment the runtime's NRI will not apply (:mod:`krproxy.nri.versions`),
        once per reason."""
        by_reason: dict[str, list[str]] = {}
        for field, reason in self.runtime_nri.not_applied(adjust):
            by_reason.setdefault(reason, []).append(field)
        for reason, fields in by_reason.items():
            log.warning(
                LOGGER,
                "nri_stub_fields_not_applied",
                plugin=self.full_name,
                container=container.name if container is not None else "",
                fields=",".join(fields),
                reason=reason,
            )

    def _update_container(self, payload: bytes) -> Answer:
        return self._answer_updates(api.Event.UPDATE_CONTAINER, payload)

    def _stop_container(self, payload: bytes) -> Answer:
        return self._answer_updates(api.Event.STOP_CONTAINER, payload)

    def _answer_updates(self, key: api.Event, payload: bytes) -> Answer:
        """UpdateContainer or StopContainer: the handler's ContainerUpdates (the update gets the resources)."""
        request_type, response_type = _UPDATE_CALLS[key]
        if key not in self._handlers:
            return bytes(response_type())
        request = parse_frozen(request_type, payload)
        args = [request.pod, request.container]
        if key is api.Event.UPDATE_CONTAINER:
            args.append(request.linux_resources)

        def answered(answer: Any) -> bytes:
            if key is api.Event.UPDATE_CONTAINER and isinstance(answer, api.UpdateContainerResponse):
                self._check_evictions(key, list(answer.evict))
                return encode(
                    api.UpdateContainerResponse(update=self._updates(key, answer.update), evict=answer.evict)
                )
            return encode(response_type(update=self._updates(key, answer)))

        return self._call(key, tuple(args), answered)

    def _update_pod_sandbox(self, payload: bytes) -> Answer:
        key = api.Event.UPDATE_POD_SANDBOX
        if key not in self._handlers:
            return _UPDATE_POD_SANDBOX_RESPONSE
        request = parse_frozen(api.UpdatePodSandboxRequest, payload)
        resources, overhead = request.linux_resources, request.overhead_linux_resources
        return self._call(key, (request.pod, resources, overhead), lambda _: _UPDATE_POD_SANDBOX_RESPONSE)

    def _validate(self, payload: bytes) -> Answer:
        key = api.Event.VALIDATE_CONTAINER_ADJUSTMENT
        if key not in self._handlers:
            return bytes(api.ValidateContainerAdjustmentResponse())

        def answered(answer: Any) -> bytes:
            if answer is not None and not isinstance(answer, str):
                raise self._refuse(key, answer, "None (accept) or the reason to refuse (str)")
            return encode(
                api.ValidateContainerAdjustmentResponse(reject=answer is not None, reason=answer or "")
            )

        return self._call(key, (parse_frozen(api.ValidateContainerAdjustmentRequest, payload),), answered)

    def _notice(self, event: api.Event, request_type: type[Any]) -> Handler:
        def handle(payload: bytes) -> Answer:
            request = parse_frozen(request_type, payload)
            args = (request.pod,) if not hasattr(request, "container") else (request.pod, request.container)
            return self._call(event, args, _empty)

        return handle

    def _state_change(self, payload: bytes) -> Answer:
        """Before NRI 0.12: the events without an answer, one method for all."""
        request = parse_frozen(api.StateChangeEvent, payload)
        if request.event in self._handlers and request.event in NOTICES:
            container_event = hasattr(NOTICES[request.event][1](), "container")
            args = (request.pod, request.container) if container_event else (request.pod,)
            return self._call(request.event, args, _empty)
        return _EMPTY


#: NRI's empty answers, serialized once.
_EMPTY = bytes(api.Empty())
_UPDATE_POD_SANDBOX_RESPONSE = bytes(api.UpdatePodSandboxResponse())


def _empty(answer: Any) -> bytes:
    """The reply of an event without an answer, whatever its handler returned (as before: ignored)."""
    return _EMPTY
