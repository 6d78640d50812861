"""Reading the CRI messages the hook interceptors take apart (:mod:`krproxy.hooks.runtime`): an id
straight off the wire where that is safe, whole messages with betterproto2 (large ones in a worker
thread), and the INVALID_ARGUMENT a malformed one gets, so that it reaches neither the hooks nor the
runtime and crashes nothing.

A whole message is first read and written again by upb (:func:`as_go_reads`), so that betterproto2 reads
what containerd's Go decoder reads: protobuf merges a message field sent more than once, where betterproto2
keeps the last one alone (a RunPodSandbox whose config came in two parts would reach the hooks without the
first part's metadata, and a plugin's change would send the request on without it)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import trio
from google.protobuf.message import DecodeError as ProtobufDecodeError

from krproxy import log, protowire
from krproxy.grpcstatus import GRPCError, Status
from krproxy.hooks import wire

LOGGER = logging.getLogger("krproxy.hooks")


#: plain_id's reading of each (message type, field): the field's number and the message's known fields.
_ID_FIELDS: dict[tuple[type[Any], str], tuple[int, dict[int, str]]] = {}


def plain_id(message_type: type[Any], data: bytes, field: str) -> str | None:
    """The string *field* of a message of *message_type* read straight off the wire, as betterproto2
    would read it: the field's last occurrence (proto3's rule for a scalar sent twice), ``""`` when absent,
    other fields skipped. None when the bytes are anything else (malformed, the field or another
    known one with another wire type, not UTF-8): the caller decodes them with betterproto2 then, for its reading or its error.

    Every CreateContainer and RemoveContainer reads one such message (CreateContainerResponse,
    RemoveContainerRequest): 1.0 µs here, 4.4 µs through betterproto2 (load ~2.5).
    """
    key = (message_type, field)
    read = _ID_FIELDS.get(key)
    if read is None:
        meta = message_type._betterproto  # (a descriptor: two calls a read)
        read = _ID_FIELDS[key] = (meta.meta_by_field_name[field].number, meta.field_name_by_number)
    number, known = read
    n = len(data)
    if (
        n >= 2
        and number < 16
        and data.__class__ is bytes
        and data[0] == (number << 3 | 2)
        and data[1] < 0x80
        and n == data[1] + 2
    ):
        # The usual message: the field alone, one-byte tag and length (a container id). Read as the loop
        # below reads it, without the generator and its varints.
        try:
            return data[2:].decode()
        except UnicodeDecodeError:
            return None
    value = ""
    try:
        for found, wire_type, raw in protowire.fields(data):
            if wire_type in (1, 5) and found in known:  # none is fixed-width: betterproto2 refuses it
                return None  # (StopContainerRequest's int64 timeout sent as a fixed32 or fixed64)
            if found == number:
                if not isinstance(raw, bytes):  # another wire type
                    return None
                value = raw.decode()  # each occurrence: betterproto2 refuses any that is not UTF-8
    except (protowire.DecodeError, UnicodeDecodeError):
        return None
    return value


def reply_field(message_type: type[Any], reply: bytes, field: str) -> str | None:
    """One id field of a backend reply message, or None (logged) if the reply does not decode.

    The reply still goes back to kubelet unchanged: only the store misses the entry.
    """
    plain = plain_id(message_type, reply, field)
    if plain is not None:
        return plain
    try:
        value: str = getattr(message_type.FromString(reply), field)
    except Exception as err:
        log.warning(
            LOGGER, "reply_undecodable", message=message_type.__name__, error=f"{type(err).__name__}: {err}"
        )
        return None
    return value


_GROUP = 3  # the wire type that starts a group

#: upb's class of each CRI message type read here, by betterproto2 class (None: no such CRI message).
_UPB: dict[type[Any], Any] = {}


def as_go_reads(message_type: type[Any], data: bytes) -> bytes:
    """*data* as upb writes what it reads: a message field sent twice merged into one, the rest as it
    came (unknown fields kept, map entries in their order: :mod:`krproxy.hooks.wire` reads maps as their
    entries); *data* itself when *message_type* is no betterproto2 CRI message. About 3 µs for a kubelet's
    RunPodSandbox, against betterproto2's 0.3-0.5 ms reading.

    A request holding a known field with another wire type, or a group, which Go and upb keep as unknown
    fields and betterproto2 would misread, is written without its unknown fields (telling whether there
    are unknown fields at all costs about 2 µs a request; only a request with some is looked through).

    Raises ``google.protobuf.message.DecodeError`` for bytes Go refuses too, some of which betterproto2
    would read (a field cut short: betterproto2 takes what is there)."""
    try:
        upb = _UPB[message_type]
    except KeyError:
        upb = None
        if hasattr(message_type, "_betterproto"):  # a upb class (hooks.rewrite's) merges by itself
            with contextlib.suppress(KeyError):
                upb = wire.message_class(message_type.__name__)
        _UPB[message_type] = upb
    if upb is None:
        return data
    message = upb.FromString(data)
    written: bytes = message.SerializeToString()
    message.DiscardUnknownFields()
    if message.ByteSize() == len(written):
        return written
    read = upb.FromString(data)
    _refuse_misread_entries(read)
    if not _misread_unknowns(read):
        return written
    # Go keeps a known field sent with another wire type, and a group, as unknown fields, which upb
    # writes back at the message's end, where betterproto2 would read the first as the known field
    # (a value of the wrong type, or the last word over the field sent right) and a group's fields as
    # the outer message's own: betterproto2 reads what Go read, without the unknown fields.
    known: bytes = message.SerializeToString()
    return known


class EntryMisread(ValueError):
    """A map entry's key or value came with another wire type, which runtimes read differently."""


def _refuse_misread_entries(message: Any) -> None:
    """Raise :class:`EntryMisread` if a map entry of *message* (upb) holds its key or value with another
    wire type (:func:`krproxy.hooks.wire.misread_entry`): gogo protobuf (containerd 1.6, 1.7, 2.1) reads
    it as the key or value, upb and Go's protobuf (containerd 2.3) leave it out, and krproxy cannot tell
    which runtime is behind it, so its hooks could be shown a label or annotation the runtime does not
    record (a skip label ``false`` that containerd records ``true``)."""
    problem = wire.misread_entry(message)
    if problem is not None:
        raise EntryMisread(
            f"{problem}: runtimes read a map entry's key or value of another wire type differently"
            " (gogo protobuf as a string, Go's protobuf and upb not at all), so krproxy refuses it"
        )


def upb_as_go_reads(message_type: type[Any], data: bytes) -> Any:
    """*data* read by the upb class *message_type*, unknown fields kept, after
    :func:`_refuse_misread_entries`; looked through only if it holds unknown fields, told by its size
    without them: the usual request has none, and dropping none leaves it as read (~3 µs for a kubelet's
    CreateContainer); one that has some is read again to keep them."""
    message = message_type.FromString(data)
    size = message.ByteSize()
    message.DiscardUnknownFields()
    if message.ByteSize() != size:
        message = message_type.FromString(data)
        _refuse_misread_entries(message)
    return message


def _misread_unknowns(message: Any) -> bool:
    """Whether *message* (upb), at any depth, holds an unknown field betterproto2 would misread: a
    known field's number (sent with another wire type) or a group."""
    return wire.misread_unknown(message) is not None


def decode(message_type: type[Any], data: bytes, what: str) -> Any:
    """*data* read as a *message_type*, as the runtime's Go decoder reads it (:func:`as_go_reads`).

    Bytes Go refuses too (a field cut short, a string that is not UTF-8) are answered as grpc-go's server
    answers a request its codec refuses: INTERNAL, "grpc: error unmarshalling request: ..." (grpc-go
    server.go; measured on containerd 1.6.20 and 2.1.9). Bytes Go reads and krproxy's reader does not
    are INVALID_ARGUMENT: the runtime would have read them, krproxy cannot hook them, so it refuses.
    """
    try:
        if hasattr(message_type, "_betterproto"):
            return message_type.FromString(as_go_reads(message_type, data))
        return upb_as_go_reads(message_type, data)  # a upb class (rewrite's)
    except ProtobufDecodeError as err:  # upb's, reading as Go does (or *message_type* is upb's own)
        status, problem = Status.INTERNAL, f"{UNMARSHAL} {what}: {err}"
    except Exception as err:  # a malformed request must not reach the hooks, nor crash anything
        status, problem = Status.INVALID_ARGUMENT, f"cannot decode {what}: {err}"
    # Raised outside the except block: the decoder's exception, whose traceback holds ``data``
    # in a reference cycle (frame -> exception -> traceback -> frame), is not kept as context.
    raise GRPCError(status, problem)


#: How grpc-go's server starts the message of a request its codec refuses (with INTERNAL).
UNMARSHAL = "grpc: error unmarshalling request:"


#: Requests at least this large are decoded in a worker thread: a 16 MiB CreateContainer of
#: 16,000 annotations takes ~0.7 s to decode (~43 ms per MB), which on the event loop would
#: stall every other call for as long; in a thread the loop keeps getting the GIL between them.
THREAD_DECODE_AT = 256 * 1024


async def decode_request(message_type: type[Any], data: bytes, what: str) -> Any:
    if len(data) < THREAD_DECODE_AT:
        return decode(message_type, data, what)
    return await trio.to_thread.run_sync(decode, message_type, data, what)


def decode_id(message_type: type[Any], data: bytes, field: str) -> str:
    """The id field of a request that carries only an id."""
    plain = plain_id(message_type, data, field)
    if plain is not None:
        return plain
    value = getattr(decode(message_type, data, message_type.__name__), field)
    if not isinstance(value, str):
        raise GRPCError(
            Status.INVALID_ARGUMENT, f"malformed {message_type.__name__}: {field} is not a string"
        )
    return value


class malformed:
    """Reading a decoded request failed: the request was malformed, not the proxy broken.

    betterproto2 decodes a field sent with the wrong wire type into a value of the wrong type
    (``config == 1``) instead of refusing it, so such requests only failed once read; :func:`decode`
    now hands it what Go reads (no such field: :func:`as_go_reads`), and this stays as a last guard.

    A class, not a ``contextlib.contextmanager``: that costs about 8 Python calls a use (a generator
    and its wrapper), on every hooked CreateContainer once or twice; this 3.
    """

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: object) -> None:
        if kind is not None and issubclass(kind, (AttributeError, TypeError, ValueError)):
            raise GRPCError(
                Status.INVALID_ARGUMENT, f"malformed {self.what}: {kind.__name__}: {err}"
            ) from None


def with_id(data: bytes, number: int, ident: str) -> bytes:
    """The message *data* with its string field *number* set to *ident*: every occurrence of the field dropped,
    one written at the end (protobuf reads a scalar's last occurrence), every other field kept as it came.

    *data* must be a message whose id was read (:func:`plain_id` or a decoder): one that
    does not parse raises :class:`krproxy.protowire.DecodeError`.
    """
    kept = bytearray()
    pos = 0
    while pos < len(data):
        start = pos
        key, pos = protowire.read_varint(data, pos)
        found, wire_type = key >> 3, key & 7
        if not 0 < found <= protowire.MAX_FIELD_NUMBER:
            raise protowire.DecodeError(f"field number {found}")
        pos = _skip(data, pos, wire_type, found)
        if found != number:
            kept += data[start:pos]
    value = ident.encode()
    kept += protowire.varint(number << 3 | 2) + protowire.varint(len(value)) + value
    return bytes(kept)


def _skip(data: bytes, pos: int, wire_type: int, number: int) -> int:
    """The position after the value of a field of *wire_type* starting at *pos*."""
    if wire_type == 0:
        return protowire.read_varint(data, pos)[1]
    if wire_type == 2:
        length, pos = protowire.read_varint(data, pos)
        end = pos + length
    elif wire_type in (1, 5):
        end = pos + (8 if wire_type == 1 else 4)
    else:  # groups (3, 4) and the unused 6, 7: no id-carrying request of the CRI has them
        raise protowire.DecodeError(f"field {number}: wire type {wire_type}")
    if end > len(data):
        raise protowire.DecodeError(f"field {number}: truncated")
    return end


def same_pod(sandbox_id: str, pod: Any, meta: Any) -> None:
    """Refuse a CreateContainer whose ``sandbox_config`` (*meta*: its metadata) names another pod than the
    stored sandbox it goes into (*pod*): containerd writes the request's pod name and namespace into the
    container's OCI spec (``io.kubernetes.cri.sandbox-name``, ``-namespace``), while the hooks are shown the
    stored pod. kubelet sends the sandbox's own config (a pod's name, namespace and uid never
    change). A config naming no pod at all (no metadata: tests, hand-made calls) is let through: containerd
    writes empty names then, which pass for no other pod.

    Raises:
        GRPCError: INVALID_ARGUMENT, naming both pods.
    """
    if not pod.named_otherwise(meta.name, meta.namespace, meta.uid):
        return
    raise GRPCError(
        Status.INVALID_ARGUMENT,
        f"CreateContainer for pod sandbox {sandbox_id} ({pod.namespace}/{pod.name}, uid {pod.uid!r}) carries"
        f" the sandbox_config of {meta.namespace}/{meta.name} (uid {meta.uid!r}): send the config the pod"
        " sandbox was run with",
    )
