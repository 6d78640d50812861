"""HTTP/2 without I/O: frames (:mod:`krproxy.h2.frames`) and one connection's protocol state
(:mod:`krproxy.h2.connection`, events in :mod:`krproxy.h2.events`). A ``Connection`` holds its
parts, each in a private module of its own (``_state``, ``_send``, ``_control``, ``_inflow``,
``_blocks``). Imports no socket, trio, clock or thread module; the relay (:mod:`krproxy.relay`)
drives it."""

from krproxy.h2.connection import Connection, LocalProtocolError, Role

__all__ = ["Connection", "LocalProtocolError", "Role"]
