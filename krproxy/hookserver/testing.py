"""Helpers for testing hook plugins without a node: a fake cgroup/resctrl tree and requests.

Public on purpose (like ``structlog.testing``): plugin authors test their plugins with these.

    node = FakeNode(tmp_path).create()
    node.add_cgroup("/kubepods/besteffort/pod1")
    app = HookServer(executor=node.executor())

:class:`HookClient` calls a served app over its socket, as the proxy does.
"""

from __future__ import annotations

import errno
import logging
import os
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from krproxy import rpc
from krproxy.hooks.points import HookPoint
from krproxy.nri import PLUGIN_SERVICE
from krproxy.nri._session import TtrpcError
from krproxy.proto.nri.pkg.api import v1alpha1 as api
from krproxy.proto.runtime import v1alpha1 as pb

from ._cgroups import DEFAULT_CFS_PERIOD, CgroupFile, parse_cfs_period
from ._context import QOS_LABEL
from ._executor import Executor, write_cgroup_file
from .nri import NOTICES, NriStub, PluginError

_V1_DEFAULTS = {
    CgroupFile.CPU_SHARES: "1024",
    CgroupFile.CFS_QUOTA: "-1",
    CgroupFile.CFS_PERIOD: str(DEFAULT_CFS_PERIOD),
    CgroupFile.CPUSET_CPUS: "",
    CgroupFile.MEMORY_LIMIT: "9223372036854771712",
    CgroupFile.CPU_USAGE: "0",
}
_V2_DEFAULTS = {
    CgroupFile.CPU_SHARES: "100",
    CgroupFile.CFS_QUOTA: f"max {DEFAULT_CFS_PERIOD}",
    CgroupFile.CPUSET_CPUS: "",
    CgroupFile.MEMORY_LIMIT: "max",
    CgroupFile.CPU_USAGE: "usage_usec 0\nuser_usec 0\nsystem_usec 0",
}


@attrs.define
class FakeNode:
    """A directory that looks like ``/sys/fs/cgroup`` + ``/sys/fs/resctrl`` to the executor.

    Attributes:
        bvt / idle: whether cgroups get ``cpu.bvt_warp_ns`` / ``cpu.idle`` (kernel features).
        resctrl / mba: whether resctrl (``info/L3``) and memory bandwidth (``info/MB``) exist.
    """

    root: pathlib.Path = attrs.field(converter=pathlib.Path)
    cgroup_version: int = 2
    bvt: bool = True
    idle: bool = True
    resctrl: bool = True
    mba: bool = True
    cbm_mask: str = "fff"
    #: Refuse cgroup v1 CFS quota writes the kernel refuses (EINVAL): a child's above its parent's,
    #: a parent's below a child's (as shares of a CPU: quota / period).
    strict_quota: bool = False
    #: The CFS period (µs) new cgroups get (v1 ``cpu.cfs_period_us``, v2 the second field of ``cpu.max``).
    cfs_period: int = DEFAULT_CFS_PERIOD
    #: The node's online CPUs, as the root cgroup shows them (v1 ``cpuset.cpus`` and
    #: ``cpuset.effective_cpus``, v2 ``cpuset.cpus.effective``); None: no cpuset at the root.
    cpus: str | None = "0-7"

    @property
    def cgroup_root(self) -> pathlib.Path:
        return self.root / "cgroup"

    @property
    def resctrl_root(self) -> pathlib.Path:
        return self.root / "resctrl"

    def create(self) -> FakeNode:
        self.cgroup_root.mkdir(parents=True, exist_ok=True)
        self.resctrl_root.mkdir(parents=True, exist_ok=True)
        if self.cgroup_version == 2:
            (self.cgroup_root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
        if self.cpus is not None:
            files = [CgroupFile.CPUSET_EFFECTIVE]
            if self.cgroup_version == 1:  # v2's root has no cpuset.cpus
                files.append(CgroupFile.CPUSET_CPUS)
            for file in files:
                path = self.cgroup_root / file.path("", self.cgroup_version)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(self.cpus + "\n")
        if self.resctrl:
            (self.resctrl_root / "info" / "L3").mkdir(parents=True, exist_ok=True)
            (self.resctrl_root / "info" / "L3" / "cbm_mask").write_text(self.cbm_mask + "\n")
            (self.resctrl_root / "schemata").write_text(f"L3:0={self.cbm_mask}\n")
            if self.mba:
                (self.resctrl_root / "info" / "MB").mkdir(exist_ok=True)
        return self

    def executor(self) -> Executor:
        strict = self.strict_quota and self.cgroup_version == 1
        write = _write_under_v1_quota_rules if strict else write_cgroup_file
        return Executor(self.cgroup_root, self.resctrl_root, self.cgroup_version, write_cgroup=write)

    def add_cgroup(self, cgroup_dir: str, pids: Iterable[int] = (), *, cfs_period: int | None = None) -> None:
        """Create ``cgroup_dir`` with the files a kernel would show, at their default values (the CFS
        period: ``cfs_period``, else the node's)."""
        defaults = dict(_V1_DEFAULTS if self.cgroup_version == 1 else _V2_DEFAULTS)
        period = self.cfs_period if cfs_period is None else cfs_period
        if self.cgroup_version == 1:
            defaults[CgroupFile.CFS_PERIOD] = str(period)
        else:
            defaults[CgroupFile.CFS_QUOTA] = f"max {period}"
        if self.bvt:
            defaults[CgroupFile.CPU_BVT] = "0"
        if self.idle:
            defaults[CgroupFile.CPU_IDLE] = "0"
        defaults[CgroupFile.PROCS] = "".join(f"{p}\n" for p in pids)
        for file, value in defaults.items():
            path = self.cgroup_root / file.path(cgroup_dir, self.cgroup_version)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(value + "\n" if value and not value.endswith("\n") else value)

    def read(self, cgroup_dir: str, file: CgroupFile) -> str | None:
        path = self.cgroup_root / file.path(cgroup_dir, self.cgroup_version)
        return path.read_text().strip() if path.exists() else None

    def write(self, cgroup_dir: str, file: CgroupFile, value: str) -> None:
        (self.cgroup_root / file.path(cgroup_dir, self.cgroup_version)).write_text(value + "\n")

    def read_resctrl(self, rel: str) -> str | None:
        path = self.resctrl_root / rel
        return path.read_text().strip() if path.exists() else None


def _share_at(cgroup: pathlib.Path, quota: int | None = None) -> float:
    """A v1 cgroup's CFS limit as a share of a CPU (quota / period), -1 when unlimited or absent;
    ``quota`` instead of the file's."""
    try:
        if quota is None:
            quota = int((cgroup / "cpu.cfs_quota_us").read_text().strip() or "-1")
        period = parse_cfs_period((cgroup / "cpu.cfs_period_us").read_text(), 1)
    except (FileNotFoundError, ValueError):
        return -1
    return -1 if quota < 0 else quota / (period or DEFAULT_CFS_PERIOD)


def _write_under_v1_quota_rules(path: pathlib.Path, text: str) -> None:
    """An executor's cgroup writer that refuses what cgroup v1 refuses for ``cpu.cfs_quota_us`` (EINVAL).
    The kernel compares shares of a CPU, quota / period (``tg_cfs_schedulable_down``), not the raw quotas."""
    if path.name == "cpu.cfs_quota_us":
        new = _share_at(path.parent, int(text))
        parent = _share_at(path.parent.parent)
        children = [_share_at(c) for c in path.parent.iterdir() if c.is_dir()]
        if 0 <= parent < new or any(0 <= new < c for c in children):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
    write_cgroup_file(path, text)


def pod_request(
    name: str,
    *,
    uid: str | None = None,
    qos: str | None = None,
    cgroup_parent: str | None = None,
    annotations: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
) -> pb.PodSandboxHookRequest:
    """A PreRunPodSandbox-style request; the cgroup parent defaults to a cgroupfs BestEffort pod."""
    uid = uid or f"uid-{name}"
    all_labels = {"io.kubernetes.pod.name": name, **(labels or {})}
    if qos is not None:
        all_labels[QOS_LABEL] = qos
    return pb.PodSandboxHookRequest(
        pod_meta=pb.PodSandboxMetadata(name=name, uid=uid, namespace="default"),
        labels=all_labels,
        annotations=dict(annotations or {}),
        cgroup_parent=cgroup_parent or f"/kubepods/besteffort/pod{uid}",
    )


def container_request(
    pod: pb.PodSandboxHookRequest,
    name: str,
    *,
    id: str = "",
    resources: pb.LinuxContainerResources | None = None,
    envs: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> pb.ContainerResourceHookRequest:
    """A container-level request for a container of ``pod`` (``id`` empty before create); the pod's
    ``resources`` (a resized pod's) become ``pod_resources``, as the proxy sends them."""
    return pb.ContainerResourceHookRequest(
        pod_meta=pod.pod_meta,
        pod_resources=pod.resources,
        container_meta=pb.ContainerMetadata(name=name, id=id),
        container_annotations=dict(annotations or {}),
        container_resources=resources if resources is not None else pb.LinuxContainerResources(),
        pod_annotations=dict(pod.annotations),
        pod_labels=dict(pod.labels),
        pod_cgroup_parent=pod.cgroup_parent,
        container_envs=dict(envs or {}),
    )


def logged_events(records: Iterable[logging.LogRecord], name: str) -> list[dict[str, Any]]:
    """The fields of every ``name`` event in ``records`` (e.g. pytest's ``caplog.records``)."""
    return [
        dict(getattr(r, "krproxy_fields", {}))
        for r in records
        if getattr(r, "krproxy_fields", None) is not None and r.getMessage() == name
    ]


class HookClient:
    """Calls a hook server on its unix socket, as the proxy does (one :class:`krproxy.rpc.Channel`)::

        async with HookClient(socket) as client:
            answer = await client.call(Stage.PRE_RUN_POD_SANDBOX, pod_request("web"))

    An error status raises :class:`krproxy.grpcstatus.GRPCError`.
    """

    def __init__(self, socket: str) -> None:
        self.channel = rpc.Channel(socket)

    async def call(self, stage: HookPoint, request: Any, *, seconds: float = 5.0) -> Any:
        """``stage``'s hook call with ``request``, answered within ``seconds`` (its grpc-timeout);
        the answer decoded (:class:`PodSandboxHookResponse` or :class:`ContainerResourceHookResponse`)."""
        reply = await self.channel.unary(stage.rpc_path, bytes(request.SerializeToString()), timeout=seconds)
        reply_type = pb.PodSandboxHookResponse if stage.is_pod_level else pb.ContainerResourceHookResponse
        return reply_type.FromString(reply)

    async def aclose(self) -> None:
        await self.channel.aclose()

    async def __aenter__(self) -> HookClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


@attrs.define
class NriEvents:
    """NRI's calls to an :class:`~krproxy.hookserver.nri.NriStub`'s handlers, without a runtime.

    Each call goes through the stub's own method table, serialized both ways as on the wire; a handler's
    failure raises :class:`~krproxy.hookserver.nri.PluginError` with the message the runtime would get.
    ``nri_version=""`` plays a runtime before NRI 0.12 (events without an answer come as StateChange).

        events = NriEvents(stub)
        answer = await events.create_container(pod, container)
        assert answer.adjust.env[0].key == "MODE"
    """

    stub: NriStub
    nri_version: str = "v0.12.2"

    async def call(self, method: str, request: Any, reply_type: type[Any]) -> Any:

        handler = self.stub._methods().get((PLUGIN_SERVICE, method))
        if handler is None:
            raise PluginError(f"plugin {self.stub.full_name} does not implement {method}")
        try:
            # a plain handler's answer comes at once (as the session takes it), an async one's awaited
            answer = handler(bytes(request))
            if not isinstance(answer, bytes):
                answer = await answer
            return reply_type.parse(answer)
        except TtrpcError as exc:
            raise PluginError(exc.message) from None

    async def configure(self) -> int:
        """Configure the stub as the runtime would; the event mask it subscribes."""

        request = api.ConfigureRequest(runtime_name="test", runtime_version="0", NRI_version=self.nri_version)
        return int((await self.call("Configure", request, api.ConfigureResponse)).events)

    async def synchronize(self, pods: Iterable[Any] = (), containers: Iterable[Any] = ()) -> Any:

        request = api.SynchronizeRequest(pods=list(pods), containers=list(containers))
        return await self.call("Synchronize", request, api.SynchronizeResponse)

    async def create_container(self, pod: Any, container: Any) -> Any:

        request = api.CreateContainerRequest(pod=pod, container=container)
        return await self.call("CreateContainer", request, api.CreateContainerResponse)

    async def update_container(self, pod: Any, container: Any, resources: Any) -> Any:

        request = api.UpdateContainerRequest(pod=pod, container=container, linux_resources=resources)
        return await self.call("UpdateContainer", request, api.UpdateContainerResponse)

    async def stop_container(self, pod: Any, container: Any) -> Any:

        request = api.StopContainerRequest(pod=pod, container=container)
        return await self.call("StopContainer", request, api.StopContainerResponse)

    async def update_pod_sandbox(self, pod: Any, resources: Any = None, overhead: Any = None) -> Any:

        request = api.UpdatePodSandboxRequest(
            pod=pod, linux_resources=resources, overhead_linux_resources=overhead
        )
        return await self.call("UpdatePodSandbox", request, api.UpdatePodSandboxResponse)

    async def validate(self, request: Any) -> Any:
        """ValidateContainerAdjustment with *request* (an ``api.ValidateContainerAdjustmentRequest``)."""

        return await self.call(
            "ValidateContainerAdjustment", request, api.ValidateContainerAdjustmentResponse
        )

    async def event(self, event: Any, pod: Any, container: Any = None) -> None:
        """An event without an answer (``api.Event.RUN_POD_SANDBOX``, ...): NRI 0.12's method, or StateChange."""

        method, request_type = NOTICES[event]
        if not self.nri_version:
            if not self.stub.events(False) & (1 << (event - 1)):
                return
            request = api.StateChangeEvent(event=event, pod=pod, container=container)
            await self.call("StateChange", request, api.Empty)
            return
        if not self.stub.events() & (1 << (event - 1)):
            return  # not subscribed: the runtime does not call it
        args = {"pod": pod} if container is None else {"pod": pod, "container": container}
        await self.call(method, request_type(**args), api.Empty)
