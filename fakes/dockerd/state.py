"""The fake dockerd's state: containers, execs, logs and events, without any I/O."""

from __future__ import annotations

import hashlib
import itertools
import json
import struct
from collections.abc import Callable, Iterator
from typing import Any

import attrs

__all__ = ["DockerState", "Failure", "FakeContainer", "RequestRecord", "multiplex", "sequential_ids"]

#: HostConfig keys ``POST /containers/{id}/update`` may change (Docker's UpdateConfig resources).
UPDATABLE = ("CpuShares", "Memory", "CpuPeriod", "CpuQuota", "CpusetCpus", "CpusetMems", "MemorySwap")


def sequential_ids(prefix: str = "fake") -> Callable[[], str]:
    """Deterministic 64-hex-digit ids, like Docker's."""
    counter = itertools.count(1)
    return lambda: hashlib.sha256(f"{prefix}-{next(counter)}".encode()).hexdigest()


def multiplex(stream: int, data: bytes) -> bytes:
    """One frame of Docker's multiplexed stream (``stream`` 1 = stdout, 2 = stderr)."""
    return struct.pack(">BxxxL", stream, len(data)) + data


class Failure(Exception):
    """An API error: HTTP ``status`` with dockerd's ``{"message": ...}`` body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@attrs.frozen
class RequestRecord:
    """One request as the fake received it (body as sent, after HTTP framing)."""

    method: str
    target: str
    headers: tuple[tuple[str, str], ...]
    body: bytes

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    def json(self) -> Any:
        return json.loads(self.body)


@attrs.define
class FakeContainer:
    """A container: what create was sent, and its state."""

    id: str
    name: str
    config: dict[str, Any]
    host_config: dict[str, Any]
    running: bool = False
    created: int = 0
    logs: list[bytes] = attrs.field(factory=list)

    @property
    def labels(self) -> dict[str, str]:
        labels = self.config.get("Labels")
        return dict(labels) if isinstance(labels, dict) else {}

    def summary(self) -> dict[str, Any]:
        """An item of ``GET /containers/json``."""
        return {
            "Id": self.id,
            "Names": [f"/{self.name}"],
            "Image": self.config.get("Image", ""),
            "Labels": self.labels,
            "State": "running" if self.running else "created",
            "Created": self.created,
        }

    def inspect(self) -> dict[str, Any]:
        """``GET /containers/{id}/json``."""
        return {
            "Id": self.id,
            "Name": f"/{self.name}",
            "Config": {**self.config, "Labels": self.labels, "Env": list(self.config.get("Env") or [])},
            "HostConfig": dict(self.host_config),
            "State": {"Running": self.running, "Status": "running" if self.running else "created"},
        }


@attrs.define
class DockerState:
    """Containers by id, execs, and the event subscribers' callbacks."""

    cgroup_driver: str = "cgroupfs"
    new_id: Callable[[], str] = attrs.field(factory=sequential_ids)
    containers: dict[str, FakeContainer] = attrs.field(factory=dict)
    execs: dict[str, str] = attrs.field(factory=dict)  # exec id -> container id
    listeners: list[Callable[[dict[str, Any]], None]] = attrs.field(factory=list)
    _clock: Iterator[int] = attrs.field(factory=lambda: itertools.count(1_700_000_000))

    def find(self, ident: str) -> FakeContainer:
        """The container named by id, unique id prefix or name (Docker's lookup order)."""
        if ident in self.containers:
            return self.containers[ident]
        for container in self.containers.values():
            if container.name == ident.removeprefix("/"):
                return container
        matches = [c for i, c in self.containers.items() if i.startswith(ident)]
        if len(matches) == 1:
            return matches[0]
        raise Failure(404, f"No such container: {ident}")

    def _emit(self, action: str, container: FakeContainer) -> None:
        event = {
            "Type": "container",
            "Action": action,
            "Actor": {"ID": container.id, "Attributes": {"name": container.name}},
            "time": next(self._clock),
        }
        for listener in list(self.listeners):
            listener(event)

    def create(self, name: str, body: Any) -> FakeContainer:
        if not isinstance(body, dict):
            raise Failure(400, "create request body must be a JSON object")
        if name and any(c.name == name for c in self.containers.values()):
            raise Failure(409, f'Conflict. The container name "/{name}" is already in use')
        ident = self.new_id()
        host_config = body.get("HostConfig")
        config = {k: v for k, v in body.items() if k not in ("HostConfig", "NetworkingConfig")}
        container = FakeContainer(
            ident,
            name or ident[:12],
            config,
            dict(host_config) if isinstance(host_config, dict) else {},
            created=next(self._clock),
        )
        self.containers[ident] = container
        self._emit("create", container)
        return container

    def start(self, ident: str) -> bool:
        """Start; False if it was running already (dockerd answers 304)."""
        container = self.find(ident)
        if container.running:
            return False
        container.running = True
        self._emit("start", container)
        return True

    def stop(self, ident: str) -> bool:
        """Stop; False if it was not running (dockerd answers 304)."""
        container = self.find(ident)
        if not container.running:
            return False
        container.running = False
        self._emit("die", container)
        self._emit("stop", container)
        return True

    def update(self, ident: str, body: Any) -> None:
        if not isinstance(body, dict):
            raise Failure(400, "update request body must be a JSON object")
        container = self.find(ident)
        for key in UPDATABLE:
            value = body.get(key)
            if value:
                container.host_config[key] = value
        self._emit("update", container)

    def remove(self, ident: str) -> None:
        container = self.find(ident)
        if container.running:
            raise Failure(
                409, f"You cannot remove a running container {container.id}. Stop the container first"
            )
        del self.containers[container.id]
        self._emit("destroy", container)

    def exec_create(self, ident: str) -> str:
        container = self.find(ident)
        if not container.running:
            raise Failure(409, f"Container {container.id} is not running")
        exec_id = self.new_id()
        self.execs[exec_id] = container.id
        return exec_id
