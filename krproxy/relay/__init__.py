"""krproxy's transport on the HTTP/2 core, and the CRI front end's face on it.

:class:`Transport` (:mod:`krproxy.relay.transport`) owns connections and calls; :class:`Relay`
(:mod:`krproxy.relay.relay`) holds one and routes its callers' streams by path; a
:class:`Route` holds the connection to one upstream socket. docs/architecture.md draws the parts.
"""

from krproxy.relay.relay import Relay
from krproxy.relay.route import Route, connect_unix
from krproxy.relay.transport import Transport

__all__ = ["Relay", "Route", "Transport", "connect_unix"]
