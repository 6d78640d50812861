"""gRPC glue: ``RuntimeHookService`` on a unix socket, plus the registration file.

The handlers run on the asyncio side of trio-asyncio; they call the synchronous
:class:`HookServer` methods directly (no trio hop per call).
"""

from __future__ import annotations

import logging

import attrs
import trio
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from krproxy import _grpc, log
from krproxy.proto.runtime import v1alpha1 as hook
from krproxy.proto.runtime.v1alpha1 import services as hook_services

from ._app import RETRY_INTERVAL, HookServer, Ticker
from ._policy import PolicyWatcher
from ._registration import registration_json, remove_registration, write_registration
from ._registry import FailurePolicy, HookFailedError, Stage

LOGGER = logging.getLogger("krproxy.hookserver")


class HookService(hook_services.RuntimeHookServiceBase):
    """Answers every hook point by running the app's plugins for that stage."""

    def __init__(self, app: HookServer) -> None:
        self.app = app

    def _pod(self, stage: Stage, req: hook.PodSandboxHookRequest) -> hook.PodSandboxHookResponse:
        try:
            return self.app.handle_pod(stage, req)
        except (HookFailedError, OSError) as exc:
            raise GRPCError(Status.UNKNOWN, str(exc)) from exc

    def _container(
        self, stage: Stage, req: hook.ContainerResourceHookRequest
    ) -> hook.ContainerResourceHookResponse:
        try:
            return self.app.handle_container(stage, req)
        except (HookFailedError, OSError) as exc:
            raise GRPCError(Status.UNKNOWN, str(exc)) from exc

    async def pre_run_pod_sandbox_hook(
        self, message: hook.PodSandboxHookRequest
    ) -> hook.PodSandboxHookResponse:
        return self._pod(Stage.PRE_RUN_POD_SANDBOX, message)

    async def post_stop_pod_sandbox_hook(
        self, message: hook.PodSandboxHookRequest
    ) -> hook.PodSandboxHookResponse:
        return self._pod(Stage.POST_STOP_POD_SANDBOX, message)

    async def pre_create_container_hook(
        self, message: hook.ContainerResourceHookRequest
    ) -> hook.ContainerResourceHookResponse:
        return self._container(Stage.PRE_CREATE_CONTAINER, message)

    async def pre_start_container_hook(
        self, message: hook.ContainerResourceHookRequest
    ) -> hook.ContainerResourceHookResponse:
        return self._container(Stage.PRE_START_CONTAINER, message)

    async def post_start_container_hook(
        self, message: hook.ContainerResourceHookRequest
    ) -> hook.ContainerResourceHookResponse:
        return self._container(Stage.POST_START_CONTAINER, message)

    async def post_stop_container_hook(
        self, message: hook.ContainerResourceHookRequest
    ) -> hook.ContainerResourceHookResponse:
        return self._container(Stage.POST_STOP_CONTAINER, message)

    async def pre_update_container_resources_hook(
        self, message: hook.ContainerResourceHookRequest
    ) -> hook.ContainerResourceHookResponse:
        return self._container(Stage.PRE_UPDATE_CONTAINER_RESOURCES, message)

    async def pre_update_pod_sandbox_resources_hook(
        self, message: hook.PodSandboxHookRequest
    ) -> hook.PodSandboxHookResponse:
        return self._pod(Stage.PRE_UPDATE_POD_SANDBOX_RESOURCES, message)


@attrs.frozen
class ServeOptions:
    """Where and how to serve.

    Attributes:
        socket: the unix socket to listen on.
        hook_dir: the proxy's registration directory (``/etc/runtime/hookserver.d``).
        name: the registration file is ``<hook_dir>/<name>.json``.
        endpoint: the socket path as the proxy sees it (differs when we run in a container);
            defaults to ``socket``.
        failure_policy: what the proxy does when this server fails (written in the file).
        policy_path: the node policy file to watch, if any.
        disabled_stages: stages not to register even though plugins exist for them.
    """

    socket: str
    hook_dir: str
    name: str = "krproxy-hookserver"
    endpoint: str | None = None
    failure_policy: FailurePolicy = FailurePolicy.IGNORE
    policy_path: str | None = None
    disabled_stages: tuple[Stage, ...] = ()


async def run_background(app: HookServer, policy_path: str | None, nursery: trio.Nursery) -> None:
    """Start the policy watcher (ready once the first look is done) and the app's tickers."""
    if policy_path is not None:
        watcher = PolicyWatcher(policy_path, app.set_policy)
        await nursery.start(watcher.run)
    if app.policy is None:  # no (valid) policy yet: the features' status without one
        app.report_features()
    for ticker in app.tickers:
        nursery.start_soon(_tick_forever, app, ticker)
    nursery.start_soon(_retry_forever, app)


async def _retry_forever(app: HookServer) -> None:
    """Settings whose cgroup did not exist at their hook call are retried until it does."""
    while True:
        await trio.sleep(RETRY_INTERVAL)
        if app.pending:
            app.retry_pending()


async def _tick_forever(app: HookServer, ticker: Ticker) -> None:
    while True:
        await trio.sleep(ticker.interval)
        app.tick(ticker)


#: Stages a server registers even without plugin functions for them: its pod cache (the targets
#: of a re-apply) forgets pods and containers only when the proxy tells it they stopped.
LIFECYCLE_STAGES = (Stage.POST_STOP_POD_SANDBOX, Stage.POST_STOP_CONTAINER)


def registered_stages(app: HookServer, options: ServeOptions) -> tuple[Stage, ...]:
    """The stages written into the registration file: those with plugin functions, plus the
    lifecycle stages, minus the disabled ones; in declaration order."""
    wanted = set(app.registry.stages(options.disabled_stages)) | set(LIFECYCLE_STAGES)
    return tuple(s for s in Stage if s in wanted and s not in options.disabled_stages)


async def serve(
    app: HookServer, options: ServeOptions, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve ``app`` until cancelled. Must run inside ``trio_asyncio.open_loop()``.

    Order: policy loaded → socket listening → registration file written → ``started(path)``
    (the registration path). On cancellation the registration file is removed first (so
    the proxy stops calling), then the server stops and the socket file is removed.
    """
    async with trio.open_nursery() as nursery:
        await run_background(app, options.policy_path, nursery)
        await nursery.start(_grpc.serve, [HookService(app)], options.socket)
        content = registration_json(
            options.endpoint or options.socket, options.failure_policy, registered_stages(app, options)
        )
        path = write_registration(options.hook_dir, options.name, content)
        log.event(LOGGER, "hookserver_started", socket=options.socket, registration=path)
        try:
            task_status.started(path)
            await trio.sleep_forever()
        finally:
            remove_registration(path)
            nursery.cancel_scope.cancel()
            log.event(LOGGER, "hookserver_stopped", socket=options.socket, registration_removed=path)
