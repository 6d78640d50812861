"""The fake runtime's tables: its records of pods, containers and images, the lookups that read
them as containerd does (full IDs or unique prefixes, image names, digests or IDs), the status and
list messages built from them, their encoded forms, and the event outbox. Every CRI call of
:class:`~krproxy.fakes.containerd.state.RuntimeState` reads these; the container and image calls
(:mod:`~krproxy.fakes.containerd.containers`, :mod:`~krproxy.fakes.containerd.images`) hold them."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

import attrs

from krproxy.fakes.containerd.records import (
    Code,
    Container,
    CriError,
    EventType,
    ExecResult,
    ImageRecord,
    Sandbox,
    clone,
    container_info,
    encoded,
    image_record_for,
    lookup_failed,
    matches,
    normalize_image_name,
    sandbox_info,
)
from krproxy.fakes.containerd.settings import Settings
from krproxy.proto.runtime import v1 as cri

_R = TypeVar("_R", Sandbox, Container)
_T = TypeVar("_T")


@attrs.define(eq=False)
class Tables:
    """The records of one fake containerd, and what reads them as containerd does.

    The parts of :class:`~krproxy.fakes.containerd.state.RuntimeState` read and change the records
    here directly; what must change together (a container and its pod's index, a record and its
    reserved name) changes through a method.

    Attributes:
        settings: the fake's choices (:class:`~krproxy.fakes.containerd.settings.Settings`): its clock,
            the imitated version (lookups answer with its messages), the order of list answers.
        sandboxes: live sandboxes by ID, in creation order.
        containers: live containers by ID, in creation order.
        pod_index: sandbox ID -> the IDs of its containers, in creation order (the keys; values unused).
        images: pulled images by ID.
        exec_scripts: what ``ExecSync`` of a command answers, where a test scripted it.
        events: the lifecycle events not yet taken, oldest first.
        reserved_names: containerd's name index: "name_pod_namespace_uid_attempt" -> owner ID, unique
            while the owner lives.
    """

    settings: Settings
    sandboxes: dict[str, Sandbox] = attrs.field(init=False, factory=dict)
    containers: dict[str, Container] = attrs.field(init=False, factory=dict)
    pod_index: dict[str, dict[str, None]] = attrs.field(init=False, factory=dict)
    images: dict[str, ImageRecord] = attrs.field(init=False, factory=dict)
    exec_scripts: dict[tuple[str, ...], ExecResult] = attrs.field(init=False, factory=dict)
    events: list[cri.ContainerEventResponse] = attrs.field(init=False, factory=list)
    reserved_names: dict[str, str] = attrs.field(init=False, factory=dict)
    _ip_counter: itertools.count[int] = attrs.field(init=False, factory=lambda: itertools.count(2))

    # -- the outbox and scripts --------------------------------------------------------------

    def take_events(self) -> list[cri.ContainerEventResponse]:
        """Return the lifecycle events produced since the last call, oldest first, and forget them."""
        events, self.events = self.events, []
        return events

    def script_exec(self, cmd: Sequence[str], result: ExecResult) -> None:
        """Make ``ExecSync`` of exactly ``cmd`` (in any container) answer ``result``."""
        self.exec_scripts[tuple(cmd)] = result

    # -- lookups ------------------------------------------------------------------------------

    def find_sandbox(self, sandbox_id: str) -> Sandbox:
        """Find a sandbox by full ID or unique ID prefix, as containerd's store does (:meth:`_find`)."""
        return self._find(self.sandboxes, sandbox_id, "sandbox")

    def find_container(self, container_id: str) -> Container:
        """Find a container by full ID or unique ID prefix (:meth:`_find`)."""
        return self._find(self.containers, container_id, "container")

    def _find(self, table: Mapping[str, _R], key: str, kind: str) -> _R:
        """The record ``key`` names, read as containerd's truncindex reads it: the full ID or a unique
        prefix of one. Empty: UNKNOWN "prefix can't be empty" (1.6: "Prefix ..."); a prefix of several:
        UNKNOWN "Multiple IDs found with provided prefix"; none: NOT_FOUND. Each call's answer wraps it."""
        record = table.get(key)
        if record is not None:
            return record
        if not key:
            raise lookup_failed(kind, key, Code.UNKNOWN, self.settings.imitate.empty_prefix)
        candidates = [v for k, v in table.items() if k.startswith(key)]
        if len(candidates) > 1:
            raise lookup_failed(kind, key, Code.UNKNOWN, f"Multiple IDs found with provided prefix: {key}")
        if not candidates:
            raise lookup_failed(kind, key, Code.NOT_FOUND, "not found")
        return candidates[0]

    def resolve_image(self, name: str) -> ImageRecord | None:
        """Find a pulled image by name (short or full), repo digest, ID or bare ID hex."""
        if not name:
            return None
        if name in self.images:
            return self.images[name]
        if f"sha256:{name}" in self.images:
            return self.images[f"sha256:{name}"]
        ref = normalize_image_name(name)
        for image in self.images.values():
            if ref in image.repo_tags or name in image.repo_digests:
                return image
        return None

    # -- message builders ---------------------------------------------------------------------

    def sandbox_status(self, sandbox: Sandbox) -> cri.PodSandboxStatus:
        return cri.PodSandboxStatus(
            id=sandbox.id,
            metadata=cri.PodSandboxMetadata(
                name=sandbox.name, uid=sandbox.uid, namespace=sandbox.namespace, attempt=sandbox.attempt
            ),
            state=sandbox.state,
            created_at=sandbox.created_at,
            network=cri.PodSandboxNetworkStatus(ip=sandbox.ip),
            linux=cri.LinuxPodSandboxStatus(
                namespaces=cri.Namespace(
                    options=clone(sandbox.namespace_options) if sandbox.namespace_options else None
                )
            ),
            labels=dict(sandbox.labels),
            annotations=dict(sandbox.annotations),
            runtime_handler=sandbox.runtime_handler,
        )

    def container_status(self, container: Container) -> cri.ContainerStatus:
        return cri.ContainerStatus(
            id=container.id,
            metadata=cri.ContainerMetadata(name=container.name, attempt=container.attempt),
            state=container.state,
            created_at=container.created_at,
            started_at=container.started_at,
            finished_at=container.finished_at,
            exit_code=container.exit_code,
            image=cri.ImageSpec(image=container.image),
            image_ref=container.image_id,
            image_id=container.image_id,
            reason=container.reason,
            message=container.message,
            labels=dict(container.labels),
            annotations=dict(container.annotations),
            mounts=[clone(m) for m in container.mounts],
            log_path=container.log_path,
            resources=cri.ContainerResources(
                linux=clone(container.resources) if container.resources is not None else None
            ),
        )

    def container_message(self, container: Container) -> cri.Container:
        return cri.Container(
            id=container.id,
            pod_sandbox_id=container.pod_sandbox_id,
            metadata=cri.ContainerMetadata(name=container.name, attempt=container.attempt),
            image=cri.ImageSpec(image=container.image),
            image_ref=container.image_id,
            image_id=container.image_id,
            state=container.state,
            created_at=container.created_at,
            labels=dict(container.labels),
            annotations=dict(container.annotations),
        )

    @staticmethod
    def image_message(image: ImageRecord) -> cri.Image:
        return cri.Image(
            id=image.id,
            repo_tags=list(image.repo_tags),
            repo_digests=list(image.repo_digests),
            size=image.size,
        )

    def pod_containers(self, sandbox_id: str) -> list[Container]:
        return [self.containers[c] for c in self.pod_index.get(sandbox_id, ())]

    # -- records that change together --------------------------------------------------------

    def add_container(self, container: Container) -> None:
        """Keep a new *container*, last of its pod's."""
        self.containers[container.id] = container
        self.pod_index.setdefault(container.pod_sandbox_id, {})[container.id] = None

    def drop_container(self, container: Container) -> None:
        """Forget *container*: its record, its place in its pod's index and its reserved name."""
        del self.containers[container.id]
        del self.pod_index[container.pod_sandbox_id][container.id]
        self.reserved_names.pop(container.reserved_name, None)

    def drop_sandbox(self, sandbox: Sandbox) -> None:
        """Forget *sandbox* (its containers already gone): its record, its index and its reserved name."""
        del self.sandboxes[sandbox.id]
        self.pod_index.pop(sandbox.id, None)
        self.reserved_names.pop(sandbox.reserved_name, None)

    def next_ip(self) -> str:
        """The pod IP of the next sandbox that has a network of its own."""
        n = next(self._ip_counter)
        return f"10.88.{n // 250 % 256}.{n % 250 + 2}"

    def emit(self, subject_id: str, event_type: EventType, sandbox: Sandbox) -> None:
        """Queue a lifecycle event carrying the pod's status and its containers' statuses."""
        self.events.append(
            cri.ContainerEventResponse(
                container_id=subject_id,
                container_event_type=event_type,
                created_at=self.settings.clock(),
                pod_sandbox_status=self.sandbox_status(sandbox),
                containers_statuses=[self.container_status(c) for c in self.pod_containers(sandbox.id)],
            )
        )

    # -- encoded answers (RuntimeState.ENCODED_CALLS) -----------------------------------------
    #
    # Encodings of messages concatenate into the encoding of their merge, and betterproto2 writes
    # fields in number order: so each answer below is joined, byte for byte, from the encodings of
    # its parts (one per list item and per status), each kept on its record. Records never change
    # (a transition makes a new record, which starts with nothing kept), so nothing goes stale.

    def list_pod_sandbox_encoded(self, request: cri.ListPodSandboxRequest) -> bytes:
        """:meth:`RuntimeState.list_pod_sandbox`, encoded: the very same bytes."""
        return b"".join(
            self._sandbox_item_bytes(s) for s in self.unordered(self.select_sandboxes(request.filter))
        )

    def pod_sandbox_status_encoded(self, request: cri.PodSandboxStatusRequest) -> bytes:
        """:meth:`RuntimeState.pod_sandbox_status`, encoded: the very same bytes (fields: status 1,
        containers_statuses 3, timestamp 4)."""
        sandbox = self.find_sandbox(request.pod_sandbox_id)
        parts = [self._sandbox_status_bytes(sandbox)]
        if request.verbose:  # info (field 2), between status and containers_statuses
            info = self.verbose_sandbox(request, sandbox)
            parts.append(bytes(cri.PodSandboxStatusResponse(info=info).SerializeToString()))
        parts.extend(self._in_pod_status_bytes(c) for c in self.pod_containers(sandbox.id))
        parts.append(bytes(cri.PodSandboxStatusResponse(timestamp=self.settings.clock()).SerializeToString()))
        return b"".join(parts)

    def list_containers_encoded(self, request: cri.ListContainersRequest) -> bytes:
        """:meth:`ContainerCalls.list_containers`, encoded: the very same bytes."""
        return b"".join(
            self._container_item_bytes(c) for c in self.unordered(self.select_containers(request.filter))
        )

    def container_status_encoded(self, request: cri.ContainerStatusRequest) -> bytes:
        """:meth:`ContainerCalls.container_status`, encoded: the very same bytes."""
        container = self.find_container(request.container_id)
        status = self._container_status_bytes(container)
        if not request.verbose:
            return status
        info = self.verbose_container(request, container)
        return status + bytes(cri.ContainerStatusResponse(info=info).SerializeToString())

    def verbose_sandbox(self, request: cri.PodSandboxStatusRequest, sandbox: Sandbox) -> dict[str, str]:
        """The ``info`` of a PodSandboxStatus answer: containerd's document if *request* is verbose."""
        return sandbox_info(sandbox) if request.verbose else {}

    def verbose_container(self, request: cri.ContainerStatusRequest, container: Container) -> dict[str, str]:
        """The ``info`` of a ContainerStatus answer: containerd's document if *request* is verbose."""
        if not request.verbose:
            return {}
        return container_info(container, self.sandboxes.get(container.pod_sandbox_id))

    def _sandbox_item_bytes(self, sandbox: Sandbox) -> bytes:
        return encoded(
            sandbox.wire,
            "ListPodSandboxResponse.items",
            lambda: cri.ListPodSandboxResponse(items=[self.sandbox_message(sandbox)]),
        )

    def _sandbox_status_bytes(self, sandbox: Sandbox) -> bytes:
        return encoded(
            sandbox.wire,
            "PodSandboxStatusResponse.status",
            lambda: cri.PodSandboxStatusResponse(status=self.sandbox_status(sandbox)),
        )

    def _container_item_bytes(self, container: Container) -> bytes:
        return encoded(
            container.wire,
            "ListContainersResponse.containers",
            lambda: cri.ListContainersResponse(containers=[self.container_message(container)]),
        )

    def _in_pod_status_bytes(self, container: Container) -> bytes:
        return encoded(
            container.wire,
            "PodSandboxStatusResponse.containers_statuses",
            lambda: cri.PodSandboxStatusResponse(containers_statuses=[self.container_status(container)]),
        )

    def _container_status_bytes(self, container: Container) -> bytes:
        return encoded(
            container.wire,
            "ContainerStatusResponse.status",
            lambda: cri.ContainerStatusResponse(status=self.container_status(container)),
        )

    def prepare_answers(self, sandbox: Sandbox) -> None:
        """Encode, and keep on the records, every part of the encoded answers about *sandbox*."""
        self._sandbox_item_bytes(sandbox)
        self._sandbox_status_bytes(sandbox)
        for container in self.pod_containers(sandbox.id):
            self._container_item_bytes(container)
            self._in_pod_status_bytes(container)
            self._container_status_bytes(container)

    # -- selections ---------------------------------------------------------------------------

    def unordered(self, items: Iterable[_T]) -> list[_T]:
        """``items`` in an order of :attr:`Settings.order`'s choosing (see its docstring)."""
        shuffled = list(items)
        self.settings.order.shuffle(shuffled)
        return shuffled

    def select_sandboxes(self, flt: cri.PodSandboxFilter | None) -> Iterable[Sandbox]:
        sandboxes: Iterable[Sandbox] = self.sandboxes.values()
        if flt is not None:
            if flt.id:
                try:
                    sandboxes = [self.find_sandbox(flt.id)]
                except CriError:
                    sandboxes = []
            if flt.state is not None:
                sandboxes = [s for s in sandboxes if s.state == flt.state.state]
            if flt.label_selector:
                sandboxes = [s for s in sandboxes if matches(s.labels, flt.label_selector)]
        return sandboxes

    @staticmethod
    def sandbox_message(sandbox: Sandbox) -> cri.PodSandbox:
        return cri.PodSandbox(
            id=sandbox.id,
            metadata=cri.PodSandboxMetadata(
                name=sandbox.name, uid=sandbox.uid, namespace=sandbox.namespace, attempt=sandbox.attempt
            ),
            state=sandbox.state,
            created_at=sandbox.created_at,
            labels=dict(sandbox.labels),
            annotations=dict(sandbox.annotations),
            runtime_handler=sandbox.runtime_handler,
        )

    def reserve(self, name: str, owner: str, kind: str) -> None:
        holder = self.reserved_names.get(name)
        if holder is not None:
            raise CriError(
                self.settings.imitate.name_conflict,
                f'failed to reserve {kind} name "{name}": name "{name}" is reserved for "{holder}"',
            )
        self.reserved_names[name] = owner

    def select_containers(self, flt: cri.ContainerFilter | None) -> Iterable[Container]:
        containers: Iterable[Container] = self.containers.values()
        if flt is not None:
            if flt.id:
                try:
                    containers = [self.find_container(flt.id)]
                except CriError:
                    containers = []
            if flt.pod_sandbox_id:
                try:
                    pod_id = self.find_sandbox(flt.pod_sandbox_id).id
                except CriError:
                    pod_id = flt.pod_sandbox_id
                containers = [c for c in containers if c.pod_sandbox_id == pod_id]
            if flt.state is not None:
                containers = [c for c in containers if c.state == flt.state.state]
            if flt.label_selector:
                containers = [c for c in containers if matches(c.labels, flt.label_selector)]
        return containers

    def record_image(self, name: str) -> ImageRecord:
        image = image_record_for(name)
        known = self.images.get(image.id)
        if known is not None:
            return known
        self.images[image.id] = image
        return image
