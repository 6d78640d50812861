"""The CRI front end: an HTTP/2 relay on trio (see :mod:`krproxy.relay.relay`)."""

from krproxy.relay.connection import Route, connect_unix
from krproxy.relay.relay import Relay

__all__ = ["Relay", "Route", "connect_unix"]
