"""The fake NRI runtime's ValidateContainerAdjustment (NRI 0.12), after every CreateContainer answer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from krproxy.fakes.nri.adjust import NriError
from krproxy.nri import PLUGIN_SERVICE
from krproxy.nri._session import ConnectionLost, TtrpcError
from krproxy.proto.nri.pkg.api import v1alpha1 as api

if TYPE_CHECKING:
    from krproxy.fakes.nri.runtime import FakeNriRuntime

__all__ = ["validate"]


async def validate(
    runtime: FakeNriRuntime,
    pod: api.PodSandbox,
    container: api.Container,
    merged: api.ContainerAdjustment,
    updates: list[api.ContainerUpdate],
) -> None:
    """NRI 0.12's validation: every plugin subscribed to VALIDATE_CONTAINER_ADJUSTMENT (as a mask of 0
    does: every event) sees the final adjustment; one that rejects it, fails or is late fails the
    creation, with NRI's wording."""
    # NRI's ``owners`` (field numbers per plugin) is not filled: the fake keeps owners by field name.
    plugins = [api.PluginInstance(name=p.name, index=p.index) for p in runtime.plugins]
    request = api.ValidateContainerAdjustmentRequest(
        pod=pod,
        container=container,
        adjust=merged,
        update=updates,
        plugins=plugins,
    )

    errors: list[str] = []
    for plugin in list(runtime.plugins):  # NRI 0.12 asks them all at once, then fails with an error
        if not plugin.subscribed(api.Event.VALIDATE_CONTAINER_ADJUSTMENT):
            continue
        runtime.log.append(("call", "ValidateContainerAdjustment"))
        try:
            with trio.fail_after(runtime.request_timeout):
                answer = await plugin.session.call(
                    PLUGIN_SERVICE, "ValidateContainerAdjustment", bytes(request)
                )
        except (trio.TooSlowError, ConnectionLost, TtrpcError) as exc:
            if not isinstance(exc, TtrpcError):  # fatal: closed, as NRI does; the creation fails still
                runtime._drop(plugin, f"failed to validate request: {exc or 'timed out'}")
                await plugin.session.aclose()
            errors.append(f"validator plugin {plugin.full_name} failed: {exc or 'timed out'}")
            continue
        result = api.ValidateContainerAdjustmentResponse.parse(answer)
        if result.reject:
            reason = result.reason or "unknown rejection reason"
            errors.append(f'validator "{plugin.full_name}" rejected container adjustment, reason: {reason}')
    if errors:
        raise NriError(errors[0])
