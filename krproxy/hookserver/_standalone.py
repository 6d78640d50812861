"""Standalone mode: the same plugins without a proxy, applied by a reconcile loop.

Every ``interval`` seconds (and right away when the policy changes) the loop lists pod
sandboxes and containers from the CRI runtime and runs the reconcilers on them; the
executor writes everything, CRI-expressible settings included.

Trade-off (as koordlet's reconciler): it is asynchronous. A container starts with the
runtime's settings and gets ours up to one ``interval`` later; settings that only exist at
creation (environment variables) cannot be applied at all; a setting someone else changes
is corrected only at the next pass. Use the proxy mode for strict consistency at start.

The pod's cgroup parent is not in the CRI's status fields; it is read from the runtime's
verbose sandbox info (containerd: ``info["info"]`` JSON → ``config.linux.cgroup_parent``, or
the sandbox's ``runtimeSpec.linux.cgroupsPath``); failing that, kubelet's usual places
(``/kubepods[/burstable|/besteffort]/pod<uid>`` or the systemd slices) are looked up under the
cgroup root. Pods without one get no cgroup writes. A container's own cgroup is read the same way,
from the verbose container status (``runtimeSpec.linux.cgroupsPath``); failing that, the SDK looks
for the runtimes' naming under the pod's cgroup (``find_container_cgroup``).

Only the pods a :class:`PodSelector` selects are touched: by default those with Koordinator's QoS
label (``koordinator.sh/qosClass``) — on a shared node other tenants' pods are not ours to
change — optionally narrowed to namespaces and labels.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import trio

from krproxy import log, rpc
from krproxy.grpcstatus import GRPCError
from krproxy.hooks.convert import cgroup_parent_from_verbose, cgroups_path_from_verbose
from krproxy.hooks.points import CRI_RUNTIME_SERVICE
from krproxy.proto.runtime import v1 as cri

from ._app import RECONCILE_INTERVAL, HookServer, PodTarget
from ._cgroups import kubelet_pod_cgroup_candidates, pod_cgroup_dir
from ._context import QOS_LABEL, ContainerInfo, PodInfo, PodMeta, Resources
from ._executor import Executor
from ._service import AppWorker, run_background

LOGGER = logging.getLogger("krproxy.hookserver.standalone")

#: Deadline of each CRI call (s); a runtime slower than this is skipped until the next pass.
CRI_TIMEOUT = 10.0

M = TypeVar("M")


async def _cri_call(channel: rpc.Channel, method: str, request: Any, reply_type: type[M]) -> M:
    """One unary CRI RuntimeService call, ``method`` by name (e.g. ``"ListPodSandbox"``)."""
    path = f"/{CRI_RUNTIME_SERVICE}/{method}"
    reply = await channel.unary(path, bytes(request.SerializeToString()), timeout=CRI_TIMEOUT)
    return reply_type.FromString(reply)  # type: ignore[attr-defined,no-any-return]


def _strings(values: Iterable[str]) -> frozenset[str]:
    return frozenset(values)


def _labels(values: Mapping[str, str]) -> dict[str, str]:
    return dict(values)


@attrs.frozen
class PodSelector:
    """Which pods standalone mode acts on.

    Attributes:
        namespaces: only pods in these namespaces (empty: any namespace).
        labels: only pods with all these labels at these values.
        qos_labelled: only pods with Koordinator's QoS label (the default).
    """

    namespaces: frozenset[str] = attrs.field(default=frozenset(), converter=_strings)
    labels: Mapping[str, str] = attrs.field(factory=dict, converter=_labels)
    qos_labelled: bool = True

    @classmethod
    def parse(
        cls, namespaces: Iterable[str], selectors: Iterable[str], *, all_pods: bool = False
    ) -> PodSelector:
        """From ``--namespace`` values and ``--selector key=value[,key=value]`` values (``==``
        as kubectl takes it; ``!=`` and set-based terms are refused).

        Raises:
            ValueError: a selector term is not ``key=value``.
        """
        labels: dict[str, str] = {}
        for selector in selectors:
            for term in filter(None, (t.strip() for t in selector.split(","))):
                key, eq, value = term.partition("=")
                key, value = key.strip(), value.removeprefix("=").strip()  # kubectl's == too
                if key.endswith("!"):
                    raise ValueError(
                        f"label selector term {term!r}: only key=value (or key==value) is supported"
                    )
                if not eq or not key:
                    raise ValueError(f"label selector term {term!r} is not key=value (e.g. app=batch)")
                if labels.get(key, value) != value:
                    raise ValueError(
                        f"label {key!r} is given two values ({labels[key]!r} and {value!r}): no pod has both"
                    )
                labels[key] = value
        return cls(frozenset(namespaces), labels, not all_pods)

    def matches(self, pod: PodInfo) -> bool:
        if self.qos_labelled and QOS_LABEL not in pod.labels:
            return False
        if self.namespaces and pod.meta.namespace not in self.namespaces:
            return False
        return all(pod.labels.get(k) == v for k, v in self.labels.items())

    def describe(self) -> str:
        parts = [f"label {QOS_LABEL}" if self.qos_labelled else "all pods"]
        if self.namespaces:
            parts.append("namespaces " + ",".join(sorted(self.namespaces)))
        if self.labels:
            parts.append("labels " + ",".join(f"{k}={v}" for k, v in sorted(self.labels.items())))
        return "; ".join(parts)


def cgroup_parent_from_info(info: Mapping[str, str], sandbox_id: str) -> str:
    """The sandbox's cgroup parent from containerd's verbose ``PodSandboxStatus`` info ("" if absent);
    the proxy's own recovery reads it the same way."""
    return cgroup_parent_from_verbose(info, sandbox_id)


def targets_from_cri(
    sandboxes: Sequence[cri.PodSandbox],
    sandbox_info: Mapping[str, Mapping[str, str]],
    containers: Sequence[cri.Container],
    statuses: Mapping[str, cri.ContainerStatus],
    *,
    find_cgroup_parent: Callable[[str], str] | None = None,
    container_info: Mapping[str, Mapping[str, str]] | None = None,
) -> list[PodTarget]:
    """Ready sandboxes and their running containers as reconcile targets.

    ``find_cgroup_parent(uid)`` is asked when the runtime's info has no cgroup parent.
    ``container_info`` (by container id: a verbose ``ContainerStatus`` info map) gives each
    container's cgroup as the runtime made it (:attr:`ContainerInfo.cgroup_path`).
    """
    pods: dict[str, PodInfo] = {}
    for sb in sandboxes:
        if sb.state != cri.PodSandboxState.SANDBOX_READY:
            continue
        meta = sb.metadata
        parent = cgroup_parent_from_info(sandbox_info.get(sb.id, {}), sb.id)
        if not parent and find_cgroup_parent is not None and meta is not None:
            parent = find_cgroup_parent(meta.uid)
        pods[sb.id] = PodInfo(
            meta=PodMeta(meta.name, meta.namespace, meta.uid, meta.attempt) if meta else PodMeta(),
            labels=sb.labels,
            annotations=sb.annotations,
            cgroup_parent=parent,
            runtime_handler=sb.runtime_handler,
        )
    by_pod: dict[str, list[ContainerInfo]] = {sid: [] for sid in pods}
    for c in containers:
        if c.pod_sandbox_id not in pods or c.state != cri.ContainerState.CONTAINER_RUNNING:
            continue
        status = statuses.get(c.id)
        linux = status.resources.linux if status is not None and status.resources is not None else None
        by_pod[c.pod_sandbox_id].append(
            ContainerInfo(
                pod=pods[c.pod_sandbox_id],
                name=c.metadata.name if c.metadata else "",
                id=c.id,
                attempt=c.metadata.attempt if c.metadata else 0,
                annotations=c.annotations,
                resources=Resources.from_proto(linux),
                cgroup_path=cgroups_path_from_verbose((container_info or {}).get(c.id)),
            )
        )
    return [PodTarget(pod, tuple(by_pod[sid])) for sid, pod in pods.items()]


def find_kubelet_cgroup(executor: Executor, uid: str) -> str:
    """The first of kubelet's usual pod cgroups for ``uid`` that exists under the executor's root."""
    for candidate in kubelet_pod_cgroup_candidates(uid):
        if executor.cgroup_exists(pod_cgroup_dir(candidate)):
            return candidate
    return ""


async def list_targets(
    channel: rpc.Channel, find_cgroup_parent: Callable[[str], str] | None = None
) -> list[PodTarget]:
    """List pods and containers from the runtime behind ``channel``."""
    sandboxes = (
        await _cri_call(channel, "ListPodSandbox", cri.ListPodSandboxRequest(), cri.ListPodSandboxResponse)
    ).items
    info: dict[str, Mapping[str, str]] = {}
    for sb in sandboxes:
        if sb.state == cri.PodSandboxState.SANDBOX_READY:
            req = cri.PodSandboxStatusRequest(pod_sandbox_id=sb.id, verbose=True)
            info[sb.id] = (
                await _cri_call(channel, "PodSandboxStatus", req, cri.PodSandboxStatusResponse)
            ).info
    listed = await _cri_call(
        channel, "ListContainers", cri.ListContainersRequest(), cri.ListContainersResponse
    )
    containers = listed.containers
    statuses: dict[str, cri.ContainerStatus] = {}
    container_info: dict[str, Mapping[str, str]] = {}
    for c in containers:
        if c.state == cri.ContainerState.CONTAINER_RUNNING and c.pod_sandbox_id in info:
            resp = await _cri_call(
                channel,
                "ContainerStatus",
                cri.ContainerStatusRequest(container_id=c.id, verbose=True),
                cri.ContainerStatusResponse,
            )
            if resp.status is not None:
                statuses[c.id] = resp.status
            container_info[c.id] = resp.info
    return targets_from_cri(
        sandboxes,
        info,
        containers,
        statuses,
        find_cgroup_parent=find_cgroup_parent,
        container_info=container_info,
    )


async def reconcile_once(
    app: HookServer, channel: rpc.Channel, worker: AppWorker, selector: PodSelector | None = None
) -> bool:
    """One pass: list, select, remember, reconcile (on ``worker``). False (and logged) when the
    runtime did not answer."""
    selector = PodSelector() if selector is None else selector
    try:
        find = functools.partial(find_kubelet_cgroup, app.executor)
        listed = await list_targets(channel, find)
    except (GRPCError, OSError) as exc:
        log.warning(LOGGER, "cri_list_failed", error=_describe(exc))
        return False
    targets = [t for t in listed if selector.matches(t.pod)]

    def take() -> int:
        app.pods.replace(targets)
        return len(app.reconcile())

    changes = await worker.run(take)
    log.event(
        LOGGER, "reconciled", pods=len(targets), not_selected=len(listed) - len(targets), changes=changes
    )
    return True


def _describe(exc: Exception) -> str:
    if isinstance(exc, GRPCError):
        return f"{exc.status.name}: {exc.message}"
    return repr(exc)


async def run_standalone(
    app: HookServer,
    cri_endpoint: str,
    *,
    interval: float = RECONCILE_INTERVAL,
    policy_path: str | None = None,
    selector: PodSelector | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Reconcile the pods ``selector`` selects (default: Koordinator-QoS-labelled ones) forever.

    Ready (``started()``) after the policy is loaded and the first pass has run.
    """
    selector = PodSelector() if selector is None else selector
    channel = rpc.Channel(cri_endpoint)
    log.event(
        LOGGER, "standalone_started", cri_endpoint=cri_endpoint, interval=interval, pods=selector.describe()
    )
    try:
        async with AppWorker.open() as worker, trio.open_nursery() as nursery:
            await run_background(app, policy_path, nursery, worker)
            await reconcile_once(app, channel, worker, selector)
            task_status.started()
            while True:
                await trio.sleep(interval)
                await reconcile_once(app, channel, worker, selector)
    finally:
        with trio.CancelScope(shield=True):
            await channel.aclose()
        log.event(LOGGER, "standalone_stopped", cri_endpoint=cri_endpoint)
