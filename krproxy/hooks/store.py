"""The in-memory store of pod and container records (koord-runtime-proxy's ``store`` package).

StartContainer, StopContainer, StopPodSandbox and UpdateContainerResources requests carry only an id; the
store lets the proxy send plugins the full record anyway, so plugins can stay stateless.

When the proxy writes and drops entries (the reference's points, plus Remove*):

* put: after a successful RunPodSandbox (key: the returned sandbox id) and CreateContainer (key: the
  returned container id), with the record as merged by the pre hooks;
* update: after PreStartContainer / PreUpdateContainerResources answers (the reference mutates the stored
  record in place, so later hooks see the merged values) — :meth:`HookStore.update_container` never
  re-creates an entry that was dropped meanwhile;
* resize: after a successful UpdatePodSandboxResources the pod's ``resources`` and ``overhead`` become the
  ones forwarded (after PreUpdatePodSandboxResources answers), in the pod record and in the pod of each of its
  container records (:meth:`HookStore.resize_pod`), so later container hooks get them as ``pod_resources``.
  Only a resize changes the pod part of a container record: put and update keep the stored pod's, so a
  container call whose hooks ran during a resize (kubelet's CPU manager updates containers from another
  goroutine than the pod's) does not write the old pod resources back;
* drop: StopPodSandbox drops the pod, StopContainer the container — after the post hook, and only when the
  runtime succeeded or answered NOT_FOUND (a StopPodSandbox answered NOT_FOUND drops the pod's containers
  too, as RemovePodSandbox does); after another failure the entry stays, so kubelet's retry runs
  its PostStop hooks with the full record (the reference drops it whatever the runtime said, so a retried
  Stop runs no hooks). We also drop on RemovePodSandbox (the pod *and* its containers,
  :meth:`HookStore.remove_pod`) and RemoveContainer, on the same condition, which the reference never does
  (its entries for containers of a stopped-but-not-removed pod otherwise leak);
* load: :meth:`HookStore.load` replaces everything with what recovery rebuilt from the runtime, before the
  proxy serves.

Which object an id names is containerd's answer (:mod:`krproxy.hooks.idprefix`): a unique prefix of a stored
id names it, an empty or ambiguous one is refused. :meth:`HookStore.resolve_pod` and
:meth:`HookStore.resolve_container` give the stored id a caller's id names; every reader on the request path
asks them first and then reads, keeps and drops records by that full id, so an entry removed by a prefix
leaves the store as one removed by its full id. The getters and droppers themselves take full ids only.

Not thread-safe: it is used from one event loop, synchronously (no await between read and write).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import final

import attrs

from krproxy.hooks.idprefix import IdIndex
from krproxy.hooks.model import ContainerInfo, PodInfo, Resources

__all__ = ["HookStore", "StoreStatistics"]


@attrs.frozen
class StoreStatistics:
    """Sizes of the store at one moment.

    Attributes:
        pods: pod records.
        containers: container records.
        orphan_containers: container records whose pod record is gone (e.g. after StopPodSandbox).
    """

    pods: int
    containers: int
    orphan_containers: int


@final
@attrs.define(eq=False)
class HookStore:
    """Pod records by sandbox id and container records by container id; records are frozen values."""

    _pods: dict[str, PodInfo] = attrs.field(factory=dict, init=False)
    _containers: dict[str, ContainerInfo] = attrs.field(factory=dict, init=False)
    _pod_ids: IdIndex = attrs.field(factory=IdIndex, init=False)
    _container_ids: IdIndex = attrs.field(factory=IdIndex, init=False)
    _counted: tuple[str, str] | None = attrs.field(default=None, init=False)  # the label count_label counts
    _labelled: int = attrs.field(default=0, init=False)

    # --- a label's pods ---

    def count_label(self, key: str, value: str) -> None:
        """Count the stored pods carrying label *key* with exactly *value* from now on (:attr:`labelled`):
        the skip label, which a hooked call's watch looks for on every CreateContainer."""
        self._counted = (key, value)
        self._labelled = sum(1 for pod in self._pods.values() if pod.has_label(key, value))

    @property
    def labelled(self) -> int:
        """How many stored pods carry the label :meth:`count_label` counts (0 before it is called)."""
        return self._labelled

    def _count(self, pod: PodInfo | None) -> int:
        counted = self._counted
        return 1 if counted is not None and pod is not None and pod.has_label(*counted) else 0

    # --- which object ---

    def resolve_pod(self, key: str) -> str | None:
        """The stored sandbox id *key* names as containerd reads it (itself, or the one id it is a prefix of),
        or None if it names none.

        Raises:
            krproxy.hooks.idprefix.IdRefused: *key* is empty, or a prefix of two or more stored sandbox ids.
        """
        return self._pod_ids.resolve(key)

    def resolve_container(self, key: str) -> str | None:
        """As :meth:`resolve_pod`, for container ids."""
        return self._container_ids.resolve(key)

    # --- pods ---

    def put_pod(self, sandbox_id: str, pod: PodInfo) -> None:
        """Store (or replace) the record of sandbox *sandbox_id*."""
        if self._counted is not None:
            self._labelled += self._count(pod) - self._count(self._pods.get(sandbox_id))
        self._pods[sandbox_id] = pod
        self._pod_ids.add(sandbox_id)

    def get_pod(self, sandbox_id: str) -> PodInfo | None:
        """The record of sandbox *sandbox_id*, or None."""
        return self._pods.get(sandbox_id)

    def delete_pod(self, sandbox_id: str) -> PodInfo | None:
        """Drop the pod record only (StopPodSandbox); return it, or None if there was none."""
        self._pod_ids.discard(sandbox_id)
        pod = self._pods.pop(sandbox_id, None)
        self._labelled -= self._count(pod)
        return pod

    def remove_pod(self, sandbox_id: str) -> tuple[str, ...]:
        """Drop the pod record and every container record of that sandbox (RemovePodSandbox); return the ids
        of the dropped containers."""
        self.delete_pod(sandbox_id)
        dropped = tuple(cid for cid, c in self._containers.items() if c.pod_sandbox_id == sandbox_id)
        for cid in dropped:
            self.delete_container(cid)
        return dropped

    def resize_pod(self, sandbox_id: str, resources: Resources | None, overhead: Resources | None) -> bool:
        """Set the resources and overhead of sandbox *sandbox_id*, in its record and in the pod of its
        containers' records; return whether the pod was stored (it is never re-created)."""
        pod = self._pods.get(sandbox_id)
        if pod is None:
            return False
        self._pods[sandbox_id] = attrs.evolve(pod, resources=resources, overhead=overhead)
        for cid, container in self._containers.items():
            if container.pod_sandbox_id == sandbox_id:
                self._containers[cid] = attrs.evolve(
                    container, pod=attrs.evolve(container.pod, resources=resources, overhead=overhead)
                )
        return True

    # --- containers ---

    def put_container(self, container_id: str, container: ContainerInfo) -> None:
        """Store (or replace) the record of container *container_id*; its pod's resources and overhead are
        the stored pod's (a resize may have come while the container's hooks ran)."""
        pod = self._pods.get(container.pod_sandbox_id)
        if pod is not None and pod is not container.pod:
            container = attrs.evolve(
                container, pod=attrs.evolve(container.pod, resources=pod.resources, overhead=pod.overhead)
            )
        self._containers[container_id] = container
        self._container_ids.add(container_id)

    def get_container(self, container_id: str) -> ContainerInfo | None:
        """The record of container *container_id*, or None."""
        return self._containers.get(container_id)

    def update_container(self, container_id: str, container: ContainerInfo) -> bool:
        """Replace the record of *container_id* if it is still stored; return whether it was. The pod part
        stays the stored one: container hooks never change it, and a resize (:meth:`resize_pod`) may have
        come while they ran."""
        current = self._containers.get(container_id)
        if current is None:
            return False
        self._containers[container_id] = attrs.evolve(container, pod=current.pod)
        return True

    def delete_container(self, container_id: str) -> ContainerInfo | None:
        """Drop the container record (StopContainer, RemoveContainer); return it, or None."""
        self._container_ids.discard(container_id)
        return self._containers.pop(container_id, None)

    # --- whole store ---

    def load(
        self, pods: Iterable[tuple[str, PodInfo]], containers: Iterable[tuple[str, ContainerInfo]]
    ) -> None:
        """Replace the whole content with recovered records: ``(sandbox id, pod)`` and ``(container id,
        container)`` pairs."""
        self._pods = dict(pods)
        self._containers = dict(containers)
        if self._counted is not None:
            self.count_label(*self._counted)
        self._pod_ids.replace(self._pods)
        self._container_ids.replace(self._containers)

    def pods(self) -> dict[str, PodInfo]:
        """A snapshot of all pod records by sandbox id."""
        return dict(self._pods)

    def containers(self) -> dict[str, ContainerInfo]:
        """A snapshot of all container records by container id."""
        return dict(self._containers)

    def statistics(self) -> StoreStatistics:
        """Current sizes."""
        orphans = sum(1 for c in self._containers.values() if c.pod_sandbox_id not in self._pods)
        return StoreStatistics(
            pods=len(self._pods), containers=len(self._containers), orphan_containers=orphans
        )
