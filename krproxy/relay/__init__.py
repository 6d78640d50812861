"""The CRI front end: an HTTP/2 relay on trio (see :mod:`krproxy.relay.relay`)."""

from krproxy.relay.relay import Relay
from krproxy.relay.route import Route, connect_unix

__all__ = ["Relay", "Route", "connect_unix"]
