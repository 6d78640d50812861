"""A caller that asks and never reads: the bench's and the tests' stuck client (issue 16).

:func:`hold_unread` opens one HTTP/2 connection with the ``h2`` library, sends ``streams``
unary gRPC calls on it and never reads a byte of what comes back, as a client that was
SIGSTOPped mid-call, or that forgot its answers, would. Every other caller of the same proxy
must keep its usual latency meanwhile: the answers piling up for this one may only hold up
this one's streams.
"""

from __future__ import annotations

import socket

import h2.config
import h2.connection

from krproxy.relay.rpc import grpc_message, request_headers


def hold_unread(path: str, calls: list[tuple[str, bytes]]) -> socket.socket:
    """Send ``calls`` (method path, request message), each on a stream of its own, to the unix
    socket ``path``; return the connection, which the caller closes when the stuck client is to
    go away. Nothing on it is ever read."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    # Read the relay's greeting (SETTINGS, the connection window), so that the requests fit in
    # the windows; after that, nothing is read any more.
    while conn.outbound_flow_control_window <= 65_535:
        data = sock.recv(65_536)
        if not data:
            raise ConnectionError(f"{path} closed the connection")
        conn.receive_data(data)
    for method, request in calls:
        fields = request_headers(method, b"stuck-client")
        stream_id = conn.get_next_available_stream_id()
        conn.send_headers(stream_id, fields)
        conn.send_data(stream_id, grpc_message(request), end_stream=True)
        sock.sendall(conn.data_to_send())
    return sock
