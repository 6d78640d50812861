"""The fake runtime's brain: CRI pods, containers and images, without any I/O.

Rules of this module:

- Every state transition lives in :class:`RuntimeState`, and the legal ones are data
  (``CONTAINER_TRANSITIONS`` and ``SANDBOX_TRANSITIONS`` in :mod:`krproxy.fakes.containerd.records`); a
  pair missing from a table is an invalid operation.
- :class:`RuntimeState` is made of parts, one module each: the records and rules
  (:mod:`~krproxy.fakes.containerd.records`), the tables and the helpers every call reads
  (:mod:`~krproxy.fakes.containerd._tables`), the container calls (:mod:`~krproxy.fakes.containerd.containers`),
  the image service (:mod:`~krproxy.fakes.containerd.images`); this module adds the runtime and sandbox
  calls and :meth:`RuntimeState.seed`.
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
    Op,
    Sandbox,
    SandboxState,
    clone,
)
from krproxy.proto.runtime import v1 as cri


@attrs.define(eq=False)
class RuntimeState(ContainerCalls, ImageCalls, Tables):
    """All pods, containers and images of one fake containerd.

    Attributes:
        clock: returns the current time in nanoseconds since the epoch.
        new_id: returns a fresh 64-hex ID for each sandbox and container.
        force_remove_running: RemoveContainer on a RUNNING container kills it first (containerd's
            behaviour). When false it is refused with UNKNOWN "container is still running, to stop
            first", the message containerd's own guard would give.
        require_pulled_images: when true, CreateContainer of an image nobody pulled is NOT_FOUND
            (like containerd); by default the image is recorded on the fly, so tests need no pulls.
        order: shuffles every list answer (ListPodSandbox, ListContainers, ListContainerStats,
            ListImages) anew on each call: containerd's lists come from maps and their order
            changes from call to call, so nobody may rely on one. Seeded by
            :func:`list_order`, or pass ``random.Random(seed)``.
        imitate: the containerd version imitated where versions differ (:mod:`krproxy.fakes.containerd.versions`):
            "1.6" (the default), "1.7", "2.1" ("2.x") or "2.3", or an :class:`Imitation`.
        pod_resize: answer UpdatePodSandboxResources as containerd 2.3 does (true), or with UNIMPLEMENTED
            "unknown method ..." as containerd 1.6 to 2.1, whose CRI server lacks it (false); None (the
            default): as the imitated version does.
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

    def version(self, request: cri.VersionRequest) -> cri.VersionResponse:
        """Name and versions, as the imitated containerd reports them (with a ``-fake`` suffix)."""
        return cri.VersionResponse(
            version="0.1.0",
            runtime_name=RUNTIME_NAME,
            runtime_version=self.imitate.runtime_version,
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
            id=self.new_id(),
            name=metadata.name,
            uid=metadata.uid,
            namespace=metadata.namespace,
            attempt=metadata.attempt,
            state=SandboxState.SANDBOX_READY,
            created_at=self.clock(),
            labels=dict(config.labels),
            annotations=dict(config.annotations),
            runtime_handler=request.runtime_handler,
            ip="" if host_network else self._next_ip(),
            namespace_options=options,
            config=clone(config),
        )
        self._reserve(sandbox.reserved_name, sandbox.id, "sandbox")
        self._sandboxes[sandbox.id] = sandbox
        self._emit(sandbox.id, EventType.CONTAINER_CREATED_EVENT, sandbox)
        self._emit(sandbox.id, EventType.CONTAINER_STARTED_EVENT, sandbox)
        return cri.RunPodSandboxResponse(pod_sandbox_id=sandbox.id)

    def _next_ip(self) -> str:
        n = next(self._ip_counter)
        return f"10.88.{n // 250 % 256}.{n % 250 + 2}"

    def stop_pod_sandbox(self, request: cri.StopPodSandboxRequest) -> cri.StopPodSandboxResponse:
        """Kill the pod's running containers (exit 137) and mark the sandbox NOTREADY.

        Unknown IDs are NOT_FOUND on containerd 1.6 (it looks the sandbox up first and wraps the store's
        not-found error) and OK from 1.7 on (CRI's idempotent stop). Stopping a NOTREADY sandbox again
        succeeds and changes nothing.
        """
        try:
            sandbox = self._find_sandbox(request.pod_sandbox_id)
        except CriError as err:
            if err.code == Code.NOT_FOUND and self.imitate.stop_unknown_ok:
                return cri.StopPodSandboxResponse()
            raise
        for container in self._pod_containers(sandbox.id):
            self._stop(container, exit_code=EXIT_CODE_KILLED)
        was_ready = sandbox.state == SandboxState.SANDBOX_READY
        sandbox = attrs.evolve(sandbox, state=SANDBOX_TRANSITIONS[(sandbox.state, Op.STOP)])
        self._sandboxes[sandbox.id] = sandbox
        if was_ready:
            self._emit(sandbox.id, EventType.CONTAINER_STOPPED_EVENT, sandbox)
        return cri.StopPodSandboxResponse()

    def remove_pod_sandbox(self, request: cri.RemovePodSandboxRequest) -> cri.RemovePodSandboxResponse:
        """Stop the sandbox if needed, remove its containers, then the sandbox itself.

        Removing an unknown ID succeeds: containerd treats a missing sandbox as already removed (an
        empty ID or an ambiguous prefix is refused, as by every lookup).
        """
        try:
            sandbox = self._find_sandbox(request.pod_sandbox_id)
        except CriError as err:
            if err.code != Code.NOT_FOUND:
                raise
            return cri.RemovePodSandboxResponse()
        self.stop_pod_sandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sandbox.id))
        sandbox = self._sandboxes[sandbox.id]
        for container in self._pod_containers(sandbox.id):
            self._remove(container)
        del self._sandboxes[sandbox.id]
        self._pod_index.pop(sandbox.id, None)
        self._reserved_names.pop(sandbox.reserved_name, None)
        self._emit(sandbox.id, EventType.CONTAINER_DELETED_EVENT, sandbox)
        return cri.RemovePodSandboxResponse()

    def pod_sandbox_status(self, request: cri.PodSandboxStatusRequest) -> cri.PodSandboxStatusResponse:
        """The sandbox's status plus its containers' statuses; unknown IDs are NOT_FOUND."""
        sandbox = self._find_sandbox(request.pod_sandbox_id)
        return cri.PodSandboxStatusResponse(
            status=self._sandbox_status(sandbox),
            info=self._verbose_sandbox(request, sandbox),
            containers_statuses=[self._container_status(c) for c in self._pod_containers(sandbox.id)],
            timestamp=self.clock(),
        )

    def list_pod_sandbox(self, request: cri.ListPodSandboxRequest) -> cri.ListPodSandboxResponse:
        """Sandboxes matching every given filter (ID or ID prefix, state, labels)."""
        return cri.ListPodSandboxResponse(
            items=[self._sandbox_message(s) for s in self._unordered(self._select_sandboxes(request.filter))]
        )

    # -- containers ---------------------------------------------------------------------------

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
        image_id = self._record_image(image).id
        created: list[str] = []
        for p in range(len(self._sandboxes), len(self._sandboxes) + pods):
            pod_name = f"seed-pod-{p:05d}"
            uid = hashlib.sha256(pod_name.encode()).hexdigest()
            pod_uid = f"{uid[:8]}-{uid[8:12]}-{uid[12:16]}-{uid[16:20]}-{uid[20:32]}"
            pod_labels = {
                "io.kubernetes.pod.name": pod_name,
                "io.kubernetes.pod.namespace": namespace,
                "io.kubernetes.pod.uid": pod_uid,
            }
            now = self.clock()
            sandbox = Sandbox(
                id=self.new_id(),
                name=pod_name,
                uid=pod_uid,
                namespace=namespace,
                attempt=0,
                state=SandboxState.SANDBOX_READY,
                created_at=now,
                labels={**pod_labels, "app": f"seed-app-{p % 50:02d}"},
                annotations={"kubernetes.io/config.source": "api", "kubernetes.io/config.seen": "2024"},
                ip=self._next_ip(),
            )
            self._sandboxes[sandbox.id] = sandbox
            self._reserved_names[sandbox.reserved_name] = sandbox.id
            for c in range(containers_per_pod):
                name = f"app-{c}"
                container = Container(
                    id=self.new_id(),
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
                self._add_container(container)
                self._reserved_names[container.reserved_name] = container.id
                created.append(container.id)
            self._prepare_answers(sandbox)
        return created
