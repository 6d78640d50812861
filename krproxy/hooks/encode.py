"""The hook-request encoder: the one place hook requests (``runtime.v1alpha1``) are written, for every front end
(CRI, Docker and NRI mode, :mod:`krproxy.hooks.lifecycle`).

* :func:`pod_request` — ``PodSandboxHookRequest`` of a pod (PreRunPodSandbox, PostStopPodSandbox);
* :func:`pod_resize_request` — the same message for PreUpdatePodSandboxResources, of the resize's pod (its
  ``resources`` and ``overhead`` are the requested ones);
* :func:`container_request` — ``ContainerResourceHookRequest`` of a container (the five container hooks;
  ``container_resources`` absent when unknown).

Protobuf's wire format is written by hand from the records (protos/runtime_hook_v1alpha1.proto), several times
faster than building and encoding betterproto2 messages (which cost more than the rest of a hook call's own
work). proto3 leaves out scalars at their default; ``pod_meta`` and ``container_meta`` are always written (even
empty), other sub-messages when the record has them; a map is one entry message ``{1: key, 2: value}`` per
item, in the record's order, with an empty key or value left out of its entry (Go's decoder, koordlet's, reads
an absent one as ``""``; betterproto2 and Go's encoder would write it, which decodes the same). Every field
number is below 16, so each tag is one byte: ``field number << 3 | wire type`` (0 varint, 2 length-delimited).

Env values come from CRI as bytes decoded with ``surrogateescape``; a byte that is not UTF-8 is sent as U+FFFD.

An integer outside int64's and uint64's range (Docker's JSON has any size) raises ValueError naming it: the hook
call fails by the server's policy rather than send the value wrapped modulo 2^64.
"""

from __future__ import annotations

from collections.abc import Iterable

from krproxy.hooks.model import ContainerInfo, PodInfo, PodResize, Resources
from krproxy.protowire import varint

__all__ = ["container_request", "pod_request", "pod_resize_request"]


def _hook_safe(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return value


#: The varints of 0–127, one byte each: the lengths of nearly every string a hook request carries, written
#: without a call to :func:`~krproxy.protowire.varint` (a request is some forty fields, on every hooked call).
_SHORT = tuple(bytes((n,)) for n in range(0x80))


def _put_str(out: bytearray, tag: bytes, value: str) -> None:
    if value:
        data = value.encode()
        n = len(data)
        out += tag
        out += _SHORT[n] if n < 0x80 else varint(n)
        out += data


#: The integers a varint field holds: int64's and uint64's (and uint32 attempts, as betterproto2 wrote them).
_INT_MIN, _INT_END = -(1 << 63), 1 << 64


def _put_int(out: bytearray, tag: bytes, value: int) -> None:
    if value:
        if not _INT_MIN <= value < _INT_END:  # Docker's JSON has integers of any size; CRI's and NRI's not
            raise ValueError(f"{value} does not fit the hook protocol's 64-bit integers")
        out += tag
        out += _SHORT[value] if 0 < value < 0x80 else varint(value)


def _put_message(out: bytearray, tag: bytes, body: bytes | bytearray) -> None:
    n = len(body)
    out += tag
    out += _SHORT[n] if n < 0x80 else varint(n)
    out += body


#: The tags of a map entry's fields (tags are ``field number << 3 | wire type``; 2: length-delimited, 0: varint).
_KEY, _VALUE = b"\x0a", b"\x12"


def _put_map(out: bytearray, tag: bytes, items: Iterable[tuple[str, str]], *, replace: bool = False) -> None:
    """One entry message per item; *replace*: a value that is not UTF-8 (an env's, decoded with
    surrogateescape) is sent with U+FFFD for its bytes that are not (:func:`_hook_safe`)."""
    for key, value in items:
        k = key.encode()
        try:
            v = value.encode()
        except UnicodeEncodeError:
            if not replace:
                raise
            v = _hook_safe(value).encode()
        nk, nv = len(k), len(v)
        size = (nk + 2 if nk else 0) + (nv + 2 if nv else 0)
        if size < 0x80:  # every length one byte (the entry's and so its fields'): written inline
            out += tag
            out += _SHORT[size]
            if nk:
                out += _KEY
                out += _SHORT[nk]
                out += k
            if nv:
                out += _VALUE
                out += _SHORT[nv]
                out += v
            continue
        entry = bytearray()
        _put_bytes(entry, _KEY, k)
        _put_bytes(entry, _VALUE, v)
        _put_message(out, tag, entry)


def _put_bytes(out: bytearray, tag: bytes, data: bytes) -> None:
    if data:
        _put_message(out, tag, data)


def _resources(r: Resources) -> bytearray:
    """``LinuxContainerResources`` (fields 1–10)."""
    out = bytearray()
    _put_int(out, b"\x08", r.cpu_period)
    _put_int(out, b"\x10", r.cpu_quota)
    _put_int(out, b"\x18", r.cpu_shares)
    _put_int(out, b"\x20", r.memory_limit_in_bytes)
    _put_int(out, b"\x28", r.oom_score_adj)
    _put_str(out, b"\x32", r.cpuset_cpus)
    _put_str(out, b"\x3a", r.cpuset_mems)
    for page_size, limit in r.hugepage_limits:  # HugepageLimit {1: page_size, 2: limit}
        entry = bytearray()
        _put_str(entry, b"\x0a", page_size)
        _put_int(entry, b"\x10", limit)
        _put_message(out, b"\x42", entry)
    if r.unified:
        _put_map(out, b"\x4a", r.unified.items())
    _put_int(out, b"\x50", r.memory_swap_limit_in_bytes)
    return out


def _pod_meta(pod: PodInfo) -> bytearray:
    """``PodSandboxMetadata`` {1: name, 2: uid, 3: namespace, 4: attempt}."""
    out = bytearray()
    _put_str(out, b"\x0a", pod.name)
    _put_str(out, b"\x12", pod.uid)
    _put_str(out, b"\x1a", pod.namespace)
    _put_int(out, b"\x20", pod.attempt)
    return out


def pod_request(pod: PodInfo) -> bytes:
    """The ``PodSandboxHookRequest`` of PreRunPodSandbox and PostStopPodSandbox hooks for *pod*."""
    out = bytearray()
    _put_message(out, b"\x0a", _pod_meta(pod))  # 1 pod_meta
    _put_str(out, b"\x12", pod.runtime_handler)  # 2
    _put_map(out, b"\x1a", pod.labels.items())  # 3
    _put_map(out, b"\x22", pod.annotations.items())  # 4
    _put_str(out, b"\x2a", pod.cgroup_parent)  # 5
    if pod.overhead is not None:
        _put_message(out, b"\x32", _resources(pod.overhead))  # 6
    if pod.resources is not None:
        _put_message(out, b"\x3a", _resources(pod.resources))  # 7
    return bytes(out)


def pod_resize_request(resize: PodResize) -> bytes:
    """The PreUpdatePodSandboxResources request: :func:`pod_request` of the resize's pod."""
    return pod_request(resize.pod)


def container_request(container: ContainerInfo) -> bytes:
    """The ``ContainerResourceHookRequest`` of the container hooks for *container*."""
    pod = container.pod
    out = bytearray()
    _put_message(out, b"\x0a", _pod_meta(pod))  # 1 pod_meta
    meta = bytearray()  # 2 container_meta: ContainerMetadata {1: name, 2: attempt, 3: id}
    _put_str(meta, b"\x0a", container.name)
    _put_int(meta, b"\x10", container.attempt)
    _put_str(meta, b"\x1a", container.id)
    _put_message(out, b"\x12", meta)
    _put_map(out, b"\x1a", container.annotations.items())  # 3 container_annotations
    if container.resources is not None:
        _put_message(out, b"\x22", _resources(container.resources))  # 4 container_resources
    if pod.resources is not None:
        _put_message(out, b"\x2a", _resources(pod.resources))  # 5 pod_resources
    _put_map(out, b"\x32", pod.annotations.items())  # 6 pod_annotations
    _put_map(out, b"\x3a", pod.labels.items())  # 7 pod_labels
    _put_str(out, b"\x42", container.pod_cgroup_parent)  # 8
    _put_map(out, b"\x4a", container.envs.items(), replace=True)  # 9 container_envs
    return bytes(out)
