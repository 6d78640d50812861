"""HTTP/2 without I/O: frames (:mod:`krproxy.h2.frames`) and one connection's protocol state
(:mod:`krproxy.h2.connection`, events in :mod:`krproxy.h2.events`). Imports no socket, trio,
clock or thread module; the relay (:mod:`krproxy.relay`) drives it."""

from krproxy.h2.connection import Connection, LocalProtocolError, Role

__all__ = ["Connection", "LocalProtocolError", "Role"]
