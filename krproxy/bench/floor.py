"""``python -m krproxy.bench.floor``: the floor of a hooked call on krproxy's stack.

Two small programs built of nothing but trio, krproxy's sans-I/O HTTP/2 core
(:class:`krproxy.h2.connection.Connection`) and the kernel's unix sockets, so that the hook anchor
(:mod:`krproxy.bench.hookanchor`) can measure what that stack alone costs for the socket work of a
hooked CreateContainer; krproxy's figure minus the floor's is what krproxy's own Python adds:

``proxy --listen S --backend R [--hook H]``
    One task reads each caller connection, one kept client connection goes to the runtime and one
    to the hook server, each read by a task of its own. Each caller stream is collected whole
    (HEADERS, DATA until END_STREAM). On CreateContainer (RunPodSandbox too with ``--points``) one
    unary call goes to the hook server first (PreCreateContainerHook, resp. PreRunPodSandboxHook);
    when its trailers are in (the status read, the message ignored), the caller's request (its
    header fields re-encoded, its body bytes unchanged) goes to the runtime on a new stream, and
    the runtime's answer (headers, data, trailers) back to the caller. Every other call is
    forwarded so. The hook request is one fixed message built at start, of the shape koord's proxy
    builds for the bench client's create (pod metadata, cgroup parent, container metadata, one
    env variable, cpu shares; the same pod on every call): the Go hook server answers it as it
    answers the Go proxy, with the pod's name added as BENCH, doing about the work it does in Go+Go.
``hook --socket H [--hook-dir D]``
    Answers every unary call, after reading its request whole, with one pre-built answer (an empty
    message, status OK); writes its registration file, ``floorhook.json``, into ``D`` as ``krproxy
    hooks serve`` and ``tests/gohookserver`` do (same JSON), so that krproxy and the Go proxy find it.

Each is a floor, not a product: every byte goes over the sockets and HTTP/2 is kept (windows, credit,
stream limits, resets), but there is no CRI or hook decoding, no hook request built from the
call, no merge or rewrite, no store of pods and containers, no records, metrics, trace or logs, no
limits beyond HTTP/2's, no deadlines, no reconnection (a lost runtime or hook connection ends the
program), no streaming calls (every request is taken whole first). Where krproxy spends more than
this, the difference is its own Python, not the stack's.

Both read the core in its batch mode (all of a read's frames at once, not ``stepwise`` as the relay
does: nothing here depends on acting between two frames). On SIGTERM or SIGINT each prints one line
of counts (``floor proxy stopped: calls=... hook_calls=... hook_failures=...``, ``floor hook server
stopped: answered=...``), which the hook anchor and ``tests/integration/test_bench_floor.py`` check.
"""

from __future__ import annotations

import argparse
import collections
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


def _framed(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


def hook_request(point: str) -> bytes:
    """The fixed hook request for ``point``, gRPC-framed (see the module docstring)."""
    pod = hookapi.PodSandboxMetadata(name="bench-0", uid="bench-0-1", namespace="bench")
    message: Any
    if point == "PreCreateContainer":
        message = hookapi.ContainerResourceHookRequest(
            pod_meta=pod,
            container_meta=hookapi.ContainerMetadata(name="c0"),
            container_resources=hookapi.LinuxContainerResources(cpu_shares=512),
            pod_cgroup_parent="/kubepods/bench",
            container_envs={"A": "1"},
        )
    else:
        message = hookapi.PodSandboxHookRequest(pod_meta=pod, cgroup_parent="/kubepods/bench")
    return _framed(bytes(message))


def _hook_headers(method: str) -> bytes:
    return f.encode_headers(
        [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", (HOOK_SERVICE + method).encode()),
            (b":authority", b"localhost"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]
    )


class _Peer:
    """One HTTP/2 connection: a non-blocking unix socket and the core that reads and writes it."""

    __slots__ = ("h2", "nursery", "sock", "writing")

    def __init__(self, sock: socket.socket, role: Role, nursery: trio.Nursery) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.h2 = Connection(role)
        self.nursery = nursery
        self.writing = False

    def flush(self) -> None:
        """Write what the core queued, without waiting; a task writes the rest when the buffer is full."""
        out = self.h2.output
        if not out or self.writing:
            return
        try:
            sent = self.sock.send(out)
        except BlockingIOError:
            sent = 0
        del out[:sent]
        if out:
            self.writing = True
            self.nursery.start_soon(self._write_rest)

    async def _write_rest(self) -> None:
        out = self.h2.output
        while out:
            await trio.lowlevel.wait_writable(self.sock)
            try:
                sent = self.sock.send(out)
            except BlockingIOError:
                continue
            del out[:sent]
        self.writing = False

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

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()


class _Caller:
    """A caller's connection: its peer and its calls, by stream id."""

    __slots__ = ("calls", "peer")

    def __init__(self, peer: _Peer) -> None:
        self.peer = peer
        self.calls: dict[int, _Call] = {}


class _Call:
    """One caller stream: its request as collected, and the upstream stream serving it now."""

    __slots__ = ("body", "caller", "headers", "path", "stream_id", "upstream_id")

    def __init__(self, caller: _Caller, stream_id: int, headers: ev.Headers) -> None:
        self.caller = caller
        self.stream_id = stream_id
        self.headers = headers
        self.path = next((value for name, value in headers if name == b":path"), b"")
        self.body = bytearray()
        self.upstream_id = 0  # the hook's stream, then the runtime's; 0: none yet

    @property
    def live(self) -> bool:
        """The caller still waits for the answer (its stream not reset, its connection open)."""
        return self.caller.calls.get(self.stream_id) is self


class _Upstream:
    """A kept client connection (to the runtime or the hook server): the calls on its streams, by
    stream id, and those waiting for a stream slot (the peer's SETTINGS_MAX_CONCURRENT_STREAMS)."""

    __slots__ = ("calls", "peer", "waiting")

    def __init__(self, peer: _Peer) -> None:
        self.peer = peer
        self.calls: dict[int, _Call] = {}
        self.waiting: collections.deque[tuple[ev.Headers | bytes, bytes, _Call]] = collections.deque()

    def open(self, headers: ev.Headers | bytes, body: bytes, call: _Call) -> None:
        h2 = self.peer.h2
        if not h2.can_start_stream():
            self.waiting.append((headers, body, call))
            return
        stream_id = h2.start_stream(headers)
        h2.send_data(stream_id, body, end_stream=True)
        self.calls[stream_id] = call
        call.upstream_id = stream_id

    def release(self, stream_id: int) -> None:
        self.calls.pop(stream_id, None)
        self.peer.h2.release_stream(stream_id)
        while self.waiting and self.peer.h2.can_start_stream():
            self.open(*self.waiting.popleft())

    def cancel(self, call: _Call) -> None:
        """The caller went: reset the stream serving ``call`` here, if one does."""
        if self.calls.get(call.upstream_id) is call:
            self.peer.h2.reset_stream(call.upstream_id, f.CANCEL)
            self.release(call.upstream_id)
        else:
            self.waiting = collections.deque(w for w in self.waiting if w[2] is not call)


class _Lost(Exception):
    """An upstream connection ended: the floor proxy stops (:attr:`FloorProxy.lost` says which)."""


class FloorProxy:
    """The floor proxy (module docstring): callers in, one runtime connection, at most one hook server's."""

    def __init__(self, points: set[str]) -> None:
        self.points = points
        self.backend: _Upstream  # (set by run)
        self.upstreams: list[_Upstream] = []
        self.hook: _Upstream | None = None
        self.hook_calls: dict[bytes, tuple[bytes, bytes]] = {}  # CRI path -> (hook headers, request)
        self.dirty: list[_Peer] = []
        self.counts = {"calls": 0, "hook_calls": 0, "hook_failures": 0}
        self.lost = ""  # why it stopped, if an upstream connection ended

    async def run(
        self, listen: str, backend: str, hook: str | None, task_status: trio.TaskStatus[None]
    ) -> None:
        async with trio.open_nursery() as nursery:
            self.backend = _Upstream(_Peer(_connect(backend), Role.CLIENT, nursery))
            self.upstreams.append(self.backend)
            nursery.start_soon(self._read_upstream, "the runtime", self.backend, self._on_backend)
            if hook is not None:
                self.hook = _Upstream(_Peer(_connect(hook), Role.CLIENT, nursery))
                self.upstreams.append(self.hook)
                nursery.start_soon(self._read_upstream, "the hook server", self.hook, self._on_hook)
                for path, (point, method) in HOOKED.items():
                    if point in self.points:
                        self.hook_calls[path] = (_hook_headers(method), hook_request(point))
            self._flush()
            listener = _listen(listen)
            task_status.started()
            await _accept(listener, nursery, lambda peer: self._serve_caller(_Caller(peer)))

    async def _read_upstream(
        self, name: str, upstream: _Upstream, handle: Callable[[_Peer, list[Any]], None]
    ) -> None:
        """Read ``upstream`` until it closes; then the program stops (the floor does not reconnect)."""
        await upstream.peer.read(handle, self._flush)
        self.lost = f"{name} closed its connection"
        raise _Lost()

    async def _serve_caller(self, caller: _Caller) -> None:
        try:
            caller.peer.flush()  # our SETTINGS
            await caller.peer.read(lambda _, events: self._on_caller(caller, events), self._flush)
        finally:
            caller.peer.close()
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
            upstream.peer.flush()

    # -- callers ---------------------------------------------------------------------------

    def _on_caller(self, caller: _Caller, events: list[Any]) -> None:
        # Events are read by class without cast() or isinstance(), as the relay reads them.
        calls = caller.calls
        h2 = caller.peer.h2
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
                    self.backend.peer.h2.acknowledge_received_data(found.upstream_id, event.size)
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
            call.caller.peer.h2.release_stream(call.stream_id)

    # -- upstreams -------------------------------------------------------------------------

    def _on_hook(self, peer: _Peer, events: list[Any]) -> None:
        hook = self.hook
        assert hook is not None
        for event in events:
            kind = event.__class__
            if kind is ev.HeadersReceived:
                if not event.end_stream:  # the answer's headers; its trailers end it
                    continue
                call = hook.calls.get(event.stream_id)
                hook.release(event.stream_id)
                status = next((value for name, value in event.headers if name == b"grpc-status"), b"")
                if status != b"0":
                    self._hook_failed(f"grpc-status {status.decode(errors='replace')}")
                if call is not None and call.live:  # failure-policy Ignore: the call goes on
                    self._forward(call)
            elif kind is ev.DataReceived:  # the answer's message: credited, not read
                peer.h2.acknowledge_received_data(event.stream_id, event.flow_controlled_length)
            elif kind is ev.StreamReset:
                call = hook.calls.get(event.stream_id)
                hook.release(event.stream_id)
                self._hook_failed(f"stream reset (HTTP/2 error code {event.error_code})")
                if call is not None and call.live:
                    self._forward(call)

    def _hook_failed(self, why: str) -> None:
        """Counted; the first one is printed (the count is in the line printed at the end)."""
        self.counts["hook_failures"] += 1
        if self.counts["hook_failures"] == 1:
            print(f"floor proxy: hook failed: {why}", file=sys.stderr, flush=True)

    def _on_backend(self, peer: _Peer, events: list[Any]) -> None:
        backend = self.backend
        for event in events:
            kind = event.__class__
            if kind is ev.HeadersReceived:
                call = backend.calls.get(event.stream_id)
                if call is None:
                    continue
                caller = call.caller.peer.h2
                stream = caller.stream(call.stream_id)
                if not event.end_stream:
                    caller.send_headers(call.stream_id, event.headers)
                elif stream is not None and stream.headers_sent:
                    caller.send_trailers(call.stream_id, event.headers)
                else:  # a trailers-only answer
                    caller.send_headers(call.stream_id, event.headers, end_stream=True)
                self.dirty.append(call.caller.peer)
                if event.end_stream:
                    backend.release(event.stream_id)
                    if stream is None or stream.send_ended:
                        self._done(call)
            elif kind is ev.DataReceived:
                call = backend.calls.get(event.stream_id)
                taken = event.flow_controlled_length
                if call is not None:
                    taken = call.caller.peer.h2.send_data(call.stream_id, event.data)
                    self.dirty.append(call.caller.peer)
                peer.h2.acknowledge_received_data(event.stream_id, taken)  # the rest: on DataSent
            elif kind is ev.StreamReset:
                call = backend.calls.get(event.stream_id)
                backend.release(event.stream_id)
                if call is not None:
                    call.caller.peer.h2.reset_stream(call.stream_id, f.INTERNAL_ERROR)
                    self.dirty.append(call.caller.peer)
                    self._done(call)


class FloorHookServer:
    """The floor hook server (module docstring): one pre-built answer to every unary call."""

    def __init__(self) -> None:
        self.answered: collections.Counter[bytes] = collections.Counter()
        #: The registration file written (None: none), removed by the caller of :meth:`run`.
        self.registration: str | None = None

    async def run(
        self, listen: str, hook_dir: str | None, points: list[str], task_status: trio.TaskStatus[None]
    ) -> None:
        async with trio.open_nursery() as nursery:
            listener = _listen(listen)
            if hook_dir is not None:  # before any caller's handshake can finish: ready means registered
                self.registration = register(hook_dir, listen, points)
            task_status.started()
            await _accept(listener, nursery, self._serve)

    async def _serve(self, peer: _Peer) -> None:
        paths: dict[int, bytes] = {}
        try:
            peer.flush()
            await peer.read(lambda _, events: self._on_events(peer, paths, events), peer.flush)
        finally:
            peer.close()

    def _on_events(self, peer: _Peer, paths: dict[int, bytes], events: list[Any]) -> None:
        h2 = peer.h2
        for event in events:
            kind = event.__class__
            end = False
            if kind is ev.RequestReceived:
                paths[event.stream_id] = next((v for n, v in event.headers if n == b":path"), b"")
                end = event.end_stream
            elif kind is ev.DataReceived:
                h2.acknowledge_received_data(event.stream_id, event.flow_controlled_length)
                end = event.end_stream
            elif kind is ev.TrailersReceived:
                end = True
            elif kind is ev.StreamReset:
                paths.pop(event.stream_id, None)
                h2.release_stream(event.stream_id)
            if end and event.stream_id in paths:
                stream_id = event.stream_id
                self.answered[paths.pop(stream_id)] += 1
                if not h2.send_answer(stream_id, ANSWER_HEADERS, EMPTY_MESSAGE, OK_TRAILERS):
                    h2.send_headers(stream_id, ANSWER_HEADERS)
                    h2.send_data(stream_id, EMPTY_MESSAGE)
                    h2.send_trailers(stream_id, OK_TRAILERS)
                h2.release_stream(stream_id)  # (what waits for windows is dropped: 5 bytes, never)


def register(hook_dir: str, endpoint: str, points: list[str]) -> str:
    """Write ``hook_dir/floorhook.json`` as ``krproxy hooks serve`` does (temp file, rename); its path."""
    content = json.dumps(
        {"remote-endpoint": endpoint, "failure-policy": "Ignore", "runtime-hooks": points},
        separators=(",", ":"),
    )
    os.makedirs(hook_dir, exist_ok=True)
    path = os.path.join(hook_dir, "floorhook.json")
    temp = os.path.join(hook_dir, ".floorhook.json.tmp")
    with open(temp, "w") as out:
        out.write(content)
    os.replace(temp, path)
    return path


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


def _listen(path: str) -> socket.socket:
    if os.path.exists(path):
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


async def _until_signalled(start: Callable[..., Any], *args: Any) -> None:
    """Run ``start(*args, task_status=...)`` until SIGTERM or SIGINT."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(start, *args)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m krproxy.bench.floor", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="program", required=True)
    proxy = sub.add_parser("proxy", help="the floor proxy")
    proxy.add_argument("--listen", required=True, help="unix socket to serve")
    proxy.add_argument("--backend", required=True, help="the runtime's unix socket")
    proxy.add_argument("--hook", help="the hook server's unix socket (none: no hook calls)")
    proxy.add_argument(
        "--points", default=DEFAULT_POINTS, help="hook points, comma separated (default %(default)s)"
    )
    hook = sub.add_parser("hook", help="the floor hook server")
    hook.add_argument("--socket", required=True, help="unix socket to serve")
    hook.add_argument("--hook-dir", help="where to write the registration file (none: not registered)")
    hook.add_argument(
        "--points", default=DEFAULT_POINTS, help="hook points to register (default %(default)s)"
    )
    args = parser.parse_args(argv)
    points = [p for p in args.points.split(",") if p]
    if args.program == "proxy":
        floor = FloorProxy(set(points))
        try:
            trio.run(_until_signalled, floor.run, args.listen, args.backend, args.hook)
        except* _Lost:
            print(f"floor proxy: {floor.lost}", file=sys.stderr, flush=True)
        counts = " ".join(f"{name}={value}" for name, value in floor.counts.items())
        print(f"floor proxy stopped: {counts}", file=sys.stderr, flush=True)
        return 1 if floor.lost else 0
    server = FloorHookServer()
    try:
        trio.run(_until_signalled, server.run, os.path.abspath(args.socket), args.hook_dir, points)
    finally:
        if server.registration is not None:
            os.unlink(server.registration)
    answered = " ".join(f"{path.decode(errors='replace')}={n}" for path, n in sorted(server.answered.items()))
    total = sum(server.answered.values())
    print(f"floor hook server stopped: answered={total} {answered}".rstrip(), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
