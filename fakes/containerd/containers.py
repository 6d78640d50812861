"""The fake runtime's container calls: create, start, stop, remove, list, status, update,
exec and stats (a part of :class:`krproxy.fakes.containerd.state.RuntimeState`, over its
:class:`~krproxy.fakes.containerd._tables.Tables`)."""

from __future__ import annotations

import attrs

from krproxy.fakes.containerd._tables import Tables
from krproxy.fakes.containerd.records import (
    CONTAINER_TRANSITIONS,
    EXIT_CODE_KILLED,
    EXIT_CODE_START_ERROR,
    IMAGE_FS_MOUNTPOINT,
    START_ERROR_REASON,
    Code,
    Container,
    ContainerState,
    CriError,
    EventType,
    ExecResult,
    Op,
    SandboxState,
    clone,
    state_name,
)
from krproxy.fakes.containerd.settings import Settings
from krproxy.proto.runtime import v1 as cri


@attrs.define(eq=False)
class ContainerCalls:
    """The CRI calls about containers, on *tables*, behaving as *settings* say; also what the pod
    calls do to a pod's containers (:meth:`stop`, :meth:`remove`)."""

    tables: Tables
    settings: Settings

    def create_container(self, request: cri.CreateContainerRequest) -> cri.CreateContainerResponse:
        """Create a CREATED container in a READY sandbox; emits CREATED.

        An unknown sandbox is NOT_FOUND; a NOTREADY one is NOT_FOUND "no running task found" on
        containerd 1.6 and 1.7, and takes the container on 2.x (:attr:`Imitation.create_in_stopped_pod`).
        """
        sandbox = self.tables.find_sandbox(request.pod_sandbox_id)
        config = request.config or cri.ContainerConfig()
        metadata = config.metadata or cri.ContainerMetadata()
        if not metadata.name:
            raise CriError(Code.UNKNOWN, "container config must include metadata")
        if sandbox.state != SandboxState.SANDBOX_READY and not self.settings.imitate.create_in_stopped_pod:
            raise CriError(
                Code.NOT_FOUND,
                "failed to get sandbox container task: no running task found: "
                f"task {sandbox.id} not found: not found",
            )
        image_name = config.image.image if config.image else ""
        image = self.tables.resolve_image(image_name)
        if image is None:
            if self.settings.require_pulled_images or not image_name:
                raise CriError(Code.NOT_FOUND, f'failed to resolve image "{image_name}": not found')
            image = self.tables.record_image(image_name)
        resources = None
        if config.linux is not None and config.linux.resources is not None:
            resources = clone(config.linux.resources)
        reserved = f"{metadata.name}_{sandbox.name}_{sandbox.namespace}_{sandbox.uid}_{metadata.attempt}"
        container = Container(
            id=self.settings.new_id(),
            pod_sandbox_id=sandbox.id,
            name=metadata.name,
            attempt=metadata.attempt,
            image=image_name,
            image_id=image.id,
            state=ContainerState.CONTAINER_CREATED,
            created_at=self.settings.clock(),
            reserved_name=reserved,
            labels=dict(config.labels),
            annotations=dict(config.annotations),
            log_path=config.log_path,
            resources=resources,
            mounts=tuple(clone(m) for m in config.mounts),
            config=clone(config),
        )
        self.tables.reserve(reserved, container.id, "container")
        self.tables.add_container(container)
        self.tables.emit(container.id, EventType.CONTAINER_CREATED_EVENT, sandbox)
        return cri.CreateContainerResponse(container_id=container.id)

    def _transition(self, container: Container, op: Op) -> ContainerState:
        new_state = CONTAINER_TRANSITIONS.get((container.state, op))
        if new_state is None:
            raise CriError(Code.UNKNOWN, f"container is in {state_name(container.state)} state")
        return new_state

    def start_container(self, request: cri.StartContainerRequest) -> cri.StartContainerResponse:
        """CREATED -> RUNNING; emits STARTED. Starting in any other state, or in a NOTREADY pod,
        is UNKNOWN with containerd's messages; the latter fails once the container is marked starting,
        and containerd then marks it EXITED (exit code 128, reason "StartError"; every version)."""
        container = self.tables.find_container(request.container_id)
        new_state = self._transition(container, Op.START)
        sandbox = self.tables.sandboxes[container.pod_sandbox_id]
        if sandbox.state != SandboxState.SANDBOX_READY:
            message = f'sandbox container "{sandbox.id}" is not running'
            self.tables.containers[container.id] = attrs.evolve(
                container,
                state=self._transition(container, Op.FAIL_START),
                finished_at=self.settings.clock(),
                exit_code=EXIT_CODE_START_ERROR,
                reason=START_ERROR_REASON,
                message=message,
            )
            raise CriError(Code.UNKNOWN, message)
        self.tables.containers[container.id] = attrs.evolve(
            container, state=new_state, started_at=self.settings.clock()
        )
        self.tables.emit(container.id, EventType.CONTAINER_STARTED_EVENT, sandbox)
        return cri.StartContainerResponse()

    def stop_container(self, request: cri.StopContainerRequest) -> cri.StopContainerResponse:
        """RUNNING -> EXITED; emits STOPPED. Unknown IDs are NOT_FOUND on containerd 1.6 and OK from 1.7
        on (:attr:`Imitation.stop_unknown_ok`); stopping a container that is not running succeeds and
        changes nothing (as in containerd).

        A positive timeout is a graceful stop (exit 0, reason "Completed"); timeout 0 kills at
        once (exit 137, reason "Error").
        """
        try:
            container = self.tables.find_container(request.container_id)
        except CriError as err:
            if err.code == Code.NOT_FOUND and self.settings.imitate.stop_unknown_ok:
                return cri.StopContainerResponse()
            raise
        self.stop(container, exit_code=0 if request.timeout > 0 else EXIT_CODE_KILLED)
        return cri.StopContainerResponse()

    def stop(self, container: Container, *, exit_code: int, op: Op = Op.STOP, reason: str = "") -> None:
        """Move *container* by *op* (STOP, or EXIT: by itself); emits STOPPED unless it already was."""
        new_state = self._transition(container, op)
        if new_state == container.state:
            return
        reason = reason or ("Completed" if exit_code == 0 else "Error")
        stopped = attrs.evolve(
            container, state=new_state, finished_at=self.settings.clock(), exit_code=exit_code, reason=reason
        )
        self.tables.containers[container.id] = stopped
        self.tables.emit(
            container.id, EventType.CONTAINER_STOPPED_EVENT, self.tables.sandboxes[container.pod_sandbox_id]
        )

    def exit_container(self, container_id: str, exit_code: int, reason: str = "") -> None:
        """Simulate a RUNNING container's process ending by itself (e.g. ``OOMKilled``, 137)."""
        self.stop(self.tables.find_container(container_id), exit_code=exit_code, op=Op.EXIT, reason=reason)

    def remove_container(self, request: cri.RemoveContainerRequest) -> cri.RemoveContainerResponse:
        """Remove a container; emits DELETED.

        Unknown IDs succeed (containerd: "Do not return error if container metadata doesn't
        exist"); an empty ID or an ambiguous prefix does not. A RUNNING container is killed first (exit 137), as containerd does; with
        ``force_remove_running=False`` it is refused instead.
        """
        try:
            container = self.tables.find_container(request.container_id)
        except CriError as err:
            if err.code != Code.NOT_FOUND:
                raise
            return cri.RemoveContainerResponse()
        if container.state == ContainerState.CONTAINER_RUNNING:
            if not self.settings.force_remove_running:
                raise CriError(
                    Code.UNKNOWN,
                    f'failed to set removing state for container "{container.id}": '
                    "container is still running, to stop first",
                )
            self.stop(container, exit_code=EXIT_CODE_KILLED)
        self.remove(self.tables.containers[container.id])
        return cri.RemoveContainerResponse()

    def remove(self, container: Container) -> None:
        """Forget *container* (its caller stopped it); emits DELETED."""
        self.tables.drop_container(container)
        self.tables.emit(
            container.id, EventType.CONTAINER_DELETED_EVENT, self.tables.sandboxes[container.pod_sandbox_id]
        )

    def list_containers(self, request: cri.ListContainersRequest) -> cri.ListContainersResponse:
        """Containers matching every given filter (ID or ID prefix, state, pod, labels)."""
        return cri.ListContainersResponse(
            containers=[
                self.tables.container_message(c)
                for c in self.tables.unordered(self.tables.select_containers(request.filter))
            ]
        )

    def container_status(self, request: cri.ContainerStatusRequest) -> cri.ContainerStatusResponse:
        """Status with timestamps (ns), exit code, reason and the current Linux resources."""
        container = self.tables.find_container(request.container_id)
        return cri.ContainerStatusResponse(
            status=self.tables.container_status(container),
            info=self.tables.verbose_container(request, container),
        )

    def update_container_resources(
        self, request: cri.UpdateContainerResourcesRequest
    ) -> cri.UpdateContainerResourcesResponse:
        """Apply the new Linux resources (in any state, as containerd updates the spec regardless).

        Like containerd's ``WithResources``, only the fields the request sets (non-zero, non-empty)
        change; ``unified`` entries are added or overwritten; ``oom_score_adj`` is not updatable.
        """
        container = self.tables.find_container(request.container_id)
        resources = container.resources
        if request.linux is not None:
            resources = clone(resources) if resources is not None else cri.LinuxContainerResources()
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
        self.tables.containers[container.id] = attrs.evolve(container, resources=resources)
        return cri.UpdateContainerResourcesResponse()

    def exec_sync(self, request: cri.ExecSyncRequest) -> cri.ExecSyncResponse:
        """Answer a scripted result, or exit 0 with the command line echoed on stdout.

        Only RUNNING containers can exec; others are UNKNOWN "container is in ... state".
        """
        container = self.tables.find_container(request.container_id)
        if container.state != ContainerState.CONTAINER_RUNNING:
            raise CriError(Code.UNKNOWN, f"container is in {state_name(container.state)} state")
        result = self.tables.exec_scripts.get(tuple(request.cmd))
        if result is None:
            result = ExecResult(stdout=" ".join(request.cmd).encode())
        return cri.ExecSyncResponse(stdout=result.stdout, stderr=result.stderr, exit_code=result.exit_code)

    def _stats(self, container: Container) -> cri.ContainerStats:
        now = self.settings.clock()
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
        return cri.ContainerStatsResponse(stats=self._stats(self.tables.find_container(request.container_id)))

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
            stats=[self._stats(self.tables.containers[c.id]) for c in selected.containers]
        )
