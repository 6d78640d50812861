"""The fake runtime's brain: CRI pods, containers and images, without any I/O.

Rules of this module:

- Every state transition lives here, and the legal ones are data (``CONTAINER_TRANSITIONS`` and
  ``SANDBOX_TRANSITIONS``); a pair missing from a table is an invalid operation.
- Methods named after CRI calls take the CRI request message and return the response message;
  they never await and never touch sockets. The service layer (:mod:`fakes.containerd.server`)
  only moves messages between the wire and these methods.
- Failures raise :class:`CriError` carrying the gRPC status code containerd would answer with.
- Lifecycle events pile up in an outbox; whoever serves the runtime drains it with
  :meth:`RuntimeState.take_events` and hands the events to ``GetContainerEvents`` subscribers.
- Time and IDs come from injectable callables, so a test can make every answer deterministic.

Where containerd's behaviour is visible to kubelet or a proxy (status codes, idempotent removes,
forced stops, ID prefixes), this module copies it; see the notes on each method.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import os
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import ClassVar, TypeVar

import attrs
import betterproto2

from krproxy.proto.runtime import v1 as cri

#: What the fake calls itself in ``Version``; kubelet only logs it, proxies may show it.
RUNTIME_NAME = "containerd"
RUNTIME_VERSION = "v1.6.20-fake"
RUNTIME_API_VERSION = "v1"

#: Exit code of a container killed by SIGKILL (128 + 9): what a forced stop leaves behind.
EXIT_CODE_KILLED = 137

#: Where containerd's overlayfs snapshotter keeps image layers; ImageFsInfo reports it.
IMAGE_FS_MOUNTPOINT = "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs"

_M = TypeVar("_M", bound=betterproto2.Message)
_R = TypeVar("_R", "Sandbox", "Container")
_T = TypeVar("_T")

ContainerState = cri.ContainerState
SandboxState = cri.PodSandboxState
EventType = cri.ContainerEventType


class Code(enum.IntEnum):
    """The gRPC status codes the fake answers with (values are gRPC's)."""

    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    FAILED_PRECONDITION = 9
    UNIMPLEMENTED = 12


class CriError(Exception):
    """A CRI call failed; ``code`` is the gRPC status the runtime would send."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Op(enum.Enum):
    """Things that can happen to a container or a sandbox."""

    START = "start"
    #: A graceful or forced stop requested through the CRI.
    STOP = "stop"
    #: The container's process ended on its own (crash, completion).
    EXIT = "exit"
    REMOVE = "remove"


#: (state, operation) -> state afterwards. A missing pair is refused. Stopping a container that is
#: not running is a no-op in containerd (it logs and returns success), hence the self-loops.
CONTAINER_TRANSITIONS: Mapping[tuple[ContainerState, Op], ContainerState] = {
    (ContainerState.CONTAINER_CREATED, Op.START): ContainerState.CONTAINER_RUNNING,
    (ContainerState.CONTAINER_CREATED, Op.STOP): ContainerState.CONTAINER_CREATED,
    (ContainerState.CONTAINER_RUNNING, Op.STOP): ContainerState.CONTAINER_EXITED,
    (ContainerState.CONTAINER_RUNNING, Op.EXIT): ContainerState.CONTAINER_EXITED,
    (ContainerState.CONTAINER_EXITED, Op.STOP): ContainerState.CONTAINER_EXITED,
}

#: Sandboxes only go READY -> NOTREADY; stopping twice is fine, removing works in both states.
SANDBOX_TRANSITIONS: Mapping[tuple[SandboxState, Op], SandboxState] = {
    (SandboxState.SANDBOX_READY, Op.STOP): SandboxState.SANDBOX_NOTREADY,
    (SandboxState.SANDBOX_NOTREADY, Op.STOP): SandboxState.SANDBOX_NOTREADY,
}


def sequential_ids(namespace: str = "fake-containerd") -> Callable[[], str]:
    """An ID generator yielding 64-hex strings (like containerd's), the same sequence every run."""
    counter = itertools.count(1)

    def new_id() -> str:
        return hashlib.sha256(f"{namespace}/{next(counter)}".encode()).hexdigest()

    return new_id


def stepping_clock(start: int = 1_700_000_000_000_000_000, step: int = 1_000_000) -> Callable[[], int]:
    """A clock for tests: nanoseconds since the epoch, advancing by ``step`` on every reading."""
    counter = itertools.count()

    def now() -> int:
        return start + step * next(counter)

    return now


#: Environment variable that seeds :func:`list_order` (set it to repeat a run's list orders).
LIST_SEED_ENV = "FAKE_CONTAINERD_LIST_SEED"


def list_order() -> random.Random:
    """The default order of a fake's list answers: seeded from ``$FAKE_CONTAINERD_LIST_SEED`` when it
    is set (the tests' conftest sets and prints it), at random otherwise."""
    seed = os.environ.get(LIST_SEED_ENV)
    return random.Random(int(seed) if seed else None)


def normalize_image_name(name: str) -> str:
    """Expand a short image reference the way containerd does (``busybox`` ->
    ``docker.io/library/busybox:latest``). References already naming a registry are kept."""
    if name.startswith("sha256:"):
        return name
    first, sep, _rest = name.partition("/")
    if not sep:
        name = f"docker.io/library/{name}"
    elif not ("." in first or ":" in first or first == "localhost"):
        name = f"docker.io/{name}"
    last = name.rsplit("/", 1)[-1]
    if "@" not in name and ":" not in last:
        name = f"{name}:latest"
    return name


def _clone(message: _M) -> _M:
    """A deep copy of a message, so callers cannot alias the fake's state."""
    return type(message).FromString(message.SerializeToString())


def _encoded(cache: dict[str, bytes], key: str, build: Callable[[], betterproto2.Message]) -> bytes:
    """``cache[key]``, or the encoding of ``build()`` stored there first."""
    data = cache.get(key)
    if data is None:
        data = cache[key] = bytes(build().SerializeToString())
    return data


def _matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


@attrs.frozen
class ExecResult:
    """What ``ExecSync`` answers for a scripted command."""

    exit_code: int = 0
    stdout: bytes = b""
    stderr: bytes = b""


@attrs.frozen
class Sandbox:
    """A pod sandbox as the fake remembers it. Strictly read-only: transitions make new records."""

    id: str
    name: str
    uid: str
    namespace: str
    attempt: int
    state: SandboxState
    created_at: int
    labels: dict[str, str] = attrs.field(hash=False)
    annotations: dict[str, str] = attrs.field(hash=False)
    runtime_handler: str = ""
    ip: str = ""
    namespace_options: cri.NamespaceOption | None = attrs.field(default=None, hash=False)
    #: What the last UpdatePodSandboxResources set (containerd 2.3 keeps both in the sandbox's status and
    #: its ``updated-resources`` extension); None until then.
    overhead: cri.LinuxContainerResources | None = attrs.field(default=None, hash=False)
    resources: cri.LinuxContainerResources | None = attrs.field(default=None, hash=False)
    #: Encoded parts of answers about this record (see ``RuntimeState.ENCODED_CALLS``); kept until the
    #: record is replaced, so a new record starts empty.
    wire: dict[str, bytes] = attrs.field(init=False, factory=dict, eq=False, hash=False, repr=False)

    @property
    def reserved_name(self) -> str:
        """The name containerd reserves for the sandbox (unique among live sandboxes)."""
        return f"{self.name}_{self.namespace}_{self.uid}_{self.attempt}"


@attrs.frozen
class Container:
    """A container as the fake remembers it. Strictly read-only: transitions make new records."""

    id: str
    pod_sandbox_id: str
    name: str
    attempt: int
    image: str
    image_id: str
    state: ContainerState
    created_at: int
    reserved_name: str
    labels: dict[str, str] = attrs.field(hash=False)
    annotations: dict[str, str] = attrs.field(hash=False)
    started_at: int = 0
    finished_at: int = 0
    exit_code: int = 0
    reason: str = ""
    message: str = ""
    log_path: str = ""
    #: The LinuxContainerResources given at create time or by the last update, echoed by status.
    resources: cri.LinuxContainerResources | None = attrs.field(default=None, hash=False)
    mounts: tuple[cri.Mount, ...] = attrs.field(default=(), hash=False)
    #: Encoded parts of answers about this record (see ``RuntimeState.ENCODED_CALLS``); kept until the
    #: record is replaced, so a new record starts empty.
    wire: dict[str, bytes] = attrs.field(init=False, factory=dict, eq=False, hash=False, repr=False)


@attrs.frozen
class ImageRecord:
    """A pulled image: one ID, the names it was pulled under, and a made-up size."""

    id: str
    repo_tags: tuple[str, ...]
    repo_digests: tuple[str, ...]
    size: int


def image_record_for(name: str) -> ImageRecord:
    """The image a pull of ``name`` yields: ID, digest and size all derived from the name."""
    ref = normalize_image_name(name)
    digest = hashlib.sha256(ref.encode()).hexdigest()
    repo = ref.rsplit("@", 1)[0]
    last = repo.rsplit("/", 1)[-1]
    if ":" in last:
        repo = repo.rsplit(":", 1)[0]
    tags = () if "@" in ref else (ref,)
    return ImageRecord(
        id=f"sha256:{digest}",
        repo_tags=tags,
        repo_digests=(f"{repo}@sha256:{hashlib.sha256(('digest/' + ref).encode()).hexdigest()}",),
        size=1_000_000 + int(digest[:5], 16),
    )


def _sandbox_not_found(sandbox_id: str) -> CriError:
    return CriError(Code.NOT_FOUND, f'an error occurred when try to find sandbox "{sandbox_id}": not found')


def _container_not_found(container_id: str) -> CriError:
    return CriError(
        Code.NOT_FOUND, f'an error occurred when try to find container "{container_id}": not found'
    )


def _state_name(state: ContainerState) -> str:
    return state.name or str(int(state))


@attrs.define(eq=False)
class RuntimeState:
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
        pod_resize: answer UpdatePodSandboxResources as containerd 2.3 does (true, the default), or with
            UNIMPLEMENTED "unknown method ..." as containerd 1.6 to 2.1, whose CRI server lacks it (false).
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

    #: CRI methods that the service layer answers with ``<name>_encoded``: the same reply, already
    #: encoded, mostly from bytes kept on the records. A proxy's store recovery lists everything and
    #: asks for every pod's and container's status at once; betterproto2 encoding (pure Python) would
    #: make the fake, not the proxy, the slow side. :meth:`seed` prepares these bytes up front.
    ENCODED_CALLS: ClassVar[frozenset[str]] = frozenset(
        {"list_pod_sandbox", "pod_sandbox_status", "list_containers", "container_status"}
    )

    clock: Callable[[], int] = time.time_ns
    new_id: Callable[[], str] = attrs.Factory(sequential_ids)
    force_remove_running: bool = True
    require_pulled_images: bool = False
    order: random.Random = attrs.Factory(list_order)
    pod_resize: bool = True
    _sandboxes: dict[str, Sandbox] = attrs.field(init=False, factory=dict)
    _containers: dict[str, Container] = attrs.field(init=False, factory=dict)
    #: Sandbox ID -> the IDs of its containers, in creation order (the keys; values unused).
    _pod_index: dict[str, dict[str, None]] = attrs.field(init=False, factory=dict)
    _images: dict[str, ImageRecord] = attrs.field(init=False, factory=dict)
    _exec_scripts: dict[tuple[str, ...], ExecResult] = attrs.field(init=False, factory=dict)
    _events: list[cri.ContainerEventResponse] = attrs.field(init=False, factory=list)
    #: containerd's name index: "name_pod_namespace_uid_attempt" -> owner ID, unique while alive.
    _reserved_names: dict[str, str] = attrs.field(init=False, factory=dict)
    _ip_counter: itertools.count[int] = attrs.field(init=False, factory=lambda: itertools.count(2))

    # -- read-only views for tests ------------------------------------------------------------

    @property
    def sandboxes(self) -> Mapping[str, Sandbox]:
        """Live sandboxes by ID, in creation order."""
        return dict(self._sandboxes)

    @property
    def containers(self) -> Mapping[str, Container]:
        """Live containers by ID, in creation order."""
        return dict(self._containers)

    @property
    def images(self) -> Mapping[str, ImageRecord]:
        """Pulled images by ID."""
        return dict(self._images)

    def take_events(self) -> list[cri.ContainerEventResponse]:
        """Return the lifecycle events produced since the last call, oldest first, and forget them."""
        events, self._events = self._events, []
        return events

    def script_exec(self, cmd: Sequence[str], result: ExecResult) -> None:
        """Make ``ExecSync`` of exactly ``cmd`` (in any container) answer ``result``."""
        self._exec_scripts[tuple(cmd)] = result

    # -- lookups ------------------------------------------------------------------------------

    def _find_sandbox(self, sandbox_id: str) -> Sandbox:
        """Find a sandbox by full ID or unique ID prefix (containerd's store accepts both)."""
        return self._find(self._sandboxes, sandbox_id, _sandbox_not_found)

    def _find_container(self, container_id: str) -> Container:
        """Find a container by full ID or unique ID prefix."""
        return self._find(self._containers, container_id, _container_not_found)

    @staticmethod
    def _find(table: Mapping[str, _R], key: str, not_found: Callable[[str], CriError]) -> _R:
        record = table.get(key)
        if record is not None:
            return record
        candidates = [v for k, v in table.items() if k.startswith(key)] if key else []
        if len(candidates) != 1:
            raise not_found(key)
        return candidates[0]

    def _resolve_image(self, name: str) -> ImageRecord | None:
        """Find a pulled image by name (short or full), repo digest, ID or bare ID hex."""
        if not name:
            return None
        if name in self._images:
            return self._images[name]
        if f"sha256:{name}" in self._images:
            return self._images[f"sha256:{name}"]
        ref = normalize_image_name(name)
        for image in self._images.values():
            if ref in image.repo_tags or name in image.repo_digests:
                return image
        return None

    # -- message builders ---------------------------------------------------------------------

    def _sandbox_status(self, sandbox: Sandbox) -> cri.PodSandboxStatus:
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
                    options=_clone(sandbox.namespace_options) if sandbox.namespace_options else None
                )
            ),
            labels=dict(sandbox.labels),
            annotations=dict(sandbox.annotations),
            runtime_handler=sandbox.runtime_handler,
        )

    def _container_status(self, container: Container) -> cri.ContainerStatus:
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
            mounts=[_clone(m) for m in container.mounts],
            log_path=container.log_path,
            resources=cri.ContainerResources(
                linux=_clone(container.resources) if container.resources is not None else None
            ),
        )

    def _container_message(self, container: Container) -> cri.Container:
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
    def _image_message(image: ImageRecord) -> cri.Image:
        return cri.Image(
            id=image.id,
            repo_tags=list(image.repo_tags),
            repo_digests=list(image.repo_digests),
            size=image.size,
        )

    def _pod_containers(self, sandbox_id: str) -> list[Container]:
        return [self._containers[c] for c in self._pod_index.get(sandbox_id, ())]

    def _add_container(self, container: Container) -> None:
        self._containers[container.id] = container
        self._pod_index.setdefault(container.pod_sandbox_id, {})[container.id] = None

    def _emit(self, subject_id: str, event_type: EventType, sandbox: Sandbox) -> None:
        """Queue a lifecycle event carrying the pod's status and its containers' statuses."""
        self._events.append(
            cri.ContainerEventResponse(
                container_id=subject_id,
                container_event_type=event_type,
                created_at=self.clock(),
                pod_sandbox_status=self._sandbox_status(sandbox),
                containers_statuses=[self._container_status(c) for c in self._pod_containers(sandbox.id)],
            )
        )

    # -- encoded answers (ENCODED_CALLS) ------------------------------------------------------
    #
    # Encodings of messages concatenate into the encoding of their merge, and betterproto2 writes
    # fields in number order: so each answer below is joined, byte for byte, from the encodings of
    # its parts (one per list item and per status), each kept on its record. Records never change
    # (a transition makes a new record, which starts with nothing kept), so nothing goes stale.

    def list_pod_sandbox_encoded(self, request: cri.ListPodSandboxRequest) -> bytes:
        """:meth:`list_pod_sandbox`, encoded: the very same bytes."""
        return b"".join(
            self._sandbox_item_bytes(s) for s in self._unordered(self._select_sandboxes(request.filter))
        )

    def pod_sandbox_status_encoded(self, request: cri.PodSandboxStatusRequest) -> bytes:
        """:meth:`pod_sandbox_status`, encoded: the very same bytes (fields: status 1,
        containers_statuses 3, timestamp 4)."""
        sandbox = self._find_sandbox(request.pod_sandbox_id)
        parts = [self._sandbox_status_bytes(sandbox)]
        parts.extend(self._in_pod_status_bytes(c) for c in self._pod_containers(sandbox.id))
        parts.append(bytes(cri.PodSandboxStatusResponse(timestamp=self.clock()).SerializeToString()))
        return b"".join(parts)

    def list_containers_encoded(self, request: cri.ListContainersRequest) -> bytes:
        """:meth:`list_containers`, encoded: the very same bytes."""
        return b"".join(
            self._container_item_bytes(c) for c in self._unordered(self._select_containers(request.filter))
        )

    def container_status_encoded(self, request: cri.ContainerStatusRequest) -> bytes:
        """:meth:`container_status`, encoded: the very same bytes."""
        return self._container_status_bytes(self._find_container(request.container_id))

    def _sandbox_item_bytes(self, sandbox: Sandbox) -> bytes:
        return _encoded(
            sandbox.wire,
            "ListPodSandboxResponse.items",
            lambda: cri.ListPodSandboxResponse(items=[self._sandbox_message(sandbox)]),
        )

    def _sandbox_status_bytes(self, sandbox: Sandbox) -> bytes:
        return _encoded(
            sandbox.wire,
            "PodSandboxStatusResponse.status",
            lambda: cri.PodSandboxStatusResponse(status=self._sandbox_status(sandbox)),
        )

    def _container_item_bytes(self, container: Container) -> bytes:
        return _encoded(
            container.wire,
            "ListContainersResponse.containers",
            lambda: cri.ListContainersResponse(containers=[self._container_message(container)]),
        )

    def _in_pod_status_bytes(self, container: Container) -> bytes:
        return _encoded(
            container.wire,
            "PodSandboxStatusResponse.containers_statuses",
            lambda: cri.PodSandboxStatusResponse(containers_statuses=[self._container_status(container)]),
        )

    def _container_status_bytes(self, container: Container) -> bytes:
        return _encoded(
            container.wire,
            "ContainerStatusResponse.status",
            lambda: cri.ContainerStatusResponse(status=self._container_status(container)),
        )

    def _prepare_answers(self, sandbox: Sandbox) -> None:
        """Encode, and keep on the records, every part of the encoded answers about *sandbox*."""
        self._sandbox_item_bytes(sandbox)
        self._sandbox_status_bytes(sandbox)
        for container in self._pod_containers(sandbox.id):
            self._container_item_bytes(container)
            self._in_pod_status_bytes(container)
            self._container_status_bytes(container)

    # -- runtime info -------------------------------------------------------------------------

    def version(self, request: cri.VersionRequest) -> cri.VersionResponse:
        """Name and versions, as containerd 1.6 reports them (with a ``-fake`` suffix)."""
        return cri.VersionResponse(
            version="0.1.0",
            runtime_name=RUNTIME_NAME,
            runtime_version=RUNTIME_VERSION,
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

        A second sandbox with the same name/namespace/uid/attempt is refused (UNKNOWN), since
        containerd reserves that name until the first one is removed.
        """
        config = request.config or cri.PodSandboxConfig()
        metadata = config.metadata or cri.PodSandboxMetadata()
        if not metadata.name:
            raise CriError(Code.INVALID_ARGUMENT, "sandbox config must include metadata")
        options = None
        if config.linux and config.linux.security_context and config.linux.security_context.namespace_options:
            options = _clone(config.linux.security_context.namespace_options)
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
        )
        self._reserve(sandbox.reserved_name, sandbox.id, "sandbox")
        self._sandboxes[sandbox.id] = sandbox
        self._emit(sandbox.id, EventType.CONTAINER_CREATED_EVENT, sandbox)
        self._emit(sandbox.id, EventType.CONTAINER_STARTED_EVENT, sandbox)
        return cri.RunPodSandboxResponse(pod_sandbox_id=sandbox.id)

    def _next_ip(self) -> str:
        n = next(self._ip_counter)
        return f"10.88.{n // 250 % 256}.{n % 250 + 2}"

    def _reserve(self, name: str, owner: str, kind: str) -> None:
        holder = self._reserved_names.get(name)
        if holder is not None:
            raise CriError(
                Code.UNKNOWN,
                f'failed to reserve {kind} name "{name}": name "{name}" is reserved for "{holder}"',
            )
        self._reserved_names[name] = owner

    def stop_pod_sandbox(self, request: cri.StopPodSandboxRequest) -> cri.StopPodSandboxResponse:
        """Kill the pod's running containers (exit 137) and mark the sandbox NOTREADY.

        Unknown IDs are NOT_FOUND (containerd looks the sandbox up first and wraps the store's
        not-found error). Stopping a NOTREADY sandbox again succeeds and changes nothing.
        """
        sandbox = self._find_sandbox(request.pod_sandbox_id)
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

        Removing an unknown ID succeeds: containerd treats a missing sandbox as already removed.
        """
        try:
            sandbox = self._find_sandbox(request.pod_sandbox_id)
        except CriError:
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
            containers_statuses=[self._container_status(c) for c in self._pod_containers(sandbox.id)],
            timestamp=self.clock(),
        )

    def list_pod_sandbox(self, request: cri.ListPodSandboxRequest) -> cri.ListPodSandboxResponse:
        """Sandboxes matching every given filter (ID or ID prefix, state, labels)."""
        return cri.ListPodSandboxResponse(
            items=[self._sandbox_message(s) for s in self._unordered(self._select_sandboxes(request.filter))]
        )

    def _unordered(self, items: Iterable[_T]) -> list[_T]:
        """``items`` in an order of :attr:`order`'s choosing (see the class docstring)."""
        shuffled = list(items)
        self.order.shuffle(shuffled)
        return shuffled

    def _select_sandboxes(self, flt: cri.PodSandboxFilter | None) -> Iterable[Sandbox]:
        sandboxes: Iterable[Sandbox] = self._sandboxes.values()
        if flt is not None:
            if flt.id:
                try:
                    sandboxes = [self._find_sandbox(flt.id)]
                except CriError:
                    sandboxes = []
            if flt.state is not None:
                sandboxes = [s for s in sandboxes if s.state == flt.state.state]
            if flt.label_selector:
                sandboxes = [s for s in sandboxes if _matches(s.labels, flt.label_selector)]
        return sandboxes

    @staticmethod
    def _sandbox_message(sandbox: Sandbox) -> cri.PodSandbox:
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

    # -- containers ---------------------------------------------------------------------------

    def create_container(self, request: cri.CreateContainerRequest) -> cri.CreateContainerResponse:
        """Create a CREATED container in a READY sandbox; emits CREATED.

        An unknown sandbox is NOT_FOUND; a NOTREADY one is refused with UNKNOWN (containerd
        returns a plain error, "sandbox container ... is not running", for state conflicts).
        """
        sandbox = self._find_sandbox(request.pod_sandbox_id)
        config = request.config or cri.ContainerConfig()
        metadata = config.metadata or cri.ContainerMetadata()
        if not metadata.name:
            raise CriError(Code.INVALID_ARGUMENT, "container config must include metadata")
        if sandbox.state != SandboxState.SANDBOX_READY:
            raise CriError(Code.UNKNOWN, f'sandbox container "{sandbox.id}" is not running')
        image_name = config.image.image if config.image else ""
        image = self._resolve_image(image_name)
        if image is None:
            if self.require_pulled_images or not image_name:
                raise CriError(Code.NOT_FOUND, f'failed to resolve image "{image_name}": not found')
            image = self._record_image(image_name)
        resources = None
        if config.linux is not None and config.linux.resources is not None:
            resources = _clone(config.linux.resources)
        reserved = f"{metadata.name}_{sandbox.name}_{sandbox.namespace}_{sandbox.uid}_{metadata.attempt}"
        container = Container(
            id=self.new_id(),
            pod_sandbox_id=sandbox.id,
            name=metadata.name,
            attempt=metadata.attempt,
            image=image_name,
            image_id=image.id,
            state=ContainerState.CONTAINER_CREATED,
            created_at=self.clock(),
            reserved_name=reserved,
            labels=dict(config.labels),
            annotations=dict(config.annotations),
            log_path=config.log_path,
            resources=resources,
            mounts=tuple(_clone(m) for m in config.mounts),
        )
        self._reserve(reserved, container.id, "container")
        self._add_container(container)
        self._emit(container.id, EventType.CONTAINER_CREATED_EVENT, sandbox)
        return cri.CreateContainerResponse(container_id=container.id)

    def _transition(self, container: Container, op: Op) -> ContainerState:
        new_state = CONTAINER_TRANSITIONS.get((container.state, op))
        if new_state is None:
            raise CriError(Code.UNKNOWN, f"container is in {_state_name(container.state)} state")
        return new_state

    def start_container(self, request: cri.StartContainerRequest) -> cri.StartContainerResponse:
        """CREATED -> RUNNING; emits STARTED. Starting in any other state, or in a NOTREADY pod,
        is UNKNOWN with containerd's messages."""
        container = self._find_container(request.container_id)
        new_state = self._transition(container, Op.START)
        sandbox = self._sandboxes[container.pod_sandbox_id]
        if sandbox.state != SandboxState.SANDBOX_READY:
            raise CriError(Code.UNKNOWN, f'sandbox container "{sandbox.id}" is not running')
        self._containers[container.id] = attrs.evolve(container, state=new_state, started_at=self.clock())
        self._emit(container.id, EventType.CONTAINER_STARTED_EVENT, sandbox)
        return cri.StartContainerResponse()

    def stop_container(self, request: cri.StopContainerRequest) -> cri.StopContainerResponse:
        """RUNNING -> EXITED; emits STOPPED. Unknown IDs are NOT_FOUND; stopping a container that is
        not running succeeds and changes nothing (as in containerd).

        A positive timeout is a graceful stop (exit 0, reason "Completed"); timeout 0 kills at
        once (exit 137, reason "Error").
        """
        container = self._find_container(request.container_id)
        self._stop(container, exit_code=0 if request.timeout > 0 else EXIT_CODE_KILLED)
        return cri.StopContainerResponse()

    def _stop(self, container: Container, *, exit_code: int, op: Op = Op.STOP, reason: str = "") -> None:
        new_state = self._transition(container, op)
        if new_state == container.state:
            return
        reason = reason or ("Completed" if exit_code == 0 else "Error")
        stopped = attrs.evolve(
            container, state=new_state, finished_at=self.clock(), exit_code=exit_code, reason=reason
        )
        self._containers[container.id] = stopped
        self._emit(container.id, EventType.CONTAINER_STOPPED_EVENT, self._sandboxes[container.pod_sandbox_id])

    def exit_container(self, container_id: str, exit_code: int, reason: str = "") -> None:
        """Simulate a RUNNING container's process ending by itself (e.g. ``OOMKilled``, 137)."""
        self._stop(self._find_container(container_id), exit_code=exit_code, op=Op.EXIT, reason=reason)

    def remove_container(self, request: cri.RemoveContainerRequest) -> cri.RemoveContainerResponse:
        """Remove a container; emits DELETED.

        Unknown IDs succeed (containerd: "Do not return error if container metadata doesn't
        exist"). A RUNNING container is killed first (exit 137), as containerd does; with
        ``force_remove_running=False`` it is refused instead.
        """
        try:
            container = self._find_container(request.container_id)
        except CriError:
            return cri.RemoveContainerResponse()
        if container.state == ContainerState.CONTAINER_RUNNING:
            if not self.force_remove_running:
                raise CriError(
                    Code.UNKNOWN,
                    f'failed to set removing state for container "{container.id}": '
                    "container is still running, to stop first",
                )
            self._stop(container, exit_code=EXIT_CODE_KILLED)
        self._remove(self._containers[container.id])
        return cri.RemoveContainerResponse()

    def _remove(self, container: Container) -> None:
        del self._containers[container.id]
        del self._pod_index[container.pod_sandbox_id][container.id]
        self._reserved_names.pop(container.reserved_name, None)
        self._emit(container.id, EventType.CONTAINER_DELETED_EVENT, self._sandboxes[container.pod_sandbox_id])

    def list_containers(self, request: cri.ListContainersRequest) -> cri.ListContainersResponse:
        """Containers matching every given filter (ID or ID prefix, state, pod, labels)."""
        return cri.ListContainersResponse(
            containers=[
                self._container_message(c) for c in self._unordered(self._select_containers(request.filter))
            ]
        )

    def _select_containers(self, flt: cri.ContainerFilter | None) -> Iterable[Container]:
        containers: Iterable[Container] = self._containers.values()
        if flt is not None:
            if flt.id:
                try:
                    containers = [self._find_container(flt.id)]
                except CriError:
                    containers = []
            if flt.pod_sandbox_id:
                try:
                    pod_id = self._find_sandbox(flt.pod_sandbox_id).id
                except CriError:
                    pod_id = flt.pod_sandbox_id
                containers = [c for c in containers if c.pod_sandbox_id == pod_id]
            if flt.state is not None:
                containers = [c for c in containers if c.state == flt.state.state]
            if flt.label_selector:
                containers = [c for c in containers if _matches(c.labels, flt.label_selector)]
        return containers

    def container_status(self, request: cri.ContainerStatusRequest) -> cri.ContainerStatusResponse:
        """Status with timestamps (ns), exit code, reason and the current Linux resources."""
        return cri.ContainerStatusResponse(
            status=self._container_status(self._find_container(request.container_id))
        )

    def update_container_resources(
        self, request: cri.UpdateContainerResourcesRequest
    ) -> cri.UpdateContainerResourcesResponse:
        """Apply the new Linux resources (in any state, as containerd updates the spec regardless).

        Like containerd's ``WithResources``, only the fields the request sets (non-zero, non-empty)
        change; ``unified`` entries are added or overwritten; ``oom_score_adj`` is not updatable.
        """
        container = self._find_container(request.container_id)
        resources = container.resources
        if request.linux is not None:
            resources = _clone(resources) if resources is not None else cri.LinuxContainerResources()
            for field in (
                "cpu_period",
                "cpu_quota",
                "cpu_shares",
                "memory_limit_in_bytes",
                "cpuset_cpus",
                "cpuset_mems",
                "memory_swap_limit_in_bytes",
            ):
                value = getattr(request.linux, field)
                if value:
                    setattr(resources, field, value)
            if request.linux.hugepage_limits:
                resources.hugepage_limits = list(request.linux.hugepage_limits)
            resources.unified = {**resources.unified, **request.linux.unified}
        self._containers[container.id] = attrs.evolve(container, resources=resources)
        return cri.UpdateContainerResourcesResponse()

    def update_pod_sandbox_resources(
        self, request: cri.UpdatePodSandboxResourcesRequest
    ) -> cri.UpdatePodSandboxResourcesResponse:
        """Record the pod's new overhead and resources (pod-level resize, KEP-5419), as containerd 2.3 does.

        containerd 2.3 looks the sandbox up (unknown: NOT_FOUND), in any state, and keeps both messages as
        sent, replacing the previous ones (absent ones become absent); it writes no cgroup (kubelet does).
        With :attr:`pod_resize` false the answer is grpc-go's for a method the server lacks: UNIMPLEMENTED.
        """
        if not self.pod_resize:
            raise CriError(
                Code.UNIMPLEMENTED,
                "unknown method UpdatePodSandboxResources for service runtime.v1.RuntimeService",
            )
        sandbox = self._find_sandbox(request.pod_sandbox_id)
        self._sandboxes[sandbox.id] = attrs.evolve(
            sandbox,
            overhead=_clone(request.overhead) if request.overhead is not None else None,
            resources=_clone(request.resources) if request.resources is not None else None,
        )
        return cri.UpdatePodSandboxResourcesResponse()

    def exec_sync(self, request: cri.ExecSyncRequest) -> cri.ExecSyncResponse:
        """Answer a scripted result, or exit 0 with the command line echoed on stdout.

        Only RUNNING containers can exec; others are UNKNOWN "container is in ... state".
        """
        container = self._find_container(request.container_id)
        if container.state != ContainerState.CONTAINER_RUNNING:
            raise CriError(Code.UNKNOWN, f"container is in {_state_name(container.state)} state")
        result = self._exec_scripts.get(tuple(request.cmd))
        if result is None:
            result = ExecResult(stdout=" ".join(request.cmd).encode())
        return cri.ExecSyncResponse(stdout=result.stdout, stderr=result.stderr, exit_code=result.exit_code)

    def _stats(self, container: Container) -> cri.ContainerStats:
        now = self.clock()
        zero = cri.UInt64Value(value=0)
        return cri.ContainerStats(
            attributes=cri.ContainerAttributes(
                id=container.id,
                metadata=cri.ContainerMetadata(name=container.name, attempt=container.attempt),
                labels=dict(container.labels),
                annotations=dict(container.annotations),
            ),
            cpu=cri.CpuUsage(timestamp=now, usage_core_nano_seconds=zero, usage_nano_cores=zero),
            memory=cri.MemoryUsage(timestamp=now, working_set_bytes=zero),
            writable_layer=cri.FilesystemUsage(
                timestamp=now,
                fs_id=cri.FilesystemIdentifier(mountpoint=IMAGE_FS_MOUNTPOINT),
                used_bytes=zero,
                inodes_used=zero,
            ),
        )

    def container_stats(self, request: cri.ContainerStatsRequest) -> cri.ContainerStatsResponse:
        """All-zero usage for one container."""
        return cri.ContainerStatsResponse(stats=self._stats(self._find_container(request.container_id)))

    def list_container_stats(self, request: cri.ListContainerStatsRequest) -> cri.ListContainerStatsResponse:
        """All-zero usage for the containers matching the filter."""
        flt = request.filter or cri.ContainerStatsFilter()
        selected = self.list_containers(
            cri.ListContainersRequest(
                filter=cri.ContainerFilter(
                    id=flt.id, pod_sandbox_id=flt.pod_sandbox_id, label_selector=dict(flt.label_selector)
                )
            )
        )
        return cri.ListContainerStatsResponse(
            stats=[self._stats(self._containers[c.id]) for c in selected.containers]
        )

    # -- images -------------------------------------------------------------------------------

    def _record_image(self, name: str) -> ImageRecord:
        image = image_record_for(name)
        known = self._images.get(image.id)
        if known is not None:
            return known
        self._images[image.id] = image
        return image

    def pull_image(self, request: cri.PullImageRequest) -> cri.PullImageResponse:
        """Record the image (no network); answers its ``sha256:`` ID like containerd."""
        name = request.image.image if request.image else ""
        if not name:
            raise CriError(Code.INVALID_ARGUMENT, "image reference must not be empty")
        return cri.PullImageResponse(image_ref=self._record_image(name).id)

    def list_images(self, request: cri.ListImagesRequest) -> cri.ListImagesResponse:
        """All pulled images, or the one the filter names."""
        name = request.filter.image.image if request.filter and request.filter.image else ""
        if name:
            image = self._resolve_image(name)
            images = [image] if image is not None else []
        else:
            images = self._unordered(self._images.values())
        return cri.ListImagesResponse(images=[self._image_message(i) for i in images])

    def image_status(self, request: cri.ImageStatusRequest) -> cri.ImageStatusResponse:
        """The image, or an empty response (not an error) when it is not present."""
        image = self._resolve_image(request.image.image if request.image else "")
        return cri.ImageStatusResponse(image=self._image_message(image) if image is not None else None)

    def remove_image(self, request: cri.RemoveImageRequest) -> cri.RemoveImageResponse:
        """Forget the image; removing a missing image succeeds."""
        image = self._resolve_image(request.image.image if request.image else "")
        if image is not None:
            del self._images[image.id]
        return cri.RemoveImageResponse()

    def image_fs_info(self, request: cri.ImageFsInfoRequest) -> cri.ImageFsInfoResponse:
        """One image filesystem whose usage is the sum of the pulled images' sizes."""
        return cri.ImageFsInfoResponse(
            image_filesystems=[
                cri.FilesystemUsage(
                    timestamp=self.clock(),
                    fs_id=cri.FilesystemIdentifier(mountpoint=IMAGE_FS_MOUNTPOINT),
                    used_bytes=cri.UInt64Value(value=sum(i.size for i in self._images.values())),
                    inodes_used=cri.UInt64Value(value=100 * len(self._images)),
                )
            ]
        )

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
