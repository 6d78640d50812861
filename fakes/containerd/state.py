"""The fake runtime's brain: CRI pods, containers and images, without any I/O.

Rules of this module:

- Every state transition is made by a CRI call of :class:`RuntimeState` (the pod calls here, the
  container calls in :mod:`~krproxy.fakes.containerd.containers`), and the legal ones are data
  (``CONTAINER_TRANSITIONS`` and ``SANDBOX_TRANSITIONS`` in :mod:`krproxy.fakes.containerd.records`); a
  pair missing from a table is an invalid operation.
- :class:`RuntimeState` holds its parts, one module each, and extends none: the tables, the records
  and the lookups every call reads (:class:`~krproxy.fakes.containerd._tables.Tables`, over the records
  and rules of :mod:`~krproxy.fakes.containerd.records`), the container calls
  (:class:`~krproxy.fakes.containerd.containers.ContainerCalls`) and the image service
  (:class:`~krproxy.fakes.containerd.images.ImageCalls`), each given the tables and the one
  :class:`~krproxy.fakes.containerd.settings.Settings` they all share. This module adds the runtime
  and sandbox calls and :meth:`RuntimeState.seed`, and answers every CRI call by name.
- Methods named after CRI calls take the CRI request message and return the response message;
  they never await and never touch sockets. The service layer (:mod:`krproxy.fakes.containerd.server`)
  only moves messages between the wire and these methods.
- Failures raise :class:`CriError` carrying the gRPC status code containerd would answer with.
- Lifecycle events pile up in an outbox; whoever serves the runtime drains it with
  :meth:`RuntimeState.take_events` and hands the events to ``GetContainerEvents`` subscribers.
- Time and IDs come from injectable callables, so a test can make every answer deterministic.

Where containerd's behaviour is visible to kubelet or a proxy (status codes, idempotent removes,
forced stops, ID prefixes), this module copies it; see the notes on each method.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Mapping
from typing import ClassVar

import attrs

from krproxy.fakes.containerd._tables import Tables
from krproxy.fakes.containerd.containers import ContainerCalls
from krproxy.fakes.containerd.images import ImageCalls
from krproxy.fakes.containerd.records import (
    EXIT_CODE_KILLED,
    RUNTIME_API_VERSION,
    RUNTIME_NAME,
    SANDBOX_TRANSITIONS,
    Code,
    Container,
    ContainerState,
    CriError,
    EventType,
    ImageRecord,
    Op,
    Sandbox,
    SandboxState,
    clone,
    list_order,
    sequential_ids,
)
from krproxy.fakes.containerd.settings import Settings
from krproxy.fakes.containerd.versions import DEFAULT_VERSION, Imitation
from krproxy.proto.runtime import v1 as cri


class RuntimeState:
    """All pods, containers and images of one fake containerd.

    Its arguments are the fields of its :attr:`settings`
    (:class:`~krproxy.fakes.containerd.settings.Settings` says what each means); by default the clock
    is the wall clock, IDs are :func:`~krproxy.fakes.containerd.records.sequential_ids`, the list
    order is :func:`~krproxy.fakes.containerd.records.list_order` and the imitated version "1.6".

    Attributes:
        settings: the choices every part reads; a test may change one on the way (``settings.order``).
        tables: the records and the lookups, message builders and encoded answers that read them.
        container_calls: the container calls, which also stop and remove a pod's containers.
        image_calls: the image service.
    """

    #: The CRI methods (snake_case, as in the generated services) this class answers.
    CRI_CALLS: ClassVar[frozenset[str]] = frozenset(
        {
            "version",
            "status",
            "run_pod_sandbox",
            "stop_pod_sandbox",
            "remove_pod_sandbox",
            "pod_sandbox_status",
            "list_pod_sandbox",
            "create_container",
            "start_container",
            "stop_container",
            "remove_container",
            "list_containers",
            "container_status",
            "update_container_resources",
            "update_pod_sandbox_resources",
            "exec_sync",
            "container_stats",
            "list_container_stats",
            "pull_image",
            "list_images",
            "image_status",
            "remove_image",
            "image_fs_info",
        }
    )

    #: CRI methods that the service layer answers with ``<name>encoded``: the same reply, already
    #: encoded, mostly from bytes kept on the records. A proxy's store recovery lists everything and
    #: asks for every pod's and container's status at once; betterproto2 encoding (pure Python) would
    #: make the fake, not the proxy, the slow side. :meth:`seed` prepares these bytes up front.
    ENCODED_CALLS: ClassVar[frozenset[str]] = frozenset(
        {"list_pod_sandbox", "pod_sandbox_status", "list_containers", "container_status"}
    )

    def __init__(
        self,
        *,
        clock: Callable[[], int] = time.time_ns,
        new_id: Callable[[], str] | None = None,
        force_remove_running: bool = True,
        require_pulled_images: bool = False,
        order: random.Random | None = None,
        imitate: str | Imitation = DEFAULT_VERSION,
        pod_resize: bool | None = None,
    ) -> None:
        self.settings = Settings(
            clock=clock,
            new_id=sequential_ids() if new_id is None else new_id,
            force_remove_running=force_remove_running,
            require_pulled_images=require_pulled_images,
            order=list_order() if order is None else order,
            imitate=imitate,
            pod_resize=pod_resize,
        )
        self.tables = Tables(self.settings)
        self.container_calls = ContainerCalls(self.tables, self.settings)
        self.image_calls = ImageCalls(self.tables, self.settings)
        # The parts' CRI calls (and test helpers), answered as this state's own: the server finds a
        # call by its name here (CRI_CALLS, ENCODED_CALLS), and tests drive the state the same way.
        containers, images, tables = self.container_calls, self.image_calls, self.tables
        self.create_container = containers.create_container
        self.start_container = containers.start_container
        self.stop_container = containers.stop_container
        self.remove_container = containers.remove_container
        self.list_containers = containers.list_containers
        self.container_status = containers.container_status
        self.update_container_resources = containers.update_container_resources
        self.exec_sync = containers.exec_sync
        self.container_stats = containers.container_stats
        self.list_container_stats = containers.list_container_stats
        self.exit_container = containers.exit_container
        self.pull_image = images.pull_image
        self.list_images = images.list_images
        self.image_status = images.image_status
        self.remove_image = images.remove_image
        self.image_fs_info = images.image_fs_info
        self.list_pod_sandbox_encoded = tables.list_pod_sandbox_encoded
        self.pod_sandbox_status_encoded = tables.pod_sandbox_status_encoded
        self.list_containers_encoded = tables.list_containers_encoded
        self.container_status_encoded = tables.container_status_encoded
        self.take_events = tables.take_events
        self.script_exec = tables.script_exec

    # -- read-only views for tests ------------------------------------------------------------

    @property
    def sandboxes(self) -> Mapping[str, Sandbox]:
        """Live sandboxes by ID, in creation order."""
        return dict(self.tables.sandboxes)

    @property
    def containers(self) -> Mapping[str, Container]:
        """Live containers by ID, in creation order."""
        return dict(self.tables.containers)

    @property
    def images(self) -> Mapping[str, ImageRecord]:
        """Pulled images by ID."""
        return dict(self.tables.images)

    # -- runtime ------------------------------------------------------------------------------

    def version(self, request: cri.VersionRequest) -> cri.VersionResponse:
        """Name and versions, as the imitated containerd reports them (with a ``-fake`` suffix)."""
        return cri.VersionResponse(
            version="0.1.0",
            runtime_name=RUNTIME_NAME,
            runtime_version=self.settings.imitate.runtime_version,
            runtime_api_version=RUNTIME_API_VERSION,
        )

    def status(self, request: cri.StatusRequest) -> cri.StatusResponse:
        """The runtime and its network are always ready."""
        return cri.StatusResponse(
            status=cri.RuntimeStatus(
                conditions=[
                    cri.RuntimeCondition(type="RuntimeReady", status=True),
                    cri.RuntimeCondition(type="NetworkReady", status=True),
                ]
            )
        )

    # -- sandboxes ----------------------------------------------------------------------------

    def run_pod_sandbox(self, request: cri.RunPodSandboxRequest) -> cri.RunPodSandboxResponse:
        """Create a READY sandbox; emits CREATED and STARTED events with the sandbox ID.

        A second sandbox with the same name/namespace/uid/attempt is refused (UNKNOWN on containerd 1.6
        and 1.7, FAILED_PRECONDITION on 2.x), since containerd reserves that name until the first one is
        removed.
        """
        config = request.config or cri.PodSandboxConfig()
        metadata = config.metadata or cri.PodSandboxMetadata()
        if not metadata.name:
            raise CriError(Code.UNKNOWN, "sandbox config must include metadata")
        options = None
        if config.linux and config.linux.security_context and config.linux.security_context.namespace_options:
            options = clone(config.linux.security_context.namespace_options)
        host_network = options is not None and options.network == cri.NamespaceMode.NODE
        sandbox = Sandbox(
            id=self.settings.new_id(),
            name=metadata.name,
            uid=metadata.uid,
            namespace=metadata.namespace,
            attempt=metadata.attempt,
            state=SandboxState.SANDBOX_READY,
            created_at=self.settings.clock(),
            labels=dict(config.labels),
            annotations=dict(config.annotations),
            runtime_handler=request.runtime_handler,
            ip="" if host_network else self.tables.next_ip(),
            namespace_options=options,
            config=clone(config),
        )
        self.tables.reserve(sandbox.reserved_name, sandbox.id, "sandbox")
        self.tables.sandboxes[sandbox.id] = sandbox
        self.tables.emit(sandbox.id, EventType.CONTAINER_CREATED_EVENT, sandbox)
        self.tables.emit(sandbox.id, EventType.CONTAINER_STARTED_EVENT, sandbox)
        return cri.RunPodSandboxResponse(pod_sandbox_id=sandbox.id)

    def stop_pod_sandbox(self, request: cri.StopPodSandboxRequest) -> cri.StopPodSandboxResponse:
        """Kill the pod's running containers (exit 137) and mark the sandbox NOTREADY.

        Unknown IDs are NOT_FOUND on containerd 1.6 (it looks the sandbox up first and wraps the store's
        not-found error) and OK from 1.7 on (CRI's idempotent stop). Stopping a NOTREADY sandbox again
        succeeds and changes nothing.
        """
        try:
            sandbox = self.tables.find_sandbox(request.pod_sandbox_id)
        except CriError as err:
            if err.code == Code.NOT_FOUND and self.settings.imitate.stop_unknown_ok:
                return cri.StopPodSandboxResponse()
            raise
        for container in self.tables.pod_containers(sandbox.id):
            self.container_calls.stop(container, exit_code=EXIT_CODE_KILLED)
        was_ready = sandbox.state == SandboxState.SANDBOX_READY
        sandbox = attrs.evolve(sandbox, state=SANDBOX_TRANSITIONS[(sandbox.state, Op.STOP)])
        self.tables.sandboxes[sandbox.id] = sandbox
        if was_ready:
            self.tables.emit(sandbox.id, EventType.CONTAINER_STOPPED_EVENT, sandbox)
        return cri.StopPodSandboxResponse()

    def remove_pod_sandbox(self, request: cri.RemovePodSandboxRequest) -> cri.RemovePodSandboxResponse:
        """Stop the sandbox if needed, remove its containers, then the sandbox itself.

        Removing an unknown ID succeeds: containerd treats a missing sandbox as already removed (an
        empty ID or an ambiguous prefix is refused, as by every lookup).
        """
        try:
            sandbox = self.tables.find_sandbox(request.pod_sandbox_id)
        except CriError as err:
            if err.code != Code.NOT_FOUND:
                raise
            return cri.RemovePodSandboxResponse()
        self.stop_pod_sandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sandbox.id))
        sandbox = self.tables.sandboxes[sandbox.id]
        for container in self.tables.pod_containers(sandbox.id):
            self.container_calls.remove(container)
        self.tables.drop_sandbox(sandbox)
        self.tables.emit(sandbox.id, EventType.CONTAINER_DELETED_EVENT, sandbox)
        return cri.RemovePodSandboxResponse()

    def pod_sandbox_status(self, request: cri.PodSandboxStatusRequest) -> cri.PodSandboxStatusResponse:
        """The sandbox's status plus its containers' statuses; unknown IDs are NOT_FOUND."""
        sandbox = self.tables.find_sandbox(request.pod_sandbox_id)
        return cri.PodSandboxStatusResponse(
            status=self.tables.sandbox_status(sandbox),
            info=self.tables.verbose_sandbox(request, sandbox),
            containers_statuses=[
                self.tables.container_status(c) for c in self.tables.pod_containers(sandbox.id)
            ],
            timestamp=self.settings.clock(),
        )

    def list_pod_sandbox(self, request: cri.ListPodSandboxRequest) -> cri.ListPodSandboxResponse:
        """Sandboxes matching every given filter (ID or ID prefix, state, labels)."""
        return cri.ListPodSandboxResponse(
            items=[
                self.tables.sandbox_message(s)
                for s in self.tables.unordered(self.tables.select_sandboxes(request.filter))
            ]
        )

    def update_pod_sandbox_resources(
        self, request: cri.UpdatePodSandboxResourcesRequest
    ) -> cri.UpdatePodSandboxResourcesResponse:
        """Record the pod's new overhead and resources (pod-level resize, KEP-5419), as containerd 2.3 does.

        containerd 2.3 looks the sandbox up (unknown: NOT_FOUND), in any state, and keeps both messages as
        sent, replacing the previous ones (absent ones become absent); it writes no cgroup (kubelet does).
        Where the CRI server lacks the method (containerd 1.6 to 2.1, or :attr:`Settings.pod_resize`
        false) the answer is grpc-go's for a method it does not know: UNIMPLEMENTED.
        """
        if not self.settings.answers_pod_resize:
            raise CriError(
                Code.UNIMPLEMENTED,
                "unknown method UpdatePodSandboxResources for service runtime.v1.RuntimeService",
            )
        sandbox = self.tables.find_sandbox(request.pod_sandbox_id)
        self.tables.sandboxes[sandbox.id] = attrs.evolve(
            sandbox,
            overhead=clone(request.overhead) if request.overhead is not None else None,
            resources=clone(request.resources) if request.resources is not None else None,
        )
        return cri.UpdatePodSandboxResourcesResponse()

    # -- bulk seeding -------------------------------------------------------------------------

    def seed(
        self,
        pods: int,
        containers_per_pod: int = 1,
        *,
        image: str = "docker.io/library/nginx:1.25",
        namespace: str = "default",
    ) -> list[str]:
        """Add ``pods`` READY sandboxes, each with ``containers_per_pod`` RUNNING containers.

        Every container carries 6 labels and 6 annotations shaped like kubelet's, so a
        ListContainers of 1000 seeded containers is about 860 KB on the wire. No events are
        emitted. Returns the new container IDs in creation order.

        The encoded list items and status answers of the new records are prepared here (see
        :data:`ENCODED_CALLS`): seeding is the set-up of a large-scale run, whose measured part
        should then cost the fake no more than the grpc exchange itself.
        """
        image_id = self.tables.record_image(image).id
        created: list[str] = []
        for p in range(len(self.tables.sandboxes), len(self.tables.sandboxes) + pods):
            pod_name = f"seed-pod-{p:05d}"
            uid = hashlib.sha256(pod_name.encode()).hexdigest()
            pod_uid = f"{uid[:8]}-{uid[8:12]}-{uid[12:16]}-{uid[16:20]}-{uid[20:32]}"
            pod_labels = {
                "io.kubernetes.pod.name": pod_name,
                "io.kubernetes.pod.namespace": namespace,
                "io.kubernetes.pod.uid": pod_uid,
            }
            now = self.settings.clock()
            sandbox = Sandbox(
                id=self.settings.new_id(),
                name=pod_name,
                uid=pod_uid,
                namespace=namespace,
                attempt=0,
                state=SandboxState.SANDBOX_READY,
                created_at=now,
                labels={**pod_labels, "app": f"seed-app-{p % 50:02d}"},
                annotations={"kubernetes.io/config.source": "api", "kubernetes.io/config.seen": "2024"},
                ip=self.tables.next_ip(),
            )
            self.tables.sandboxes[sandbox.id] = sandbox
            self.tables.reserved_names[sandbox.reserved_name] = sandbox.id
            for c in range(containers_per_pod):
                name = f"app-{c}"
                container = Container(
                    id=self.settings.new_id(),
                    pod_sandbox_id=sandbox.id,
                    name=name,
                    attempt=0,
                    image=image,
                    image_id=image_id,
                    state=ContainerState.CONTAINER_RUNNING,
                    created_at=now,
                    started_at=now,
                    reserved_name=f"{name}_{pod_name}_{namespace}_{pod_uid}_0",
                    labels={
                        **pod_labels,
                        "io.kubernetes.container.name": name,
                        "app": f"seed-app-{p % 50:02d}",
                        "tier": "backend",
                    },
                    annotations={
                        "io.kubernetes.container.hash": f"{int(uid[:8], 16):08x}",
                        "io.kubernetes.container.restartCount": "0",
                        "io.kubernetes.container.terminationMessagePath": "/dev/termination-log",
                        "io.kubernetes.container.terminationMessagePolicy": "File",
                        "io.kubernetes.pod.terminationGracePeriod": "30",
                        "kubectl.kubernetes.io/default-container": name,
                    },
                    log_path=f"{name}/0.log",
                    resources=cri.LinuxContainerResources(
                        cpu_period=100_000, cpu_quota=50_000, cpu_shares=512, memory_limit_in_bytes=256 << 20
                    ),
                )
                self.tables.add_container(container)
                self.tables.reserved_names[container.reserved_name] = container.id
                created.append(container.id)
            self.tables.prepare_answers(sandbox)
        return created
