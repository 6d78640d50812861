"""``python -m krproxy.bench.floor``: the floor of a hooked call on krproxy's stack.

Two small programs of nothing but trio, krproxy's sans-I/O HTTP/2 core (:mod:`krproxy.h2`) and unix
sockets. The hook anchor (:mod:`krproxy.bench.hookanchor`) runs them to measure what that stack alone
costs for the socket work of a hooked CreateContainer; krproxy minus the floor is krproxy's own Python.

``proxy --listen S --backend R [--hook H]``: one task per caller connection, one kept connection each
to the runtime and the hook server, each read by its own task. A caller stream is collected whole; on
CreateContainer (RunPodSandbox too with ``--points``) one unary call goes to the hook server first, and
when its trailers are in (status read, message ignored) the request (fields re-encoded, body bytes as
they came) goes to the runtime on a new stream, its answer back. Other calls are just forwarded. The
hook request is one fixed message of the shape koord's proxy builds for the bench client's create (pod
and container metadata, cgroup parent, an env variable, cpu shares): the Go hook server answers it as
it answers the Go proxy, adding BENCH, doing about the work it does in Go+Go.

``hook --socket H [--hook-dir D]``: answers every unary call, read whole, with one pre-built answer (an
empty message, status OK), and registers as ``krproxy hooks serve`` does (``D/floorhook.json``).

Each is a floor, not a product: every byte goes over the sockets, HTTP/2 is kept (windows, credit,
stream limits, resets), but nothing decodes CRI or hook messages, merges, rewrites or stores; no
records, metrics, deadlines or limits beyond HTTP/2's; no reconnection, no streaming calls. The core is
read in batches, not ``stepwise`` as the relay reads it (nothing here acts between two frames). Each
prints its counts as it stops (``floor proxy stopped: ...``): the hook anchor checks them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import trio

from krproxy.h2 import events as ev
from krproxy.h2 import frames as f
from krproxy.h2.connection import Connection, Role
from krproxy.proto.runtime import v1alpha1 as hookapi

#: Bytes asked of the kernel per read; a shorter read emptied the socket (see :meth:`_Peer.read`).
RECV_SIZE = 256 * 1024
HOOK_SERVICE = "/runtime.v1alpha1.RuntimeHookService/"
#: CRI path -> (hook point, hook method): the calls the proxy may hook.
HOOKED = {
    b"/runtime.v1.RuntimeService/CreateContainer": ("PreCreateContainer", "PreCreateContainerHook"),
    b"/runtime.v1.RuntimeService/RunPodSandbox": ("PreRunPodSandbox", "PreRunPodSandboxHook"),
}
#: The hook points hooked unless ``--points`` says otherwise: those the bench's hook servers register.
DEFAULT_POINTS = "PreCreateContainer"
ANSWER_HEADERS = f.encode_headers([(b":status", b"200"), (b"content-type", b"application/grpc")])
OK_TRAILERS = f.encode_headers([(b"grpc-status", b"0")])
EMPTY_MESSAGE = b"\x00\x00\x00\x00\x00"  # a gRPC frame of an empty message, uncompressed


def hook_request(point: str) -> bytes:
    """The fixed hook request for ``point``, gRPC-framed (see the module docstring)."""
    pod = hookapi.PodSandboxMetadata(name="bench-0", uid="bench-0-1", namespace="bench")
    if point != "PreCreateContainer":
        encoded = bytes(hookapi.PodSandboxHookRequest(pod_meta=pod, cgroup_parent="/kubepods/bench"))
    else:
        encoded = bytes(
            hookapi.ContainerResourceHookRequest(
                pod_meta=pod,
                container_meta=hookapi.ContainerMetadata(name="c0"),
                container_resources=hookapi.LinuxContainerResources(cpu_shares=512),
                pod_cgroup_parent="/kubepods/bench",
                container_envs={"A": "1"},
            )
        )
    return b"\x00" + len(encoded).to_bytes(4, "big") + encoded


def _hook_headers(method: str) -> bytes:
    path = (HOOK_SERVICE + method).encode()
    fields = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path), (b":authority", b"localhost")]
    return f.encode_headers([*fields, (b"content-type", b"application/grpc"), (b"te", b"trailers")])


class _Peer:
    """One HTTP/2 connection: a non-blocking unix socket, the core on it, the calls on its streams by id,
    and (a client's) the calls waiting for a slot below the peer's SETTINGS_MAX_CONCURRENT_STREAMS."""

    __slots__ = ("calls", "h2", "nursery", "sock", "waiting", "writing")

    def __init__(self, sock: socket.socket, role: Role, nursery: trio.Nursery) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.h2 = Connection(role)
        self.nursery = nursery
        self.writing = False
        self.calls: dict[int, _Call] = {}
        self.waiting: collections.deque[tuple[ev.Headers | bytes, bytes, _Call]] = collections.deque()

    def flush(self) -> None:
        """Write what the core queued, without waiting; a task writes the rest if the buffer is full."""
        if self.h2.output and not self.writing:
            self._send()
            if self.h2.output:
                self.writing = True
                self.nursery.start_soon(self._write_rest)

    async def _write_rest(self) -> None:
        with contextlib.suppress(trio.ClosedResourceError):  # closed by its reader meanwhile
            while self.h2.output:
                await trio.lowlevel.wait_writable(self.sock)
                self._send()
        self.writing = False

    def _send(self) -> None:
        out = self.h2.output
        try:
            sent = self.sock.send(out)
        except BlockingIOError:
            sent = 0
        except OSError:  # a peer gone takes nothing more (its reader sees the end)
            sent = len(out)
        del out[:sent]

    async def read(self, handle: Callable[[_Peer, list[ev.Event]], None], flush: Callable[[], None]) -> None:
        """Feed the core what arrives and ``handle`` its events, then ``flush``, until the peer closes
        or breaks HTTP/2. A short read emptied the socket: wait for more rather than ask for EAGAIN."""
        sock, h2 = self.sock, self.h2
        while True:
            try:
                data = sock.recv(RECV_SIZE)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                continue
            except OSError:  # (reset by the peer): the end, as a close
                data = b""
            if not data:
                return
            events = h2.receive_data(data)
            if events:
                handle(self, events)
            flush()
            if h2.terminated is not None:
                return
            if len(data) < RECV_SIZE:
                await trio.lowlevel.wait_readable(sock)

    async def serve(self, handle: Callable[[_Peer, list[Any]], None], flush: Callable[[], None]) -> None:
        """An accepted connection: our SETTINGS, then :meth:`read`; closed at the end."""
        try:
            self.flush()
            await self.read(handle, flush)
        finally:
            self.close()

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()

    def open(self, headers: ev.Headers | bytes, body: bytes, call: _Call) -> None:
        h2 = self.h2
        if not h2.can_start_stream():
            self.waiting.append((headers, body, call))
            return
        stream_id = h2.start_stream(headers)
        h2.send_data(stream_id, body, end_stream=True)
        self.calls[stream_id] = call
        call.upstream_id = stream_id

    def release(self, stream_id: int) -> None:
        self.calls.pop(stream_id, None)
        self.h2.release_stream(stream_id)
        while self.waiting and self.h2.can_start_stream():
            self.open(*self.waiting.popleft())

    def cancel(self, call: _Call) -> None:
        """The caller went: reset the stream serving ``call`` here, if one does."""
        if self.calls.get(call.upstream_id) is call:
            self.h2.reset_stream(call.upstream_id, f.CANCEL)
            self.release(call.upstream_id)
        else:
            self.waiting = collections.deque(w for w in self.waiting if w[2] is not call)


class _Call:
    """One caller stream: its request as collected, and the upstream stream serving it now."""

    __slots__ = ("body", "caller", "headers", "path", "stream_id", "upstream_id")

    def __init__(self, caller: _Peer, stream_id: int, headers: ev.Headers) -> None:
        self.caller = caller
        self.stream_id = stream_id
        self.headers = headers
        self.path = next((value for name, value in headers if name == b":path"), b"")
        self.body = bytearray()
        self.upstream_id = 0  # the hook's stream, then the runtime's; 0: none yet


class FloorProxy:
    """The floor proxy (module docstring): callers in, one runtime connection, at most one hook server's."""

    def __init__(self, points: set[str]) -> None:
        self.points = points
        self.backend: _Peer  # (set by run)
        self.upstreams: list[_Peer] = []
        self.hook: _Peer | None = None
        self.hook_calls: dict[bytes, tuple[bytes, bytes]] = {}  # CRI path -> (hook headers, request)
        self.dirty: list[_Peer] = []
        self.counts = {"calls": 0, "hook_calls": 0, "hook_failures": 0}
        self.lost = ""  # lost=runtime|hook-server, printed with the counts: that connection closed

    async def run(self, listen: str, backend: str, hook: str | None) -> None:
        async with trio.open_nursery() as nursery:
            self.backend = _Peer(_connect(backend), Role.CLIENT, nursery)
            self.upstreams.append(self.backend)
            nursery.start_soon(self._read_upstream, "runtime", self.backend, self._on_backend)
            if hook is not None:
                self.hook = _Peer(_connect(hook), Role.CLIENT, nursery)
                self.upstreams.append(self.hook)
                nursery.start_soon(self._read_upstream, "hook-server", self.hook, self._on_hook)
                for path, (point, method) in HOOKED.items():
                    if point in self.points:
                        self.hook_calls[path] = (_hook_headers(method), hook_request(point))
            self._flush()
            await _accept(_listen(listen), nursery, self._serve_caller)

    async def _read_upstream(
        self, name: str, upstream: _Peer, handle: Callable[[_Peer, list[Any]], None]
    ) -> None:
        """Read ``upstream`` until it closes; then the program stops (the floor does not reconnect)."""
        await upstream.read(handle, self._flush)
        self.lost = f"lost={name}"  # (its connection closed)
        upstream.nursery.cancel_scope.cancel()

    async def _serve_caller(self, caller: _Peer) -> None:
        try:
            await caller.serve(self._on_caller, self._flush)
        finally:
            calls = list(caller.calls.values())
            caller.calls.clear()
            for call in calls:
                for upstream in self.upstreams:
                    upstream.cancel(call)
            self._flush()

    def _flush(self) -> None:
        for peer in self.dirty:
            peer.flush()
        self.dirty.clear()
        for upstream in self.upstreams:
            upstream.flush()

    def _on_caller(self, caller: _Peer, events: list[Any]) -> None:
        # Events are read by class without cast() or isinstance(), as the relay reads them.
        calls = caller.calls
        h2 = caller.h2
        for event in events:
            kind = event.__class__
            if kind is ev.RequestReceived:
                call = calls[event.stream_id] = _Call(caller, event.stream_id, event.headers)
                if event.end_stream:
                    self._dispatch(call)
            elif kind is ev.DataReceived:
                h2.acknowledge_received_data(event.stream_id, event.flow_controlled_length)
                found = calls.get(event.stream_id)
                if found is not None:
                    found.body += event.data
                    if event.end_stream:
                        self._dispatch(found)
            elif kind is ev.TrailersReceived:
                found = calls.get(event.stream_id)
                if found is not None:
                    self._dispatch(found)
            elif kind is ev.DataSent:  # answer bytes that waited for the caller's windows went out
                found = calls.get(event.stream_id)
                if found is not None:
                    self.backend.h2.acknowledge_received_data(found.upstream_id, event.size)
                    if event.stream_ended:
                        self._done(found)
            elif kind is ev.StreamReset:
                found = calls.pop(event.stream_id, None)
                h2.release_stream(event.stream_id)
                if found is not None:
                    for upstream in self.upstreams:
                        upstream.cancel(found)

    def _dispatch(self, call: _Call) -> None:
        """The request is whole: to the hook server first if its path is hooked, else to the runtime."""
        hook_call = self.hook_calls.get(call.path)
        if hook_call is not None and self.hook is not None:
            self.counts["hook_calls"] += 1
            self.hook.open(*hook_call, call)
        else:
            self._forward(call)

    def _forward(self, call: _Call) -> None:
        self.counts["calls"] += 1
        self.backend.open(call.headers, bytes(call.body), call)

    def _done(self, call: _Call) -> None:
        """The answer's end went out: the caller's stream is released."""
        if call.caller.calls.pop(call.stream_id, None) is not None:
            call.caller.h2.release_stream(call.stream_id)

    def _on_hook(self, peer: _Peer, events: list[Any]) -> None:
        hook = self.hook
        assert hook is not None
        for event in events:
            kind = event.__class__
            if kind is ev.DataReceived:  # the answer's message: credited, not read
                peer.h2.acknowledge_received_data(event.stream_id, event.flow_controlled_length)
                continue
            if kind is ev.HeadersReceived and event.end_stream:  # the trailers: the status
                status = next((value for name, value in event.headers if name == b"grpc-status"), b"")
                failure = None if status == b"0" else f"grpc-status {status.decode(errors='replace')}"
            elif kind is ev.StreamReset:
                failure = f"stream reset (HTTP/2 error code {event.error_code})"
            else:  # the answer's headers, and the connection's events
                continue
            call = hook.calls.get(event.stream_id)
            hook.release(event.stream_id)
            if failure is not None:  # counted; the first one printed
                self.counts["hook_failures"] += 1
                if self.counts["hook_failures"] == 1:
                    print(f"floor proxy: hook failed: {failure}", file=sys.stderr, flush=True)
            if call is not None and call.caller.calls.get(call.stream_id) is call:  # Ignore policy: on
                self._forward(call)

    def _on_backend(self, peer: _Peer, events: list[Any]) -> None:
        backend = self.backend
        for event in events:
            kind = event.__class__
            if kind is ev.HeadersReceived:
                call = backend.calls.get(event.stream_id)
                if call is None:
                    continue
                caller = call.caller.h2
                stream = caller.stream(call.stream_id)
                if not event.end_stream:
                    caller.send_headers(call.stream_id, event.headers)
                elif stream is not None and stream.headers_sent:
                    caller.send_trailers(call.stream_id, event.headers)
                else:  # a trailers-only answer
                    caller.send_headers(call.stream_id, event.headers, end_stream=True)
                self.dirty.append(call.caller)
                if event.end_stream:
                    backend.release(event.stream_id)
                    if stream is None or stream.send_ended:
                        self._done(call)
            elif kind is ev.DataReceived:
                call = backend.calls.get(event.stream_id)
                taken = event.flow_controlled_length
                if call is not None:
                    taken = call.caller.h2.send_data(call.stream_id, event.data)
                    self.dirty.append(call.caller)
                peer.h2.acknowledge_received_data(event.stream_id, taken)  # the rest: on DataSent
            elif kind is ev.StreamReset:
                call = backend.calls.get(event.stream_id)
                backend.release(event.stream_id)
                if call is not None:
                    call.caller.h2.reset_stream(call.stream_id, f.INTERNAL_ERROR)
                    self.dirty.append(call.caller)
                    self._done(call)


class FloorHookServer:
    """The floor hook server (module docstring): one pre-built answer to every unary call."""

    def __init__(self) -> None:
        self.answered: collections.Counter[bytes] = collections.Counter()
        self.registration: str | None = None

    async def run(self, listen: str, hook_dir: str | None, points: list[str]) -> None:
        async with trio.open_nursery() as nursery:
            listener = _listen(listen)
            if hook_dir is not None:  # before any caller's handshake can finish: ready means registered
                self.registration = register(hook_dir, listen, points)
            await _accept(listener, nursery, lambda peer: peer.serve(self._on_events, peer.flush))

    def _on_events(self, peer: _Peer, events: list[Any]) -> None:
        h2, calls = peer.h2, peer.calls
        for event in events:
            kind = event.__class__
            end = False
            if kind is ev.RequestReceived:
                calls[event.stream_id] = _Call(peer, event.stream_id, event.headers)
                end = event.end_stream
            elif kind is ev.DataReceived:
                h2.acknowledge_received_data(event.stream_id, event.flow_controlled_length)
                end = event.end_stream
            elif kind is ev.TrailersReceived:
                end = True
            elif kind is ev.StreamReset:
                calls.pop(event.stream_id, None)
                h2.release_stream(event.stream_id)
            if end and event.stream_id in calls:
                stream_id = event.stream_id
                self.answered[calls.pop(stream_id).path] += 1
                if not h2.send_answer(stream_id, ANSWER_HEADERS, EMPTY_MESSAGE, OK_TRAILERS):
                    h2.send_headers(stream_id, ANSWER_HEADERS)
                    h2.send_data(stream_id, EMPTY_MESSAGE)
                    h2.send_trailers(stream_id, OK_TRAILERS)
                h2.release_stream(stream_id)  # (what waits for windows is dropped: 5 bytes, never)


def register(hook_dir: str, endpoint: str, points: list[str]) -> str:
    """Write ``hook_dir/floorhook.json`` as ``krproxy hooks serve`` does (temp file, rename); its path."""
    os.makedirs(hook_dir, exist_ok=True)
    path, temp = os.path.join(hook_dir, "floorhook.json"), os.path.join(hook_dir, ".floorhook.json.tmp")
    with open(temp, "w") as out:
        json.dump(
            {"remote-endpoint": endpoint, "failure-policy": "Ignore", "runtime-hooks": points},
            out,
            separators=(",", ":"),
        )
    os.replace(temp, path)
    return path


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


def _listen(path: str) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):  # a stale socket file
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def _accept(
    listener: socket.socket, nursery: trio.Nursery, serve: Callable[[_Peer], Awaitable[None]]
) -> NoReturn:
    """Accept connections for ever, each served by ``serve(peer)`` in a task of ``nursery``."""
    while True:
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            await trio.lowlevel.wait_readable(listener)
            continue
        nursery.start_soon(serve, _Peer(sock, Role.SERVER, nursery))


async def _until_signalled(run: Callable[..., Awaitable[None]], *args: Any) -> None:
    """``await run(*args)`` until it returns or SIGTERM or SIGINT comes."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()

            nursery.start_soon(on_signal)
            await run(*args)
            nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m krproxy.bench.floor", description=__doc__.split(".")[0])
    sub = parser.add_subparsers(dest="program", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--points", default=DEFAULT_POINTS, help="hook points, comma separated (%(default)s)")
    proxy = sub.add_parser("proxy", help="the floor proxy", parents=[common])
    proxy.add_argument("--listen", required=True, help="unix socket to serve")
    proxy.add_argument("--backend", required=True, help="the runtime's unix socket")
    proxy.add_argument("--hook", help="the hook server's unix socket (none: no hook calls)")
    hook = sub.add_parser("hook", help="the floor hook server", parents=[common])
    hook.add_argument("--socket", required=True, help="unix socket to serve")
    hook.add_argument("--hook-dir", help="where to write the registration file (none: not registered)")
    args = parser.parse_args(argv)
    points = [p for p in args.points.split(",") if p]
    if args.program == "proxy":
        floor = FloorProxy(set(points))
        # A SIGTERM after trio's receiver is gone (run() ended: an upstream closed first) must not kill it.
        signal.signal(signal.SIGTERM, lambda *_: None)
        try:  # the counts even after an error (its traceback follows them)
            trio.run(_until_signalled, floor.run, args.listen, args.backend, args.hook)
        finally:
            counts = " ".join(f"{name}={value}" for name, value in floor.counts.items())
            print(f"floor proxy stopped: {counts} {floor.lost}".rstrip(), file=sys.stderr, flush=True)
        return 1 if floor.lost else 0
    server = FloorHookServer()
    try:
        trio.run(_until_signalled, server.run, os.path.abspath(args.socket), args.hook_dir, points)
    finally:
        if server.registration is not None:
            os.unlink(server.registration)
        answered = [f"{path.decode(errors='replace')}={n}" for path, n in sorted(server.answered.items())]
        print(f"floor hook server stopped: answered={server.answered.total()}", *answered, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
