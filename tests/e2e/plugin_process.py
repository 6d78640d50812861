"""A scriptable hook plugin for the e2e tests, run as its own process.

    python -m tests.e2e.plugin_process '{"name": "p", "socket": "/tmp/x/p.sock", ...}'

It serves ``runtime.v1alpha1.RuntimeHookService`` on ``socket``, appends one JSON line per call
to ``calls`` (``{"hook": "PreCreateContainer", "request": {...}}``, snake_case keys, defaults
included) *before* answering, and once it listens writes its registration file into
``hook_dir``. Config keys (JSON, all but ``name``/``socket``/``calls``/``hook_dir`` optional):

``hooks``, ``failure_policy``, ``timeout``
    what goes into the registration file.
``error``
    ``{hook name: message}``: answer that hook with status INTERNAL and this message.
``resources``
    ``{hook name: {LinuxContainerResources field: value}}``: for container pre hooks and
    PreUpdatePodSandboxResources, echo the request (koordlet's convention) with these resource
    fields set.
``envs``
    ``{hook name: {NAME: value}}``: for container pre hooks, echo the request's envs with these
    added or overwritten.
``annotations``
    ``{hook name: {key: value}}``: for container pre hooks, echo the request's container annotations
    with these added or overwritten.
``delay``
    ``{hook name: seconds}``: wait this long before answering that hook (the call is recorded
    first).
``move_pods_to``
    a cgroup path prefix ``P``: PreRunPodSandbox answers ``cgroup_parent = P-<pod uid>``, and
    PreCreateContainer answers ``pod_cgroup_parent = P-<pod uid>`` (so the container follows).
``headers``
    a file to append, per request, ``{"path": ..., "grpc-timeout": ...}`` (the header as sent,
    "" when absent).

The server is as strict as a hook server on grpc-go (koordlet) is: it refuses what grpc-go
refuses (a ``grpc-timeout`` of more than 8 digits answers INTERNAL, and so on:
:func:`krproxy.fakes.grpc_go.header_check`).

Every other call is echoed unchanged. SIGTERM stops it (exit 0, socket removed).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import betterproto2
import trio

from krproxy import rpc
from krproxy.fakes.grpc_go import header_check
from krproxy.fakes.strict import GrpcGo, Headers
from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks.points import HookPoint
from krproxy.proto.runtime import v1alpha1 as hookapi

ALL_HOOKS = [
    "PreRunPodSandbox",
    "PostStopPodSandbox",
    "PreCreateContainer",
    "PreStartContainer",
    "PostStartContainer",
    "PostStopContainer",
    "PreUpdateContainerResources",
]


def register(
    hook_dir: str | Path,
    name: str,
    endpoint: str,
    hooks: list[str],
    failure_policy: str = "Ignore",
    timeout: str = "2s",
) -> Path:
    """Write ``<hook_dir>/<name>.json`` atomically (the proxy must never read half a file)."""
    path = Path(hook_dir) / f"{name}.json"
    temp = Path(hook_dir) / f".{name}.json.tmp"  # dot files are not registration files
    registration = {
        "remote-endpoint": endpoint,
        "failure-policy": failure_policy,
        "runtime-hooks": hooks,
        "timeout": timeout,
    }
    temp.write_text(json.dumps(registration))
    os.replace(temp, path)
    return path


def as_dict(message: betterproto2.Message) -> dict[str, Any]:
    """A hook message as plain JSON-able data: snake_case keys, ints as ints, defaults included."""
    data: dict[str, Any] = message.to_dict(
        output_format=betterproto2.OutputFormat.PYTHON,
        casing=betterproto2.Casing.SNAKE,
        include_default_values=True,
    )
    return data


class ScriptedPlugin:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.calls = open(config["calls"], "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    def handlers(self) -> dict[str, rpc.Handler]:
        """Every hook point, by its gRPC path."""
        return {point.rpc_path: rpc.unary(functools.partial(self._call, point)) for point in HookPoint}

    async def _call(self, point: HookPoint, request: bytes) -> bytes:
        reply: betterproto2.Message
        if point.is_pod_level:
            reply = self._pod(point.value, hookapi.PodSandboxHookRequest.FromString(request))
        else:
            reply = self._container(point.value, hookapi.ContainerResourceHookRequest.FromString(request))
        delay = self.config.get("delay", {}).get(point.value, 0)
        if delay:
            await trio.sleep(delay)
        return bytes(reply.SerializeToString())

    def _record(self, hook: str, message: betterproto2.Message) -> None:
        self.calls.write(json.dumps({"hook": hook, "request": as_dict(message)}) + "\n")
        error = self.config.get("error", {}).get(hook)
        if error is not None:
            raise GRPCError(Status.INTERNAL, error)

    def _moved(self, uid: str) -> str:
        prefix = self.config.get("move_pods_to")
        return f"{prefix}-{uid}" if prefix else ""

    def _pod(self, hook: str, message: hookapi.PodSandboxHookRequest) -> hookapi.PodSandboxHookResponse:
        self._record(hook, message)
        cgroup_parent = message.cgroup_parent
        if hook == "PreRunPodSandbox" and message.pod_meta is not None:
            cgroup_parent = self._moved(message.pod_meta.uid) or cgroup_parent
        resources = message.resources
        for field, value in self.config.get("resources", {}).get(hook, {}).items():
            resources = resources or hookapi.LinuxContainerResources()
            setattr(resources, field, value)
        return hookapi.PodSandboxHookResponse(
            labels=message.labels,
            annotations=message.annotations,
            cgroup_parent=cgroup_parent,
            resources=resources,
        )

    def _container(
        self, hook: str, message: hookapi.ContainerResourceHookRequest
    ) -> hookapi.ContainerResourceHookResponse:
        self._record(hook, message)
        resources = message.container_resources or hookapi.LinuxContainerResources()
        for field, value in self.config.get("resources", {}).get(hook, {}).items():
            setattr(resources, field, value)
        pod_cgroup_parent = message.pod_cgroup_parent
        if hook == "PreCreateContainer" and message.pod_meta is not None:
            pod_cgroup_parent = self._moved(message.pod_meta.uid) or pod_cgroup_parent
        envs = {**message.container_envs, **self.config.get("envs", {}).get(hook, {})}
        annotations = {
            **message.container_annotations,
            **self.config.get("annotations", {}).get(hook, {}),
        }
        return hookapi.ContainerResourceHookResponse(
            container_annotations=annotations,
            container_resources=resources,
            pod_cgroup_parent=pod_cgroup_parent,
            container_envs=envs,
        )


def header_log(path: str | None) -> Callable[[Headers], None]:
    """Append each accepted request's path and ``grpc-timeout`` to ``path`` (nothing if None)."""
    if path is None:
        return lambda headers: None
    out = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    def log(headers: Headers) -> None:
        fields = dict(headers)
        out.write(
            json.dumps({"path": fields.get(":path", ""), "grpc-timeout": fields.get("grpc-timeout", "")})
            + "\n"
        )

    return log


async def main(config: dict[str, Any]) -> None:
    plugin = ScriptedPlugin(config)
    strict = header_check(GrpcGo.V2, accepted=header_log(config.get("headers")))
    server = rpc.Server(plugin.handlers(), check_headers=strict)
    # Watch the signals first: a SIGTERM during start-up (a test stopping a plugin whose registration
    # file was already there) must stop it cleanly, not kill it.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve, config["socket"])
            register(
                config["hook_dir"],
                config["name"],
                config["socket"],
                config.get("hooks", ALL_HOOKS),
                config.get("failure_policy", "Ignore"),
                config.get("timeout", "2s"),
            )
            async for _ in signals:
                break
            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
