"""krproxy's transport on the HTTP/2 core, and the CRI front end's face on it.

:class:`Transport` (:mod:`krproxy.relay.transport`) owns connections and calls; :class:`Relay`
(:mod:`krproxy.relay.relay`) holds one and routes its callers' streams by path; a
:class:`Route` holds the connection to one upstream socket. docs/architecture.md draws the parts.

Names are loaded from their module when first asked for: :mod:`krproxy.rpc` (the SDK's hook server,
the fakes, ``krproxy trace``) uses the transport's modules without :class:`Relay`, whose routing
brings in the proxy's hook machinery and the CRI's messages (0.1 s of imports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from krproxy._lazy import reexport

if TYPE_CHECKING:
    from krproxy.relay.relay import Relay as Relay
    from krproxy.relay.route import Route as Route
    from krproxy.relay.route import connect_unix as connect_unix
    from krproxy.relay.transport import Transport as Transport

_WHERE = {"Relay": "relay", "Route": "route", "connect_unix": "route", "Transport": "transport"}

__all__ = sorted(_WHERE)

__getattr__ = reexport(__name__, _WHERE)
