"""Large callers against the relay in front of the fake containerd, with a raw ``h2`` client
(issue 16's review): a message of exactly 16 MiB and one byte more, a stream window granted to
the runtime only as the caller reads, and huge header blocks that hold up only their own connection.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import hpack
import pytest
import trio
from cri_api.v1 import api_pb2 as pb

from krproxy.bench.flood import send_header_blocks
from krproxy.fakes.containerd import FakeContainerd
from krproxy.grpcstatus import Status
from krproxy.h2 import hpackmemo
from krproxy.relay.rpc import grpc_message
from tests.integration.support import LIVENESS_LIMIT, in_thread, start_proxy, wait_until
from tests.integration.test_relay_hostile import RUN, VERSION, RawCaller


async def test_exactly_16_mib_passes_and_one_byte_more_does_not(
    fake_containerd: tuple[FakeContainerd, str], nursery: trio.Nursery, sockdir: str
) -> None:
    """The limit is on the message, as containerd's: 16 MiB exactly is passed on (relayed, and
    with hook points), one byte more is RESOURCE_EXHAUSTED from its prefix; the message is sent
    in 1000-byte DATA frames, so the prefix and the body arrive in pieces."""
    fake, backend = fake_containerd
    proxy = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
    limit = 16 * 1024 * 1024
    version = pb.VersionRequest(version="v" * (limit - 5)).SerializeToString()
    sandbox = pb.RunPodSandboxRequest(
        config=pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name="big", namespace="default", uid="uid-big"),
            annotations={"big": "x" * (limit - 200)},
        )
    ).SerializeToString()
    sandbox = pb.RunPodSandboxRequest.FromString(sandbox)
    sandbox.config.annotations["big"] += "x" * (limit - sandbox.ByteSize())
    whole = sandbox.SerializeToString()
    assert limit == len(version) == len(whole)

    def call(path: str, message: bytes) -> dict[bytes, bytes]:
        caller = RawCaller(proxy.config.listen)
        try:
            stream_id = caller.open(path, None, end=False)
            framed = grpc_message(message)
            for i in range(0, len(framed), 1000):
                while (
                    stream_id not in caller.ended and caller.conn.local_flow_control_window(stream_id) < 1000
                ):
                    caller.pump()
                if stream_id in caller.ended:  # answered (refused) before the rest was sent
                    break
                caller.conn.send_data(stream_id, framed[i : i + 1000], end_stream=i + 1000 >= len(framed))
                if i % 64_000 == 0:
                    caller.flush()
            caller.flush()
            caller.wait(stream_id)
            return caller.trailers[stream_id]
        finally:
            caller.close()

    assert b"0" == (await in_thread(call, VERSION, version))[b"grpc-status"]
    assert b"0" == (await in_thread(call, RUN, whole))[b"grpc-status"]
    for path, message in ((VERSION, version + b"v"), (RUN, whole + b"\x00")):
        status = await in_thread(call, path, message)
        assert (b"%d" % Status.RESOURCE_EXHAUSTED.value, True) == (
            status[b"grpc-status"],
            b"16777216" in status[b"grpc-message"],
        )
    assert 1 == len(fake.requests("RunPodSandbox"))


async def test_stream_window_granted_upstream_as_the_caller_reads(
    nursery: trio.Nursery, sockdir: str
) -> None:
    """The runtime connection's window comes back on arrival, but a stream's only as its caller
    reads: a runtime answering 8 MiB to a caller that reads nothing can send one stream window
    (4 MiB) and gets no WINDOW_UPDATE for that stream; once the caller reads, the rest follows."""
    backend = os.path.join(sockdir, "backend.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(backend)
    listener.listen(4)
    answer = grpc_message(b"a" * (8 * 1024 * 1024))
    seen: dict[str, int] = {"sent": 0, "stream_updates": 0, "connection_updates": 0}
    stop = threading.Event()

    def big_answers() -> None:
        conn_sock, _ = listener.accept()
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        conn_sock.settimeout(0.05)
        streams: dict[int, int] = {}  # stream -> bytes of the answer sent
        with conn_sock:
            while not stop.is_set():
                for stream_id, offset in list(streams.items()):
                    size = min(conn.local_flow_control_window(stream_id), len(answer) - offset, 16384)
                    while size > 0:
                        conn.send_data(stream_id, answer[offset : offset + size])
                        offset += size
                        seen["sent"] = offset  # (one stream answered: the caller's)
                        size = min(conn.local_flow_control_window(stream_id), len(answer) - offset, 16384)
                    streams[stream_id] = offset
                    if offset == len(answer):
                        conn.send_headers(stream_id, [("grpc-status", "0")], end_stream=True)
                        del streams[stream_id]
                # The short timeout is for polling reads only: a send that met it raised TimeoutError
                # under load, ended this thread and left the answer half sent.
                conn_sock.settimeout(LIVENESS_LIMIT)
                conn_sock.sendall(conn.data_to_send())
                conn_sock.settimeout(0.05)
                try:
                    data = conn_sock.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    return
                for event in conn.receive_data(data):
                    if (
                        isinstance(event, h2.events.RequestReceived)
                        and (b":path", VERSION.encode()) in event.headers
                    ):
                        conn.send_headers(
                            event.stream_id, [(":status", "200"), ("content-type", "application/grpc")]
                        )
                        streams[event.stream_id] = 0
                    elif isinstance(event, h2.events.RequestReceived):  # krproxy's own (store recovery)
                        fields = [
                            (":status", "200"),
                            ("content-type", "application/grpc"),
                            ("grpc-status", "12"),
                        ]
                        conn.send_headers(event.stream_id, fields, end_stream=True)
                    elif isinstance(event, h2.events.WindowUpdated) and event.stream_id in streams:
                        seen["stream_updates"] += 1
                    elif isinstance(event, h2.events.WindowUpdated) and not event.stream_id:
                        seen["connection_updates"] += 1
                    elif isinstance(event, h2.events.DataReceived):
                        conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)

    thread = threading.Thread(target=big_answers, daemon=True)
    thread.start()
    proxy = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
    caller = await in_thread(RawCaller, proxy.config.listen, read=False)
    try:
        stream_id = await in_thread(caller.open, VERSION, b"")
        # The first stream window arrives (a liveness bound: 1 s was not always enough under load).
        await wait_until(lambda: seen["sent"] >= 4 * 1024 * 1024)
        await trio.sleep(0.5)  # time for a WINDOW_UPDATE that should not come
        held = (seen["sent"], seen["stream_updates"])
        assert seen["connection_updates"] > 0  # the runtime connection's window did come back
        caller.read = True  # it reads (and acknowledges) from now on: nothing was read so far
        caller.sock.settimeout(10)
        ending = await in_thread(caller.wait, stream_id)
    finally:
        caller.close()
        stop.set()
        listener.close()
        await trio.to_thread.run_sync(thread.join)
    assert (4 * 1024 * 1024, 0) == held
    assert ("ended", len(answer)) == (ending, seen["sent"])


@pytest.mark.parametrize(
    ("size", "anywhere"),
    [(384 * 1024, True), (4000, False)],
    ids=["384-KiB-blocks", "4000-byte-blocks"],
)
async def test_huge_header_blocks_hold_up_only_their_own_connection(
    fake_containerd: tuple[FakeContainerd, str],
    nursery: trio.Nursery,
    sockdir: str,
    monkeypatch: pytest.MonkeyPatch,
    size: int,
    anywhere: bool,
) -> None:
    """One connection sends header blocks of one-byte indexed fields one after the other: 384 KiB
    (393,216 fields, within the 16 MiB list limit; ~2 µs each to decode), or 4000 bytes, small
    but beyond what the event loop decodes between two reads. While the relay decodes one of them
    (held open here until the other client is done), a second connection completes 20 Version
    calls; then 20 more while the blocks keep coming. Decoded on the event loop, such a block
    held every caller up: none of the 20 could complete during it (the 384 KiB case holds a block
    wherever it is decoded; the 4000-byte one holds the first decoded off the event loop's
    thread, and fails before the fix for want of one)."""
    real_decode = hpackmemo.decode  # every block goes through it (hpack's decode, or its memo)
    decoding, released = threading.Event(), threading.Event()
    held: list[bool] = []  # for the block held: whether the second client let it go
    loop_thread = threading.current_thread()

    def decode(decoder: hpack.Decoder, block: bytes) -> Any:
        headers = real_decode(decoder, block)
        aside = threading.current_thread() is not loop_thread
        if len(block) >= size and (anywhere or aside) and not decoding.is_set():
            decoding.set()
            held.append(released.wait(LIVENESS_LIMIT))
        return headers

    monkeypatch.setattr(hpackmemo, "decode", decode)
    _, backend = fake_containerd
    proxy = await start_proxy(nursery, sockdir, runtime_endpoint=backend)
    stop = threading.Event()
    sent: list[int] = []  # streams whose block went out whole (each malformed: reset once decoded)
    sender = threading.Thread(
        target=send_header_blocks, args=(proxy.config.listen, size, stop, sent), daemon=True
    )

    def second() -> list[str]:
        caller = RawCaller(proxy.config.listen)
        caller.sock.settimeout(2 * LIVENESS_LIMIT)  # longer than the hold: an answer late, not lost
        request = pb.VersionRequest().SerializeToString()
        try:
            assert decoding.wait(LIVENESS_LIMIT), "no block was held (none decoded off the event loop)"
            endings = [caller.wait(caller.open(VERSION, request)) for _ in range(20)]
            released.set()
            endings += [caller.wait(caller.open(VERSION, request)) for _ in range(20)]
            while len(sent) < 3 and sender.is_alive():  # the relay took two more: it decoded the 2nd
                endings.append(caller.wait(caller.open(VERSION, request)))
            return endings
        finally:
            released.set()
            caller.close()

    sender.start()
    try:
        endings = await in_thread(second)
    finally:
        stop.set()
        await in_thread(sender.join, LIVENESS_LIMIT)
    assert [True] == held  # released by the second client, not by the liveness bound
    assert ["ended"] == sorted(set(endings))
    assert len(endings) >= 40
    assert len(sent) >= 3
