"""krproxy.bench.nritiming.CallTimer: the runtime's calls to an NRI plugin timed from the bytes each side
sends (NRI's multiplexer frames around ttrpc messages), however the bytes are cut."""

from __future__ import annotations

from krproxy.bench.nritiming import CallTimer
from krproxy.nri import PLUGIN_SERVICE, RUNTIME_SERVICE, _mux, _ttrpc


def request(stream: int, method: str, conn: int = _mux.PLUGIN_SERVICE_CONN, payload: bytes = b"x") -> bytes:
    service = PLUGIN_SERVICE if conn == _mux.PLUGIN_SERVICE_CONN else RUNTIME_SERVICE
    body = _ttrpc.Request(service, method, payload).encode()
    return _mux.frames(conn, _ttrpc.encode_message(stream, _ttrpc.MessageType.REQUEST, body))


def response(stream: int, conn: int = _mux.PLUGIN_SERVICE_CONN) -> bytes:
    body = _ttrpc.Response(payload=b"ok").encode()
    return _mux.frames(conn, _ttrpc.encode_message(stream, _ttrpc.MessageType.RESPONSE, body))


def timer() -> tuple[CallTimer, list[tuple[str, float]]]:
    done: list[tuple[str, float]] = []
    return CallTimer(lambda method, seconds: done.append((method, seconds))), done


def test_a_call_is_timed_from_request_to_answer() -> None:
    calls, done = timer()
    calls.from_runtime(request(1, "CreateContainer"), 10.0)
    assert [] == done
    calls.from_plugin(response(1), 10.25)
    assert [("CreateContainer", 0.25)] == done


def test_bytes_cut_anywhere_and_calls_interleaved() -> None:
    """Byte by byte, two calls in flight, answered out of order: each timed from its own request."""
    calls, done = timer()
    for byte in request(1, "StateChange") + request(3, "CreateContainer"):
        calls.from_runtime(bytes([byte]), 1.0)
    calls.from_plugin(response(3), 2.0)
    for byte in response(1):
        calls.from_plugin(bytes([byte]), 3.0)
    assert [("CreateContainer", 1.0), ("StateChange", 2.0)] == done


def test_a_large_request_in_two_frames() -> None:
    """A message over 4096 bytes comes as two multiplexer frames (as Go writes it)."""
    calls, done = timer()
    calls.from_runtime(request(5, "Synchronize", payload=b"p" * 10000), 0.0)
    calls.from_plugin(response(5), 0.5)
    assert [("Synchronize", 0.5)] == done


def test_the_plugins_own_calls_are_not_timed() -> None:
    """RegisterPlugin and UpdateContainers (the plugin calling the runtime, connection 2) are not the
    runtime's wait; nor is an answer to no request."""
    calls, done = timer()
    calls.from_plugin(request(1, "RegisterPlugin", conn=_mux.RUNTIME_SERVICE_CONN), 0.0)
    calls.from_runtime(response(1, conn=_mux.RUNTIME_SERVICE_CONN), 1.0)
    calls.from_plugin(response(7), 2.0)
    assert [] == done
