"""What stands between an answer's arrival and its send to the caller (issue 24): the relay writes
what it passes on before its own acknowledgements to the peer it read from."""

from __future__ import annotations

from pathlib import Path

import h2.events
import pytest
import trio

from krproxy.h2 import frames as f
from krproxy.relay import Relay, connection
from krproxy.relay.rpc import grpc_message
from tests.integration.support import serve_relay, wait_until
from tests.integration.test_relay_broken_peers import PATH, _call, raw_upstream

_ANSWER_HEADERS = f.encode_headers([(b":status", b"200"), (b"content-type", b"application/grpc")])


async def test_an_answer_goes_out_before_the_ping_ack(
    nursery: trio.Nursery, relay: Relay, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """containerd (grpc-go) sends a PING with an answer's DATA (its BDP estimate). Read together,
    the answer is written to the caller first and the PING's acknowledgement after it: acked
    first, the answer waited for one more send and the runtime's wake-up."""
    upstream = str(short_tmp / "upstream.sock")
    ping = f.frame(f.PING, 0, 0, b"bdp-ping")

    def script(stream_id: int) -> bytes:
        if stream_id == 0:
            return b""  # the PING's ACK arrived: nothing more
        return (
            ping
            + f.header_frames(stream_id, _ANSWER_HEADERS, False, f.DEFAULT_MAX_FRAME)
            + f.frame(f.DATA, 0, stream_id, grpc_message(b"answer"))
            + f.header_frames(
                stream_id, f.encode_headers([(b"grpc-status", b"0")]), True, f.DEFAULT_MAX_FRAME
            )
        )

    writes: list[tuple[str, bytes]] = []
    try_send = connection.Endpoint.try_send

    def recording(ep: connection.Endpoint) -> None:
        if ep.out and not ep.closed:
            writes.append(("caller" if ep.server_side else "runtime", bytes(ep.out)))
        try_send(ep)

    monkeypatch.setattr(connection.Endpoint, "try_send", recording)
    listen = str(short_tmp / "relay.sock")
    relay.configure(relay.route_to(upstream, "upstream"), None, {}, unary_paths=[PATH])
    await serve_relay(nursery, relay, listen)
    with raw_upstream(upstream, script):
        for _ in range(3):
            events = await trio.to_thread.run_sync(_call, listen)
            assert isinstance(events[-1], h2.events.StreamEnded)
            await wait_until(lambda: relay.transport.in_flight == 0)
    ack = f.frame(f.PING, f.ACK, 0, b"bdp-ping")
    acks = [i for i, (peer, data) in enumerate(writes) if peer == "runtime" and ack in data]
    assert 3 == len(acks)
    for i in acks:  # the write just before each ack: that call's answer, to its caller
        peer, data = writes[i - 1]
        assert ("caller", True) == (peer, grpc_message(b"answer") in data), writes
