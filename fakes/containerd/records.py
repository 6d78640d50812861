"""The fake runtime's records and rules: status codes, the transition tables, sandboxes,
containers and images, IDs and clocks (see :mod:`krproxy.fakes.containerd.state`)."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import itertools
import json
import os
import random
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import betterproto2

from krproxy.proto.runtime import v1 as cri

#: What the fake calls itself in ``Version``; kubelet only logs it, proxies may show it.
RUNTIME_NAME = "containerd"
RUNTIME_VERSION = "v1.6.20-fake"
RUNTIME_API_VERSION = "v1"

#: Exit code of a container killed by SIGKILL (128 + 9): what a forced stop leaves behind.
EXIT_CODE_KILLED = 137
#: Exit code and reason containerd gives a container whose start failed (``errorStartExitCode``).
EXIT_CODE_START_ERROR = 128
START_ERROR_REASON = "StartError"

#: Where containerd's overlayfs snapshotter keeps image layers; ImageFsInfo reports it.
IMAGE_FS_MOUNTPOINT = "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs"

_M = TypeVar("_M", bound=betterproto2.Message)

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
    #: A start that failed once the container was marked starting (its pod is not ready): containerd
    #: marks it exited (exit code 128, reason "StartError").
    FAIL_START = "fail_start"
    REMOVE = "remove"


#: (state, operation) -> state afterwards. A missing pair is refused. Stopping a container that is
#: not running is a no-op in containerd (it logs and returns success), hence the self-loops.
CONTAINER_TRANSITIONS: Mapping[tuple[ContainerState, Op], ContainerState] = {
    (ContainerState.CONTAINER_CREATED, Op.START): ContainerState.CONTAINER_RUNNING,
    (ContainerState.CONTAINER_CREATED, Op.STOP): ContainerState.CONTAINER_CREATED,
    (ContainerState.CONTAINER_CREATED, Op.FAIL_START): ContainerState.CONTAINER_EXITED,
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


def clone(message: _M) -> _M:
    """A deep copy of a message, so callers cannot alias the fake's state."""
    return type(message).FromString(message.SerializeToString())


def encoded(cache: dict[str, bytes], key: str, build: Callable[[], betterproto2.Message]) -> bytes:
    """``cache[key]``, or the encoding of ``build()`` stored there first."""
    data = cache.get(key)
    if data is None:
        data = cache[key] = bytes(build().SerializeToString())
    return data


def matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
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
    #: The PodSandboxConfig it was run with (what verbose status reports: :func:`sandbox_info`).
    config: cri.PodSandboxConfig | None = attrs.field(default=None, eq=False, hash=False, repr=False)
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
    #: The ContainerConfig it was created with (what verbose status reports: :func:`container_info`).
    config: cri.ContainerConfig | None = attrs.field(default=None, eq=False, hash=False, repr=False)
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


def lookup_failed(kind: str, key: str, code: Code, reason: str) -> CriError:
    """containerd's answer when its store cannot name the ``kind`` ("sandbox", "container") ``key`` names."""
    return CriError(code, f'an error occurred when try to find {kind} "{key}": {reason}')


def sandbox_not_found(sandbox_id: str) -> CriError:
    return lookup_failed("sandbox", sandbox_id, Code.NOT_FOUND, "not found")


def container_not_found(container_id: str) -> CriError:
    return lookup_failed("container", container_id, Code.NOT_FOUND, "not found")


def state_name(state: ContainerState) -> str:
    return state.name or str(int(state))


# -- verbose status info (what containerd puts under ``info["info"]``) -----------------------------
#
# Shaped as containerd 1.6.20 writes it (measured; 2.1.9's has the same keys recovery reads, plus
# ``sandboxMetadata`` and without ``runtimeHandler``): Go's encoding/json of its own structs, whose
# ``config`` is the CRI config it received as a gogo struct (snake_case names, zero values left out,
# enums and integers as numbers) and whose ``runtimeSpec`` is the OCI spec it gave runc.

#: The variables the fake's images set, before the CRI envs (as an image's ``PATH`` in ``process.env``).
IMAGE_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",)


def go_json(message: betterproto2.Message) -> dict[str, Any]:
    """*message* as containerd's ``encoding/json`` writes a CRI struct it holds: snake_case names, every
    field ``omitempty`` (a sub-message set but empty is ``{}``), enums and integers as numbers, maps as
    objects; a string not UTF-8, and our schema's bytes ``KeyValue.value``, written as Go writes a string."""
    document: dict[str, Any] = {}
    for field in dataclasses.fields(message):  # type: ignore[arg-type]
        value = getattr(message, field.name)
        if value is None or (not isinstance(value, betterproto2.Message) and not value):
            continue
        document[field.name] = _go_value(value)
    return document


def _go_value(value: Any) -> Any:
    if isinstance(value, betterproto2.Message):
        return go_json(value)
    if isinstance(value, dict):
        return {k: _go_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_go_value(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def _pid(ident: str) -> int:
    """A process id for the record *ident*, the same every time (the fake runs no processes)."""
    return 1000 + int(hashlib.sha256(ident.encode()).hexdigest()[:4], 16)


def sandbox_info(sandbox: Sandbox) -> dict[str, str]:
    """The ``info`` map of a verbose PodSandboxStatus of *sandbox*."""
    config = go_json(sandbox.config) if sandbox.config is not None else {}
    parent = (sandbox.config.linux.cgroup_parent if sandbox.config and sandbox.config.linux else "") or ""
    document: dict[str, Any] = {
        "pid": _pid(sandbox.id),
        "processStatus": "running" if sandbox.state == SandboxState.SANDBOX_READY else "stopped",
        "netNamespaceClosed": sandbox.state != SandboxState.SANDBOX_READY,
        "image": "registry.k8s.io/pause:3.6",
        "snapshotKey": sandbox.id,
        "snapshotter": "overlayfs",
        "runtimeHandler": sandbox.runtime_handler,
        "runtimeType": "io.containerd.runc.v2",
        "runtimeOptions": {},
        "config": config,
        "runtimeSpec": {
            "ociVersion": "1.0.2-dev",
            "process": {"user": {"uid": 0, "gid": 0}, "args": ["/pause"], "env": list(IMAGE_ENV), "cwd": "/"},
            "root": {"path": "rootfs", "readonly": True},
            "annotations": {
                "io.kubernetes.cri.container-type": "sandbox",
                "io.kubernetes.cri.sandbox-id": sandbox.id,
            },
            "linux": {"cgroupsPath": f"{parent}/{sandbox.id}" if parent else ""},
        },
        "cniResult": None,
    }
    # What UpdatePodSandboxResources set, as containerd 2.3 reports it (the fake answers that call as 2.3).
    for name in ("resources", "overhead"):
        resources = getattr(sandbox, name)
        if resources is not None:
            document[name] = {"linux": go_json(resources)}
    return {"info": json.dumps(document)}


def container_info(container: Container, sandbox: Sandbox | None) -> dict[str, str]:
    """The ``info`` map of a verbose ContainerStatus of *container* (in *sandbox*)."""
    config = container.config
    parent = (
        sandbox.config.linux.cgroup_parent if sandbox and sandbox.config and sandbox.config.linux else ""
    ) or ""
    envs = [f"{kv.key}={_go_value(kv.value)}" for kv in (config.envs if config is not None else [])]
    args = [*(config.command if config else []), *(config.args if config else [])]
    document: dict[str, Any] = {
        "sandboxID": container.pod_sandbox_id,
        "pid": _pid(container.id) if container.state == ContainerState.CONTAINER_RUNNING else 0,
        "removing": False,
        "snapshotKey": container.id,
        "snapshotter": "overlayfs",
        "runtimeType": "io.containerd.runc.v2",
        "runtimeOptions": {},
        "config": go_json(config) if config is not None else {},
        "runtimeSpec": {
            "ociVersion": "1.0.2-dev",
            "process": {"user": {"uid": 0, "gid": 0}, "args": args, "env": [*IMAGE_ENV, *envs], "cwd": "/"},
            "root": {"path": "rootfs"},
            "linux": {"cgroupsPath": f"{parent}/{container.id}" if parent else ""},
        },
    }
    return {"info": json.dumps(document)}
