"""The hook server application: plugins, rules, the pods it knows about, and the executor.

Everything here is synchronous: a hook call is "build the context, run the stage's
functions, apply, answer", with no awaits, so it runs unchanged in the served app's worker thread
(``_service.AppWorker``), in the standalone reconcile loop and in unit tests. The socket glue
lives in ``_service`` and ``_standalone``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs

from krproxy import log
from krproxy.proto.runtime import v1alpha1 as pb

from ._context import ContainerContext, ContainerInfo, PodContext, PodInfo
from ._done import (
    CgroupMissingError,
    apply_container,
    apply_pod,
    container_response,
    container_writes_something,
    order_quota_writes,
    pod_response,
    who,
    writes_something,
)
from ._executor import Change, Executor
from ._features import Features, FeatureStatus, NodeProbe, StatusFn
from ._policy import NodePolicy
from ._registry import FailurePolicy, Hook, Level, Registry, RunResult, Stage, call_hook, run_hooks
from ._rules import Rules

#: Seconds between two reconciliations in standalone mode (koordlet's
#: ``--runtime-hooks-reconcile-interval`` default).
RECONCILE_INTERVAL = 10.0

LOGGER = logging.getLogger("krproxy.hookserver")

F = TypeVar("F", bound=Callable[..., Any])
Ctx = TypeVar("Ctx", PodContext, ContainerContext)

#: Seconds between attempts at settings whose cgroup did not exist yet (a pod's cgroup appears
#: when the runtime starts the sandbox, after PreRunPodSandbox answered).
RETRY_INTERVAL = 1.0
#: Seconds after which such settings are given up (logged as an error): the pod never started.
PENDING_TIMEOUT = 300.0

#: Where the executor writes unless told otherwise.
DEFAULT_CGROUP_ROOT = "/sys/fs/cgroup"
DEFAULT_RESCTRL_ROOT = "/sys/fs/resctrl"


@attrs.frozen
class PodTarget:
    """A pod and its known containers, as reconcilers see them."""

    pod: PodInfo
    containers: tuple[ContainerInfo, ...] = ()


def _pod_key(pod: PodInfo) -> str:
    return pod.meta.uid or pod.cgroup_parent


@attrs.define
class PodCache:
    """The pods (and containers) a hook server has seen; the targets of a re-apply."""

    _pods: dict[str, PodInfo] = attrs.Factory(dict)
    _containers: dict[str, dict[str, ContainerInfo]] = attrs.Factory(dict)

    def add_pod(self, pod: PodInfo) -> None:
        key = _pod_key(pod)
        self._pods[key] = pod
        self._containers.setdefault(key, {})

    def remove_pod(self, pod: PodInfo) -> None:
        key = _pod_key(pod)
        self._pods.pop(key, None)
        self._containers.pop(key, None)

    def add_container(self, container: ContainerInfo) -> None:
        if not container.id:
            return
        key = _pod_key(container.pod)
        if key not in self._pods:
            self.add_pod(container.pod)
        self._containers[key][container.id] = container

    def remove_container(self, container: ContainerInfo) -> None:
        self._containers.get(_pod_key(container.pod), {}).pop(container.id, None)

    def replace(self, targets: Sequence[PodTarget]) -> None:
        """Forget everything and take ``targets`` (standalone mode's listing)."""
        self._pods.clear()
        self._containers.clear()
        for target in targets:
            self.add_pod(target.pod)
            for container in target.containers:
                self.add_container(container)

    def targets(self) -> tuple[PodTarget, ...]:
        return tuple(
            PodTarget(pod, tuple(self._containers.get(key, {}).values())) for key, pod in self._pods.items()
        )


@attrs.frozen
class Ticker:
    """A periodic plugin task: ``fn(targets)`` returns True when settings must be re-applied."""

    name: str
    interval: float
    fn: Callable[[Sequence[PodTarget]], bool] = attrs.field(hash=False)


@attrs.frozen
class Pending:
    """Settings computed at a hook call whose cgroup did not exist yet; ``since`` is the clock's time;
    ``include_cri`` whether the CRI-expressible ones are written too (as at that call)."""

    ctx: PodContext | ContainerContext
    since: float
    include_cri: bool = True


def _who(ctx: PodContext | ContainerContext) -> str:
    if isinstance(ctx, PodContext):
        return who(ctx.request)
    return who(ctx.request.pod, ctx.request.name)


def _changed(value: Any) -> dict[str, Any]:
    """The fields of a response that a plugin set (not None, not empty)."""
    out: dict[str, Any] = {}
    for key, field in attrs.asdict(value, recurse=False).items():
        if attrs.has(type(field)):
            out.update({f"{key}.{k}": v for k, v in _changed(field).items()})
        elif field is not None and field != {}:
            out[key] = field
    return out


#: Each stage's name (``Stage.value`` is a property of the enum's: two Python calls a hook call).
_NAMES = {stage: stage.value for stage in Stage}


def _log_decision(stage: Stage, ctx: PodContext | ContainerContext, result: RunResult) -> None:
    """The line logged at debug level for each hook call (its callers check the level first: one
    call fewer per hook call when it is off): who, which functions ran, what they decided."""
    log.debug(
        LOGGER,
        "hook_decision",
        stage=stage.value,
        pod=_who(ctx),
        ran=",".join(result.ran),
        failed=",".join(result.failed),
        changes=_changed(ctx.response),
    )


def _default_executor() -> Executor:
    return Executor.for_roots(DEFAULT_CGROUP_ROOT, DEFAULT_RESCTRL_ROOT)


@attrs.define
class HookServer:
    """A hook server: register plugin functions on it, then serve it (or run it standalone).

    Attributes:
        plugin_failure_policy: FAIL stops a stage at the first raising function and answers
            the hook call with an error; IGNORE logs and goes on (koordlet's default).
    """

    executor: Executor = attrs.Factory(_default_executor)
    plugin_failure_policy: FailurePolicy = FailurePolicy.IGNORE
    registry: Registry = attrs.Factory(Registry)
    rules: Rules = attrs.Factory(Rules)
    pods: PodCache = attrs.Factory(PodCache)
    tickers: list[Ticker] = attrs.Factory(list)
    features: Features = attrs.Factory(Features)
    policy: NodePolicy | None = None
    #: Settings waiting for their cgroup, by ``pod:<key>`` / ``container:<id>``.
    pending: dict[str, Pending] = attrs.Factory(dict)
    clock: Callable[[], float] = attrs.field(default=time.monotonic, hash=False)

    def __attrs_post_init__(self) -> None:
        self.rules.on_update(lambda: self._reapply("policy"))

    # -- registration ----------------------------------------------------------------------

    def hook(
        self, stage: Stage, *, name: str | None = None, description: str = "", blocking: bool | None = None
    ) -> Callable[[F], F]:
        """Decorator: run the function at ``stage`` (a PodContext or ContainerContext argument).

        A plain function is taken as blocking unless declared ``blocking=False``: served, a stage
        with a blocking function runs in the app's worker thread, one of non-blocking (and ``async
        def``) functions only on the event loop, without a thread (docs/plugin-authoring.md).
        """

        def register(fn: F) -> F:
            self.registry.register(
                stage, name or fn.__name__, description or (fn.__doc__ or ""), fn, blocking=blocking
            )
            return fn

        return register

    def reconciler(self, level: Level, *, name: str | None = None, description: str = "") -> Callable[[F], F]:
        """Decorator: run the function for every known pod/container on re-apply and in standalone."""

        def register(fn: F) -> F:
            self.registry.register_reconciler(
                level, name or fn.__name__, description or (fn.__doc__ or ""), fn
            )
            return fn

        return register

    def rule(self, name: str, description: str = "") -> Callable[[F], F]:
        """Decorator: ``fn(policy) -> bool`` parses the node policy, True when it changed."""

        def register(fn: F) -> F:
            self.rules.register(name, description, fn)
            return fn

        return register

    def every(self, interval: float, *, name: str) -> Callable[[F], F]:
        """Decorator: call ``fn(targets) -> bool`` every ``interval`` s; True re-applies."""

        def register(fn: F) -> F:
            self.tickers.append(Ticker(name, interval, fn))
            return fn

        return register

    def feature(self, name: str, status: StatusFn) -> None:
        """Report ``status(policy)`` (a :class:`FeatureStatus`) at start and on every policy change."""
        self.features.register(name, status)

    @property
    def probe(self) -> NodeProbe:
        """Kernel files on this node, for status functions."""
        return NodeProbe(self.executor)

    def report_features(self) -> list[FeatureStatus]:
        """Log (one line each) and export whether each feature is active here, and why."""
        return self.features.report(self.policy)

    # -- hook calls (proxy mode) -----------------------------------------------------------

    def handle_pod(self, stage: Stage, req: pb.PodSandboxHookRequest) -> pb.PodSandboxHookResponse:
        """Answer a pod-level hook call. Raises :class:`HookFailedError` under FAIL.

        Pod-level settings whose cgroup does not exist yet are kept and retried
        (:meth:`retry_pending`) until it does.
        """
        return pod_response(req, self.run_pod(stage, PodInfo.from_proto(req)))

    def run_pod(self, stage: Stage, pod: PodInfo) -> PodContext:
        """:meth:`handle_pod` without the wire types: the call's context, whose ``response`` holds
        what the plugins decided (the served SDK encodes the answer itself, ``_wire``)."""
        ctx = PodContext(pod)
        self.finish_pod(stage, ctx, self.run_stage(stage, ctx))
        return ctx

    def run_stage(
        self, stage: Stage, ctx: Ctx, call: Callable[[Hook[Ctx], Ctx], None] = call_hook
    ) -> RunResult:
        """The first half of a hook call: ``stage``'s plugin functions on ``ctx``, each through
        ``call`` (:func:`run_hooks`); :meth:`finish_pod` or :meth:`finish_container` is the second."""
        return run_hooks(
            self.registry.hooks(stage), ctx, self.plugin_failure_policy, where=_NAMES[stage], call=call
        )

    def finish_pod(self, stage: Stage, ctx: PodContext, result: RunResult) -> None:
        """The second half of a pod-level hook call, once the plugins decided (``result``): the pod
        cache, then the settings written (or deferred until the cgroup exists)."""
        if LOGGER.isEnabledFor(logging.DEBUG):
            _log_decision(stage, ctx, result)
        key = "pod:" + _pod_key(ctx.request)
        if stage is Stage.POST_STOP_POD_SANDBOX:
            self.pods.remove_pod(ctx.request)
            self.pending.pop(key, None)
        elif stage in (Stage.PRE_RUN_POD_SANDBOX, Stage.PRE_UPDATE_POD_SANDBOX_RESOURCES):
            # Remembered first: a write the kernel refuses fails this call, but re-applies
            # (policy change, CPU suppress) must still reach the pod. A resize refreshes the record
            # (it now carries the pod's resources).
            self.pods.add_pod(ctx.request)
        # A resize's CRI-expressible changes travel in the answer, to the runtime.
        include_cri = stage is not Stage.PRE_UPDATE_POD_SANDBOX_RESOURCES
        try:
            apply_pod(self.executor, ctx, include_cri=include_cri)
        except CgroupMissingError as exc:
            if stage is not Stage.POST_STOP_POD_SANDBOX:
                self._defer(key, ctx, exc, include_cri=include_cri)

    def finish_touches_files(self, stage: Stage, ctx: PodContext | ContainerContext) -> bool:
        """Whether :meth:`finish_pod` / :meth:`finish_container` may read or write files on the node
        for ``ctx`` (settings to write, or settings waiting for their cgroup to retry); False: it only
        updates the app's records, in microseconds."""
        if isinstance(ctx, PodContext):
            include_cri = stage is not Stage.PRE_UPDATE_POD_SANDBOX_RESOURCES
            return bool(ctx.request.cgroup_parent) and writes_something(
                ctx.response.resources, include_cri=include_cri
            )
        return bool(self.pending) or container_writes_something(ctx, include_cri=False)

    def handle_container(
        self, stage: Stage, req: pb.ContainerResourceHookRequest
    ) -> pb.ContainerResourceHookResponse:
        """Answer a container-level hook call. Raises :class:`HookFailedError` under FAIL."""
        return container_response(req, self.run_container(stage, ContainerInfo.from_proto(req)))

    def run_container(self, stage: Stage, container: ContainerInfo) -> ContainerContext:
        """:meth:`handle_container` without the wire types (see :meth:`run_pod`)."""
        ctx = ContainerContext(container)
        self.finish_container(stage, ctx, self.run_stage(stage, ctx))
        return ctx

    def finish_container(self, stage: Stage, ctx: ContainerContext, result: RunResult) -> None:
        """The second half of a container-level hook call (see :meth:`finish_pod`)."""
        if LOGGER.isEnabledFor(logging.DEBUG):
            _log_decision(stage, ctx, result)
        if self.pending:  # the pod's cgroup exists by the time its containers are created
            self.retry_pending()
        key = "container:" + ctx.request.id
        if stage is not Stage.POST_STOP_CONTAINER:
            self.pods.add_container(ctx.request)  # first, as for pods: a refused write still fails the call
        try:
            apply_container(self.executor, ctx, include_cri=False)
        except CgroupMissingError as exc:
            if stage is not Stage.POST_STOP_CONTAINER:
                self._defer(key, ctx, exc, include_cri=False)
        if stage is Stage.POST_STOP_CONTAINER:
            self.pods.remove_container(ctx.request)
            self.pending.pop(key, None)

    # -- settings waiting for their cgroup -------------------------------------------------------

    def _defer(
        self, key: str, ctx: PodContext | ContainerContext, exc: CgroupMissingError, *, include_cri: bool
    ) -> None:
        self.pending[key] = Pending(ctx, self.clock(), include_cri)
        log.event(LOGGER, "cgroup_write_deferred", pod=_who(ctx), reason=str(exc), retry_every=RETRY_INTERVAL)

    def retry_pending(self) -> list[Change]:
        """Apply the settings still waiting for their cgroup, then re-apply those pods (a re-apply
        made meanwhile could not reach them); give up on those older than :data:`PENDING_TIMEOUT`
        (logged as an error). Every outcome is logged."""
        changes: list[Change] = []
        retried: set[str] = set()
        now = self.clock()
        for key, pending in list(self.pending.items()):
            ctx = pending.ctx
            try:
                if isinstance(ctx, PodContext):
                    done = apply_pod(self.executor, ctx, include_cri=pending.include_cri)
                else:
                    done = apply_container(self.executor, ctx, include_cri=pending.include_cri)
            except CgroupMissingError as exc:
                if now - pending.since >= PENDING_TIMEOUT:
                    del self.pending[key]
                    log.error(
                        LOGGER,
                        "cgroup_write_abandoned",
                        pod=_who(ctx),
                        waited=round(now - pending.since, 1),
                        reason=str(exc),
                    )
                continue
            except OSError as exc:
                del self.pending[key]
                log.error(LOGGER, "cgroup_write_failed", pod=_who(ctx), error=str(exc))
                continue
            del self.pending[key]
            changes += done
            log.event(LOGGER, "cgroup_write_retried", pod=_who(ctx), changes=len(done))
            retried.add(_pod_key(ctx.request if isinstance(ctx, PodContext) else ctx.request.pod))
        if retried:
            # What was computed at the hook call may be older than a re-apply (policy change,
            # CPU suppress) that could not reach the missing cgroup meanwhile: re-apply now.
            changes += self.reconcile([t for t in self.pods.targets() if _pod_key(t.pod) in retried])
        return changes

    # -- re-apply (policy change, tickers, standalone) ---------------------------------------

    def reconcile(self, targets: Sequence[PodTarget] | None = None) -> list[Change]:
        """Run the reconcilers for every target (default: all known pods) and write the results.

        Everything goes through the executor here, CRI-expressible settings included, in an
        order cgroup v1 accepts (:func:`order_quota_writes`). A failing reconciler or write is
        logged, naming the pod, file and value; the other writes and pods still go ahead.
        """
        changes: list[Change] = []
        for target in self.pods.targets() if targets is None else targets:
            pod_ctx = PodContext(target.pod)
            run_hooks(
                self.registry.reconcilers(Level.POD), pod_ctx, FailurePolicy.IGNORE, where="reconcile-pod"
            )
            ctxs = [ContainerContext(c) for c in target.containers]
            for ctx in ctxs:
                run_hooks(
                    self.registry.reconcilers(Level.CONTAINER),
                    ctx,
                    FailurePolicy.IGNORE,
                    where="reconcile-container",
                )
            before, after = order_quota_writes(self.executor, pod_ctx, ctxs)
            for ctx in before:
                changes += self._write(ctx)
            changes += self._write(pod_ctx)
            for ctx in after:
                changes += self._write(ctx)
        return changes

    def _write(self, ctx: PodContext | ContainerContext) -> list[Change]:
        try:
            if isinstance(ctx, PodContext):
                return apply_pod(self.executor, ctx)
            return apply_container(self.executor, ctx, include_cri=True)
        except CgroupMissingError as exc:
            log.event(LOGGER, "cgroup_missing", pod=_who(ctx), reason=str(exc))
        except OSError as exc:
            log.error(LOGGER, "reconcile_failed", pod=_who(ctx), error=str(exc))
        return []

    def set_policy(self, policy: NodePolicy) -> tuple[str, ...]:
        """Take a new node policy: rules parse it; if any changed, all pods are re-applied.

        Every feature's status is reported for the new policy first.
        """
        self.policy = policy
        self.report_features()
        return self.rules.update(policy)

    def tick(self, ticker: Ticker) -> list[Change]:
        """Run one periodic task; re-apply when it says so."""
        try:
            changed = ticker.fn(self.pods.targets())
        except Exception as exc:
            log.error(LOGGER, "ticker_failed", ticker=ticker.name, error=repr(exc))
            return []
        return self._reapply(f"ticker:{ticker.name}") if changed else []

    def _reapply(self, cause: str) -> list[Change]:
        """Reconcile every known pod and log what it wrote and why (policy change, a ticker)."""
        changes = self.reconcile()
        log.event(LOGGER, "reapplied", cause=cause, pods=len(self.pods.targets()), changes=len(changes))
        return changes
