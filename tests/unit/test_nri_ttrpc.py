"""ttrpc without I/O (krproxy.nri._ttrpc): framing, envelopes, stream ids, limits and garbage.

The envelopes are checked against protobuf itself (upb, from a descriptor of ttrpc's request.proto built
here) as an oracle; the rules against what ttrpc's Go server and client do (cited in the module).
"""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from hypothesis import given, settings
from hypothesis import strategies as st

from krproxy.grpcstatus import Status
from krproxy.nri import _ttrpc
from krproxy.nri._ttrpc import (
    HEADER_LENGTH,
    MESSAGE_LENGTH_MAX,
    Connection,
    DecodeError,
    Ignored,
    MessageType,
    Request,
    RequestReceived,
    Response,
    ResponseReceived,
    Role,
    RpcStatus,
)


def _oracle() -> dict[str, Any]:
    """upb classes for ttrpc.Request/Response/KeyValue and google.rpc.Status (details as raw Any bytes)."""
    f = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="ttrpc_oracle.proto", package="ttrpc", syntax="proto3")

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> None:
        m = file.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            field = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                field.type_name = type_name

    opt, rep = f.LABEL_OPTIONAL, f.LABEL_REPEATED
    message("KeyValue", ("key", 1, f.TYPE_STRING, opt, ""), ("value", 2, f.TYPE_STRING, opt, ""))
    message(
        "Request",
        ("service", 1, f.TYPE_STRING, opt, ""),
        ("method", 2, f.TYPE_STRING, opt, ""),
        ("payload", 3, f.TYPE_BYTES, opt, ""),
        ("timeout_nano", 4, f.TYPE_INT64, opt, ""),
        ("metadata", 5, f.TYPE_MESSAGE, rep, ".ttrpc.KeyValue"),
    )
    message(
        "Status",
        ("code", 1, f.TYPE_INT32, opt, ""),
        ("message", 2, f.TYPE_STRING, opt, ""),
        ("details", 3, f.TYPE_BYTES, rep, ""),  # Any on the wire is length-delimited too
    )
    message(
        "Response", ("status", 1, f.TYPE_MESSAGE, opt, ".ttrpc.Status"), ("payload", 2, f.TYPE_BYTES, opt, "")
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"ttrpc.{name}"))
        for name in ("Request", "Response", "Status")
    }


ORACLE = _oracle()

texts = st.text(max_size=20)
requests = st.builds(
    Request,
    service=texts,
    method=texts,
    payload=st.binary(max_size=300),
    timeout_nano=st.integers(-(2**63), 2**63 - 1),
    metadata=st.lists(st.tuples(texts, texts), max_size=3).map(tuple),
)
statuses = st.builds(
    RpcStatus,
    code=st.sampled_from(list(Status)),
    message=texts,
    details=st.lists(st.binary(max_size=20), max_size=2).map(tuple),
)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def drain(conn: Connection) -> list[Any]:
    events = []
    while (event := conn.next_event()) is not None:
        events.append(event)
    return events


def answers(conn: Connection) -> list[tuple[int, Response]]:
    """The responses a server queued by itself: (stream id, decoded response)."""
    out = []
    for message in conn.messages_to_send():
        length, stream_id, kind, _ = _ttrpc.decode_header(message[:HEADER_LENGTH])
        assert MessageType.RESPONSE == kind
        out.append((stream_id, Response.decode(message[HEADER_LENGTH : HEADER_LENGTH + length])))
    return out


class TestEnvelopes:
    @given(requests)
    def test_request_equals_protobuf(self, request: Request) -> None:
        """A Request encodes as protobuf does, and protobuf's encoding decodes back to it."""
        pb = ORACLE["Request"](
            service=request.service,
            method=request.method,
            payload=request.payload,
            timeout_nano=request.timeout_nano,
        )
        for key, value in request.metadata:
            pb.metadata.add(key=key, value=value)
        assert pb.SerializeToString() == request.encode()
        assert request == Request.decode(pb.SerializeToString())

    @given(statuses, st.binary(max_size=100))
    def test_response_equals_protobuf(self, status: RpcStatus, payload: bytes) -> None:
        """A Response (status always present, as Go's server writes it) round-trips through protobuf."""
        pb = ORACLE["Response"](payload=payload)
        pb.status.SetInParent()
        pb.status.code = status.code
        pb.status.message = status.message
        pb.status.details.extend(status.details)
        response = Response(status, payload)
        assert pb.SerializeToString() == response.encode()
        assert response == Response.decode(pb.SerializeToString())

    def test_missing_status_is_ok(self) -> None:
        """A response without a status field reads as success (Go's client checks only a non-nil status)."""
        assert Response(RpcStatus(), b"x") == Response.decode(
            ORACLE["Response"](payload=b"x").SerializeToString()
        )

    def test_unknown_code_reads_as_unknown(self) -> None:
        """A status code gRPC does not define becomes UNKNOWN, naming the number."""
        status = RpcStatus.decode(ORACLE["Status"](code=99, message="m").SerializeToString())
        assert (Status.UNKNOWN, "unknown status code 99: m") == (status.code, status.message)

    @pytest.mark.parametrize(
        ("data", "error"),
        [
            (b"\x0a\x05ab", "field 1: 5 bytes announced, 2 left"),
            (b"\x08", "truncated varint"),
            (b"\x0a\x01\xff", "field 1: not UTF-8"),
            (b"\x08\x01", "field 1: wire type 0, expected 2"),
            (b"\x00", "field number 0"),
            (b"\x0b", "field 1: unsupported wire type 3"),
            (b"\x20" + b"\xff" * 11, "varint longer than 10 bytes"),
        ],
    )
    def test_garbage_is_a_decode_error(self, data: bytes, error: str) -> None:
        """Bytes that are no Request raise DecodeError saying what is wrong."""
        with pytest.raises(DecodeError, match=error):
            Request.decode(data)

    def test_unknown_fields_are_skipped(self) -> None:
        """Fields a later ttrpc may add (any wire type) do not stop decoding."""
        extra = b"\x30\x07" + b"\x39" + b"\x00" * 8 + b"\x45" + b"\x00" * 4 + b"\x52\x01z"
        assert Request("s", "m") == Request.decode(Request("s", "m").encode() + extra)


class TestFraming:
    def test_header_layout(self) -> None:
        """Length and stream id big-endian, then type and flags: ttrpc's 10-byte header."""
        assert b"\x00\x00\x00\x02\x00\x00\x00\x07\x01\x04ab" == _ttrpc.encode_message(
            7, MessageType.REQUEST, b"ab", 4
        )

    def test_client_ids_are_odd_and_increasing(self) -> None:
        """A client numbers its calls 1, 3, 5, ... as Go's client does."""
        client = Connection(Role.CLIENT)
        assert [1, 3, 5] == [client.send_request(Request("s", "m")) for _ in range(3)]
        assert [1, 3, 5] == [_ttrpc.decode_header(m[:10])[1] for m in client.messages_to_send()]

    @settings(max_examples=200)
    @given(st.lists(requests, min_size=1, max_size=5), st.lists(st.integers(0, 10_000), max_size=8))
    def test_requests_arrive_whole_under_any_chunking(self, sent: list[Request], cuts: list[int]) -> None:
        """However the bytes are cut, the server sees each request once, in order, on the client's id."""
        client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
        ids = [client.send_request(r) for r in sent]
        for chunk in split(b"".join(client.messages_to_send()), cuts):
            server.receive_data(chunk)
        assert [RequestReceived(i, r) for i, r in zip(ids, sent, strict=True)] == drain(server)

    @settings(max_examples=100)
    @given(
        st.lists(st.tuples(statuses, st.binary(max_size=200)), min_size=1, max_size=4),
        st.lists(st.integers()),
    )
    def test_responses_reach_their_calls(
        self, replies: list[tuple[RpcStatus, bytes]], cuts: list[int]
    ) -> None:
        """Answers sent in reverse order reach the calls they answer, under any chunking."""
        client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
        ids = [client.send_request(Request("s", "m")) for _ in replies]
        server.receive_data(b"".join(client.messages_to_send()))
        drain(server)
        for stream_id, (status, payload) in reversed(list(zip(ids, replies, strict=True))):
            server.send_response(stream_id, Response(status, payload))
        for chunk in split(b"".join(server.messages_to_send()), cuts):
            client.receive_data(chunk)
        expected = [ResponseReceived(i, Response(s, p)) for i, (s, p) in zip(ids, replies, strict=True)]
        assert list(reversed(expected)) == drain(client)
        assert frozenset() == client.pending


class TestServerRules:
    def test_even_stream_id_refused(self) -> None:
        """A request on an even id is answered INVALID_ARGUMENT, as Go's server does; no event."""
        server = Connection(Role.SERVER)
        server.receive_data(_ttrpc.encode_message(2, MessageType.REQUEST, Request("s", "m").encode()))
        assert [] == drain(server)
        [(stream_id, response)] = answers(server)
        assert (2, Status.INVALID_ARGUMENT) == (stream_id, response.status.code)
        assert "StreamID must be odd for client initiated streams" == response.status.message

    def test_reused_stream_id_refused(self) -> None:
        """An id not above the last one is refused: ids must increase."""
        server = Connection(Role.SERVER)
        for stream_id in (5, 3, 5):
            server.receive_data(
                _ttrpc.encode_message(stream_id, MessageType.REQUEST, Request("s", "m").encode())
            )
        assert [RequestReceived(5, Request("s", "m"))] == drain(server)
        reused = "StreamID cannot be re-used and must increment"
        assert [(3, reused), (5, reused)] == [(i, r.status.message) for i, r in answers(server)]

    def test_undecodable_request_answered(self) -> None:
        """A request payload that is no ttrpc.Request is answered INVALID_ARGUMENT with the reason."""
        server = Connection(Role.SERVER)
        server.receive_data(_ttrpc.encode_message(1, MessageType.REQUEST, b"\x0a\x09"))
        [(_, response)] = answers(server)
        assert Status.INVALID_ARGUMENT == response.status.code
        assert response.status.message.startswith("unmarshal request error: field 1: 9 bytes announced")

    def test_data_message_answered_as_unknown_stream(self) -> None:
        """NRI has no streaming methods: a data message is answered like one for a stream that ended."""
        server = Connection(Role.SERVER)
        server.receive_data(_ttrpc.encode_message(1, MessageType.DATA, b""))
        [(_, response)] = answers(server)
        assert (Status.INVALID_ARGUMENT, "StreamID is no longer active") == (
            response.status.code,
            response.status.message,
        )

    def test_unknown_type_ignored(self) -> None:
        """A message type ttrpc may add later is dropped (as Go does), then reading goes on."""
        server = Connection(Role.SERVER)
        server.receive_data(
            _ttrpc.encode_message(1, 9, b"xyz") + _ttrpc.encode_message(3, 1, Request("a", "b").encode())
        )
        assert [
            Ignored(1, 9, "message type 9 is not for a server"),
            RequestReceived(3, Request("a", "b")),
        ] == drain(server)

    @given(st.lists(st.integers(1, 5000), max_size=6))
    def test_oversized_request_skipped_and_answered(self, cuts: list[int]) -> None:
        """A message over the limit is skipped (across chunks), answered RESOURCE_EXHAUSTED, and the next is read."""
        server = Connection(Role.SERVER, max_message_length=1000)
        data = b"\x00\x00\x07\xd0\x00\x00\x00\x01\x01\x00" + b"\xee" * 2000  # 2000 bytes on stream 1
        data += _ttrpc.encode_message(3, MessageType.REQUEST, Request("s", "m").encode())
        for chunk in split(data, cuts):
            server.receive_data(chunk)
        assert [RequestReceived(3, Request("s", "m"))] == drain(server)
        [(stream_id, response)] = answers(server)
        assert (1, Status.RESOURCE_EXHAUSTED) == (stream_id, response.status.code)
        assert "message length 2000 exceed maximum message size of 1000" == response.status.message

    def test_oversized_answer_becomes_a_status(self) -> None:
        """An answer over the limit is replaced by RESOURCE_EXHAUSTED, so the caller is not left waiting."""
        server = Connection(Role.SERVER, max_message_length=100)
        server.receive_data(_ttrpc.encode_message(1, MessageType.REQUEST, Request("s", "m").encode()))
        drain(server)
        server.send_response(1, Response(payload=b"x" * 200))
        [(_, response)] = answers(server)
        assert Status.RESOURCE_EXHAUSTED == response.status.code

    def test_answer_only_once(self) -> None:
        """A stream is answered once; a second answer is a local error."""
        server = Connection(Role.SERVER)
        server.receive_data(_ttrpc.encode_message(1, MessageType.REQUEST, Request("s", "m").encode()))
        server.send_response(1, Response())
        with pytest.raises(ValueError, match="stream 1 has no request waiting"):
            server.send_response(1, Response())


class TestClientRules:
    def test_oversized_request_refused_locally(self) -> None:
        """A call too large to send fails at once, naming the method and the limit."""
        with pytest.raises(
            _ttrpc.OversizedMessage, match=r"s/m: message length \d+ exceed maximum message size of 4194304"
        ):
            Connection(Role.CLIENT).send_request(Request("s", "m", b"x" * MESSAGE_LENGTH_MAX))

    def test_answer_for_unknown_stream_ignored(self) -> None:
        """An answer nobody waits for (e.g. after a local timeout) is dropped with the reason."""
        client = Connection(Role.CLIENT)
        stream_id = client.send_request(Request("s", "m"))
        client.cancel(stream_id)
        client.receive_data(_ttrpc.encode_message(stream_id, MessageType.RESPONSE, Response().encode()))
        assert [Ignored(1, 2, "received message on inactive stream")] == drain(client)

    def test_oversized_answer_fails_the_call(self) -> None:
        """An answer over the limit fails its call with RESOURCE_EXHAUSTED; later answers still arrive."""
        client = Connection(Role.CLIENT, max_message_length=50)
        first, second = client.send_request(Request("s", "m")), client.send_request(Request("s", "m"))
        client.receive_data(b"\x00\x00\x00\x64\x00\x00\x00\x01\x02\x00")  # 100 bytes answering stream 1
        client.receive_data(
            b"z" * 100 + _ttrpc.encode_message(second, MessageType.RESPONSE, Response().encode())
        )
        [failed, ok] = drain(client)
        assert (first, Status.RESOURCE_EXHAUSTED) == (failed.stream_id, failed.response.status.code)
        assert ResponseReceived(second, Response()) == ok

    def test_undecodable_answer_fails_the_call(self) -> None:
        """An answer that is no ttrpc.Response fails its call with INTERNAL and the reason."""
        client = Connection(Role.CLIENT)
        stream_id = client.send_request(Request("s", "m"))
        client.receive_data(_ttrpc.encode_message(stream_id, MessageType.RESPONSE, b"\x12\x40"))
        [event] = drain(client)
        assert Status.INTERNAL == event.response.status.code
        assert "undecodable ttrpc response" in event.response.status.message
