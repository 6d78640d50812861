"""Tests of the relay on the HTTP/2 core (branch driver2): peers that break HTTP/2 in ways the
other suites do not try. Each test names the rule it holds; peers are raw sockets in threads."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
import trio

from krproxy.h2 import frames as f
from krproxy.relay import Relay, connection
from krproxy.relay.call import Call
from krproxy.relay.rpc import grpc_message, request_headers
from tests.integration.support import ThreadedUnixServer, received, serve_relay_to, wait_until
from tests.integration.test_relay_raw_peers import Answer, Client, serving

PATH = "/test.Review/Call"

#: What the raw upstream writes on a stream once the request arrived: raw frame bytes.
Script = Callable[[int], bytes]


class RawFramesServer(ThreadedUnixServer):
    """An upstream that does the HTTP/2 handshake with ``h2`` and answers each request with the
    raw frames ``script(stream_id)`` returns (bytes it chooses, rules broken or not), and the
    answer to a PING with ``script(0)``; ``settings`` are sent raw after h2's."""

    def __init__(self, path: str, script: Script, settings: dict[int, int] | None = None) -> None:
        self.script = script
        self.settings = settings or {}
        super().__init__(path)

    def serve_connection(self, sock: socket.socket) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        conn.initiate_connection()
        sock.sendall(conn.data_to_send())
        if self.settings:  # raw too: h2 would hold streams the raw answers ended against them
            sock.sendall(f.settings(list(self.settings.items())))
        with contextlib.suppress(OSError):
            for data in received(sock, lambda: self.stopping):
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.DataReceived):
                        conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    if isinstance(event, h2.events.StreamEnded):
                        sock.sendall(conn.data_to_send())
                        sock.sendall(self.script(event.stream_id))
                    elif isinstance(event, h2.events.PingAckReceived):  # a PING of the script's
                        sock.sendall(self.script(0))
                sock.sendall(conn.data_to_send())
        sock.close()


@contextlib.contextmanager
def raw_upstream(
    path: str, script: Script, settings: dict[int, int] | None = None
) -> Iterator[RawFramesServer]:
    server = RawFramesServer(path, script, settings)
    try:
        yield server
    finally:
        server.close()


_ANSWER_HEADERS = f.encode_headers([(b":status", b"200"), (b"content-type", b"application/grpc")])


class TestUpstreamHeaderBlocks:
    async def test_second_header_block_no_end_stream_fails_the_call(
        self, nursery: trio.Nursery, relay: Relay, short_tmp: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """An upstream sends its answer's headers, a message, then a second header block without
        END_STREAM: a malformed response (RFC 9113 §8.1), that stream's error. The caller gets a
        status and the relay goes on serving; before, the block was passed on to the caller, and
        with the message still queued for the caller's window the core refused to send headers
        after data (LocalProtocolError), which ended the relay's whole task tree."""
        upstream = str(short_tmp / "upstream.sock")

        def script(stream_id: int) -> bytes:
            return (
                f.header_frames(stream_id, _ANSWER_HEADERS, False, f.DEFAULT_MAX_FRAME)
                + f.frame(f.DATA, 0, stream_id, grpc_message(b"answer"))
                + f.header_frames(
                    stream_id, f.encode_headers([(b"x-more", b"1")]), False, f.DEFAULT_MAX_FRAME
                )
            )

        listen = await serve_relay_to(nursery, relay, upstream, str(short_tmp), [PATH])

        with raw_upstream(upstream, script):
            # Window 0: the message waits in the relay when the second block comes.
            events = await trio.to_thread.run_sync(_call, listen, 0)
            await wait_until(lambda: relay.transport.in_flight == 0)
            again = await trio.to_thread.run_sync(_call, listen)
        for seen in (events, again):
            blocks = [
                e for e in seen if isinstance(e, (h2.events.ResponseReceived, h2.events.TrailersReceived))
            ]
            assert not any(b"x-more" in dict(e.headers) for e in blocks)  # type: ignore[arg-type]
            assert isinstance(seen[-1], h2.events.StreamEnded)
            status = dict(blocks[-1].headers)[b"grpc-status"]  # type: ignore[arg-type]
            assert status != b"0"
        assert not _internal_errors(caplog)  # the stream's error, not the connection's end

    async def test_data_before_the_answer_headers_fails_the_call(
        self, nursery: trio.Nursery, relay: Relay, short_tmp: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """An upstream sends a message before any header block: a malformed response (RFC 9113
        §8.1), that stream's error; the caller gets a status. Before, the relay passed the
        DATA on to the caller's stream, whose headers were not sent yet, and the core's
        LocalProtocolError ("data before headers") ended the relay's whole task tree."""
        upstream = str(short_tmp / "upstream.sock")

        def script(stream_id: int) -> bytes:
            return f.frame(f.DATA, 0, stream_id, grpc_message(b"answer")) + f.header_frames(
                stream_id, f.encode_headers([(b"grpc-status", b"0")]), True, f.DEFAULT_MAX_FRAME
            )

        listen = await serve_relay_to(nursery, relay, upstream, str(short_tmp), [PATH])
        with raw_upstream(upstream, script):
            first = await trio.to_thread.run_sync(_call, listen)
            again = await trio.to_thread.run_sync(_call, listen)
        for seen in (first, again):
            assert not [e for e in seen if isinstance(e, h2.events.DataReceived)]
            assert isinstance(seen[-1], h2.events.StreamEnded)
            blocks = [
                e for e in seen if isinstance(e, (h2.events.ResponseReceived, h2.events.TrailersReceived))
            ]
            assert dict(blocks[-1].headers)[b"grpc-status"] != b"0"  # type: ignore[arg-type]
        assert not _internal_errors(caplog)  # the stream's error, not the connection's end


def _internal_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the relay logged as its own failure (Endpoint.run's last resort)."""
    return [r.getMessage() for r in caplog.records if r.msg == connection.BUG_MESSAGE]


def _call(listen: str, window: int | None = None) -> list[h2.events.Event]:
    """One call through the relay (``window``: the caller's stream window); its stream's events
    up to its end."""
    client = Client(listen, window=window)
    try:
        stream_id = client.start(PATH, b"x")
        client.flush()
        return client.until(
            stream_id, lambda e: isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset))
        )
    finally:
        client.close()


class TestCallerCredit:
    async def test_request_bytes_dropped_by_resets_credit_the_caller(
        self, nursery: trio.Nursery, relay: Relay, short_tmp: Path
    ) -> None:
        """A runtime that takes streams but grants no window: each request waits in the relay,
        and the caller resets it. 24 such requests of 1 MiB are more than the caller
        connection's 16 MiB window: they all go through only if each reset gave the dropped
        bytes' connection credit back (once: twice would push the caller's window past what
        the relay can hold, which h2 reports as a flow-control error)."""
        upstream = str(short_tmp / "upstream.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(upstream)
        listener.listen(4)
        stop = threading.Event()

        def no_window() -> None:
            sock, _ = listener.accept()
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
            conn.initiate_connection()
            conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
            sock.sendall(conn.data_to_send())
            with sock, contextlib.suppress(OSError):
                for data in received(sock, stop.is_set):
                    conn.receive_data(data)
                    sock.sendall(conn.data_to_send())

        thread = threading.Thread(target=no_window, daemon=True)
        thread.start()
        listen = await serve_relay_to(nursery, relay, upstream, str(short_tmp), [PATH])

        def caller() -> int:
            client = Client(listen, limit=10)
            try:
                for _ in range(24):
                    stream_id = client.conn.get_next_available_stream_id()
                    client.conn.send_headers(stream_id, [*request_headers(PATH, b"review")])
                    body = memoryview(b"\x00" * (1 << 20))
                    while body:
                        size = min(
                            len(body),
                            client.conn.local_flow_control_window(stream_id),
                            client.conn.max_outbound_frame_size,
                        )
                        if size <= 0:  # wait for the relay's WINDOW_UPDATE
                            client.flush()
                            data = client.sock.recv(65536)
                            if not data:
                                raise ConnectionError("the relay closed the connection")
                            client.conn.receive_data(data)
                            continue
                        client.conn.send_data(stream_id, bytes(body[:size]))
                        body = body[size:]
                    client.flush()
                    client.conn.reset_stream(stream_id)
                    client.flush()
                return client.conn.outbound_flow_control_window
            finally:
                client.close()

        try:
            window = await trio.to_thread.run_sync(caller)
            await wait_until(lambda: relay.transport.in_flight == 0)
        finally:
            stop.set()
            listener.close()
            await trio.to_thread.run_sync(thread.join)
        assert window <= 16 * 1024 * 1024


class TestIsolation:
    @pytest.mark.relay_bug_expected
    async def test_a_bug_on_one_connection_ends_only_that_connection(
        self,
        nursery: trio.Nursery,
        relay: Relay,
        short_tmp: Path,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """An exception of ours while a connection's events are handled (here injected where the
        two bugs above were: passing an upstream's answer on) closes that connection, its calls
        failing with a status, and is logged with its traceback; the relay and its other
        connections go on. Before, it ended the relay's whole task tree: the daemon."""
        upstream = str(short_tmp / "upstream.sock")
        real = Call.on_reply_headers
        injected: list[str] = []

        def buggy(self: Call, headers: list[tuple[bytes, bytes]], end: bool) -> None:
            if not injected:
                injected.append(self.state.path)
                raise RuntimeError("injected bug")
            real(self, headers, end)

        monkeypatch.setattr(Call, "on_reply_headers", buggy)
        listen = await serve_relay_to(nursery, relay, upstream, str(short_tmp), [PATH])
        with serving(upstream, lambda path, body: Answer(body=body)):
            first = await trio.to_thread.run_sync(_call, listen)
            await wait_until(lambda: relay.transport.in_flight == 0)
            second = await trio.to_thread.run_sync(_call, listen)
        assert [PATH] == injected
        statuses = []
        for seen in (first, second):
            blocks = [
                e for e in seen if isinstance(e, (h2.events.ResponseReceived, h2.events.TrailersReceived))
            ]
            statuses.append(dict(blocks[-1].headers)[b"grpc-status"])  # type: ignore[arg-type]
        assert [b"14", b"0"] == statuses  # UNAVAILABLE, then served
        logged = [r for r in caplog.records if r.exc_info and r.msg == connection.BUG_MESSAGE]
        assert ["injected bug"] == [str(r.exc_info[1]) for r in logged if r.exc_info]
        assert 1 == len(_internal_errors(caplog))


class TestUpstreamGoaway:
    @pytest.mark.parametrize("slots", [1, 2])
    async def test_calls_above_a_runtime_goaway_are_refused(
        self, nursery: trio.Nursery, relay: Relay, short_tmp: Path, slots: int
    ) -> None:
        """A runtime allowing ``slots`` streams at a time answers the first of three calls after a
        GOAWAY naming it as the last it processes, and ignores the others (RFC 9113 §6.8 lets
        it). The first is answered; the others, opened above the GOAWAY's last stream or waiting
        for a slot, are refused to the caller (REFUSED_STREAM: grpc-go sends them again), and no
        stream is opened on the connection after its GOAWAY (§6.8: "MUST NOT"). Before, with
        two slots, refusing the stream above the GOAWAY freed a slot and the relay opened the
        waiting call on that connection (an h2 server takes that as a connection error)."""
        upstream = str(short_tmp / "upstream.sock")
        seen: list[int] = []

        def answer(stream_id: int) -> bytes:
            return (
                f.header_frames(stream_id, _ANSWER_HEADERS, False, 16384)
                + f.frame(f.DATA, 0, stream_id, grpc_message(b"answer"))
                + f.header_frames(stream_id, f.encode_headers([(b"grpc-status", b"0")]), True, 16384)
            )

        def script(stream_id: int) -> bytes:
            if stream_id:
                seen.append(stream_id)
            if stream_id == 1:  # the first call on a connection
                return answer(1)
            if stream_id == 1 + 2 * slots:  # every slot taken: the relay has the calls queued
                # The answer once the relay has acted on the GOAWAY (answered the PING after it).
                return f.goaway(3, f.NO_ERROR) + f.frame(f.PING, 0, 0, b"goaway!!")
            if stream_id == 0:
                return answer(3)
            return b""

        listen = await serve_relay_to(nursery, relay, upstream, str(short_tmp), [PATH])

        def three_calls() -> dict[int, str]:
            client = Client(listen)
            try:
                ends: dict[int, str] = {}
                # First a call of its own: the relay has the runtime's SETTINGS (its limit) after it.
                first = client.start(PATH, b"x")
                client.flush()
                ids = [first]
                while True:
                    data = client.sock.recv(65536)
                    if not data:
                        raise ConnectionError("the relay closed the connection")
                    for event in client.conn.receive_data(data):
                        if isinstance(event, h2.events.TrailersReceived):
                            ends[event.stream_id] = dict(event.headers)[b"grpc-status"].decode()
                        elif isinstance(event, h2.events.StreamReset):
                            ends[event.stream_id] = event.error_code.name
                    client.flush()
                    if len(ends) == len(ids) == 1:
                        ids += [client.start(PATH, b"x") for _ in range(3)]
                        client.flush()  # in one write: the relay queues those beyond the limit
                    elif len(ends) == len(ids):
                        return {i: ends[i] for i in ids}
            finally:
                client.close()

        with raw_upstream(upstream, script, {h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: slots}):
            ends = await trio.to_thread.run_sync(three_calls)
            await wait_until(lambda: relay.transport.in_flight == 0)
        first_connection = seen[: seen.index(1, 1)] if 1 in seen[1:] else seen
        assert [1, 3, 5][: 1 + slots] == first_connection
        # The others were refused, or (a call the relay read only after the GOAWAY) went on a
        # new connection.
        assert ("0", "0") == (ends[1], ends[3])
        assert {ends[5], ends[7]} <= {"REFUSED_STREAM", "0"}
        assert "REFUSED_STREAM" in (ends[5], ends[7])
