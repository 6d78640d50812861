"""What ``krproxy nri``'s admin endpoint reports (:class:`NriView`, a :class:`krproxy.admin.View`)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import attrs

from krproxy import __version__, admin
from krproxy.metrics import Metrics
from krproxy.nri._events import event_names

if TYPE_CHECKING:
    from krproxy.nri.plugin import NriPlugin


@attrs.define(eq=False)
class NriView:
    """What ``krproxy nri``'s admin endpoint reports (:class:`krproxy.admin.View`)."""

    plugin: NriPlugin
    metrics: Metrics
    address: str = ""
    started: float = attrs.field(factory=time.time)
    _clock_start: float = attrs.field(factory=time.monotonic)

    def readiness(self) -> tuple[bool, list[str]]:
        """Ready once registered with the runtime and synchronized by it."""
        plugin = self.plugin
        reasons: list[str] = []
        if not plugin.registered:
            why = f" ({plugin.last_error})" if plugin.last_error else ""
            reasons.append(f"not registered with the runtime's NRI at {plugin.config.socket}{why}")
        elif not plugin.synchronized.is_set():
            reasons.append("registered, not synchronized by the runtime yet")
        reasons += admin.required_reasons(plugin.guard)
        return not reasons, reasons

    def status(self) -> dict[str, Any]:
        ready, reasons = self.readiness()
        plugin = self.plugin
        stats = plugin.store.statistics()
        config = plugin.config
        return {
            "version": __version__,
            "pid": os.getpid(),
            "ready": ready,
            "reasons": reasons,
            "mode": "nri",
            "admin_address": self.address,
            "started": self.started,
            "uptime_seconds": round(time.monotonic() - self._clock_start, 3),
            "nri": {
                "socket": config.socket,
                "plugin": f"{config.plugin_index}-{config.plugin_name}",
                "registered": plugin.registered,
                "last_error": plugin.last_error,
                "runtime": plugin.runtime,
                "nri_version": plugin.events.terms.runtime_nri.version,
                "event_calls": plugin.events.event_calls,
                "request_timeout": plugin.events.terms.request_timeout,
                "events": event_names(plugin.subscribed),
                "runtime_requires_plugin": plugin.validator.required,
                "runtime_validator": plugin.validator.describe(),
            },
            "store": {
                "kept": plugin.events.terms.store_kept,
                "recovered": plugin.synchronized.is_set(),
                "pods": stats.pods,
                "containers": stats.containers,
            },
            "hook_dir": config.hook_dir,
            **admin.registry_status(plugin.dispatcher.registry),
            "required_servers": admin.required_status(plugin.guard),
        }
