"""Tests of hpackmemo's template path under ``python -O`` (8a5de21 narrows a template's place
with an ``assert``, which ``-O`` strips).

A place is None only in a block's entry, whose key is the block's bytes; the template lookup asks
for a ``(position, bytes)`` key, which only a template's entry (place set) has. So ``-O`` changes
nothing: requests with odd ``grpc-timeout`` values, read through a server connection, decode to
what ``hpack`` gives, from the templates alone (``hpack`` and the field-by-field path are made to
fail once the templates are learnt), in a ``python -O`` interpreter and in this one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import hpack

from krproxy.h2 import events as ev
from krproxy.h2 import frames as f
from krproxy.h2 import hpackmemo
from krproxy.h2.connection import Connection, Role
from tests.unit.h2peer import grpc_request

CALL = grpc_request(b"/runtime.v1.RuntimeService/ListContainers")
#: grpc-timeout values a hostile or odd caller may send: empty, no unit, not ASCII, the field's
#: own bytes, NUL, the longest plain literal of one length byte (126) and one past it (a second
#: length byte: not a template's field, decoded otherwise).
ODD_TIMEOUTS = [
    b"1S",
    b"",
    b"99999999H",
    b"0n",
    b"\xff\xfe",
    b"\x00",
    b"\x00\x0cgrpc-timeout\x021S",
    b"9" * 126,
    b"9" * 127,
]


def _request(timeout: bytes, *, where: int) -> list[tuple[bytes, bytes]]:
    headers = list(CALL)
    headers.insert(where, (b"grpc-timeout", timeout))
    return headers


def decode_through_a_connection() -> list[list[list[str]]]:
    """Each odd request's headers as a server connection reads them, hex-encoded: first learnt
    (the field's name and the template), then with ``hpack`` and the field path made to fail,
    so that every block that can come from a template does."""
    hpackmemo._memo.clear()
    hpackmemo._unique_names.clear()
    conn = Connection(Role.SERVER, check_request_headers=False)
    conn.receive_data(f.PREFACE + f.settings([]))
    stream = 1
    for where in (4, 5):  # grpc-timeout among the pseudo-headers' followers, and last
        conn.receive_data(
            f.frame(
                f.HEADERS,
                f.END_HEADERS | f.END_STREAM,
                stream,
                f.encode_headers(_request(b"5S", where=where)),
            )
        )
        stream += 2

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("decoded without the template")

    hpackmemo._by_fields = fail  # type: ignore[assignment]
    hpackmemo._by_hpack = fail  # type: ignore[assignment]
    got = []
    for where in (4, 5):
        for timeout in ODD_TIMEOUTS:
            if len(timeout) > 126:
                continue  # a two-byte length: never a template's field
            block = f.encode_headers(_request(timeout, where=where))
            events = conn.receive_data(f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, stream, block))
            stream += 2
            assert [type(e) for e in events] == [ev.RequestReceived], events
            headers = events[0].headers  # type: ignore[attr-defined]
            assert headers == hpack.Decoder().decode(block, raw=True)
            got.append([[name.hex(), value.hex()] for name, value in headers])
    return got


def test_odd_grpc_timeouts_decode_from_templates_as_hpack() -> None:
    """Odd grpc timeouts decode from templates as hpack decodes them."""
    real = hpackmemo._by_fields, hpackmemo._by_hpack
    try:
        got = decode_through_a_connection()
    finally:
        hpackmemo._by_fields, hpackmemo._by_hpack = real
        hpackmemo._memo.clear()
        hpackmemo._unique_names.clear()
    assert 2 * (len(ODD_TIMEOUTS) - 1) == len(got)


def test_a_long_grpc_timeout_is_decoded_as_hpack_decodes_it() -> None:
    hpackmemo._memo.clear()
    hpackmemo._unique_names.clear()
    d = hpack.Decoder()
    for timeout in ODD_TIMEOUTS:
        block = f.encode_headers(_request(timeout, where=4))
        assert hpack.Decoder().decode(block, raw=True) == hpackmemo.decode(d, block)


def test_python_O_strips_the_assert_and_decodes_the_same() -> None:
    """The same requests in a ``python -O`` interpreter (asserts stripped): the same headers."""
    root = Path(__file__).resolve().parents[2]
    script = (
        "import json, sys\n"
        "assert False, 'asserts are on'\n"  # skipped under -O only
        "from tests.unit.test_h2_hpackmemo_optimized import decode_through_a_connection\n"
        "print(json.dumps([sys.flags.optimize, decode_through_a_connection()]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-O", "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert 0 == done.returncode, done.stderr
    optimize, got = json.loads(done.stdout)
    assert 1 == optimize
    real = hpackmemo._by_fields, hpackmemo._by_hpack
    try:
        assert decode_through_a_connection() == got
    finally:
        hpackmemo._by_fields, hpackmemo._by_hpack = real
        hpackmemo._memo.clear()
        hpackmemo._unique_names.clear()
