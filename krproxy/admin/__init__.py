"""The admin endpoint (``--metrics-address``: ``/metrics``, ``/healthz``, ``/readyz``, ``/status``)
and the ``krproxy status`` client.

- :mod:`krproxy.admin.server`: HTTP/1 (h11, sans I/O) and the trio server.
- :mod:`krproxy.admin.status`: what it reports (:class:`View`; ``krproxy serve``'s :class:`AdminView`).
- :mod:`krproxy.admin.client`: ``krproxy status``, which needs neither trio nor the metrics.

Names are loaded from their module when first asked for, so ``krproxy status`` imports the client
alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from krproxy._lazy import reexport

if TYPE_CHECKING:
    from krproxy.admin.client import Unreachable as Unreachable
    from krproxy.admin.client import add_status_subcommand as add_status_subcommand
    from krproxy.admin.client import fetch_status as fetch_status
    from krproxy.admin.client import render_status as render_status
    from krproxy.admin.client import status_main as status_main
    from krproxy.admin.server import AddressUnavailable as AddressUnavailable
    from krproxy.admin.server import bind as bind
    from krproxy.admin.server import serve as serve
    from krproxy.admin.status import AdminView as AdminView
    from krproxy.admin.status import HookState as HookState
    from krproxy.admin.status import View as View
    from krproxy.admin.status import registry_status as registry_status
    from krproxy.admin.status import required_reasons as required_reasons
    from krproxy.admin.status import required_status as required_status
    from krproxy.admin.status import wire_metrics as wire_metrics

_WHERE = {
    "Unreachable": "client",
    "add_status_subcommand": "client",
    "fetch_status": "client",
    "render_status": "client",
    "status_main": "client",
    "AddressUnavailable": "server",
    "bind": "server",
    "serve": "server",
    "AdminView": "status",
    "HookState": "status",
    "View": "status",
    "registry_status": "status",
    "required_reasons": "status",
    "required_status": "status",
    "wire_metrics": "status",
}

__all__ = sorted(_WHERE)

__getattr__ = reexport(__name__, _WHERE)
