"""The reader and whole requests (a transport with ``whole_requests``): a body its face's
open_call does not take goes where a DATA frame read after it would have gone, its credit
given back where the stream was refused."""

from __future__ import annotations

import trio

from krproxy.h2.connection import CONNECTION_WINDOW
from krproxy.relay.transport import Transport
from krproxy.unixsock import bind_unix_socket
from tests.integration.h2_client import framed, grpc_request
from tests.integration.test_rpc_unary_job import LIVENESS_LIMIT
from tests.integration.test_rpc_unary_job_edges import h2_client


async def test_a_refused_whole_requests_credit_comes_back(nursery: trio.Nursery, sock: str) -> None:
    """A transport refusing every stream (REFUSED_STREAM), whole requests on: each refused
    request's body is credited back to the connection, no stream kept."""
    transport = Transport()
    transport.whole_requests = True
    listener = bind_unix_socket(sock)
    await nursery.start(transport.serve, listener)
    conn = h2_client()
    stream = await trio.open_unix_socket(sock)
    async with stream:
        with trio.fail_after(LIVENESS_LIMIT):
            for stream_id in (1, 3):
                conn.send_headers(stream_id, grpc_request("/t.S/M"))
                conn.send_data(stream_id, framed(b"x" * 1000), end_stream=True)
            await stream.send_all(conn.data_to_send())
            reset: dict[int, int] = {}
            while len(reset) < 2:
                for event in conn.receive_data(await stream.receive_some(65536)):
                    if type(event).__name__ == "StreamReset":
                        reset[event.stream_id] = int(event.error_code)
            assert {1: 7, 3: 7} == reset  # REFUSED_STREAM
            (ep,) = transport._clients
            assert {} == ep.h2.streams
            assert CONNECTION_WINDOW == ep.h2.inflow.recv_window + ep.h2.inflow.to_grant
    listener.close()
