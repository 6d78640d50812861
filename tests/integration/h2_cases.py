"""The cases of the public HTTP/2 conformance suite (h2spec 2.x: generic, hpack, http2), as frames a
caller sends to a server and the verdict RFC 9113 / RFC 7541 ask of it.

Each case keeps h2spec's numbering (``http2/6.5.3/1``: package, section, number in the section)
and its description, and sends the frames h2spec's case sends, with a gRPC request where h2spec
sends its plain GET or POST (krproxy serves gRPC only). Where h2spec watches a response body
(flow control) the request carries a gRPC message, so that the runtime answers with one: those
cases, which h2spec skipped or failed against a gRPC server, are kept here with a body.

``h2_play.py`` has the frame builders, :class:`Expect` and :class:`Case`; the cases are in
``h2_cases_generic.py`` (generic, hpack) and ``h2_cases_http2.py``/``h2_cases_frames.py`` (http2,
RFC sections 3 to 5 and 6 to 8), gathered here in h2spec's order. :func:`run` plays a case against a server's unix socket (the relay in memory, or ``krproxy
serve`` in front of a real containerd) and :func:`check` judges what came back. The tests are
``test_relay_conformance_suite.py`` (in front of a silent runtime or the fake containerd) and
``tests/e2e/test_relay_conformance_containerd.py`` (in front of real containerd's grpc-go, for the
cases whose verdict needs the runtime's answer).
"""

from __future__ import annotations

from tests.integration.h2_cases_frames import HTTP2_FRAMES
from tests.integration.h2_cases_generic import GENERIC
from tests.integration.h2_cases_http2 import HTTP2_STREAMS
from tests.integration.h2_play import PATH, Case, check, run

__all__ = ["CASES", "PATH", "SECTIONS", "Case", "check", "run"]

#: Every case of h2spec 2.x's default run (146; the two ``--strict`` cases are not in it).
CASES: dict[str, Case] = {**GENERIC, **HTTP2_STREAMS, **HTTP2_FRAMES}

#: h2spec's section titles, for the docs' table.
SECTIONS = {
    "generic/1": "Starting HTTP/2",
    "generic/2": "Streams and Multiplexing",
    "generic/3.1": "DATA",
    "generic/3.2": "HEADERS",
    "generic/3.3": "PRIORITY",
    "generic/3.4": "RST_STREAM",
    "generic/3.5": "SETTINGS",
    "generic/3.7": "PING",
    "generic/3.8": "GOAWAY",
    "generic/3.9": "WINDOW_UPDATE",
    "generic/3.10": "CONTINUATION",
    "generic/4": "HTTP Message Exchanges",
    "generic/5": "HPACK",
    "hpack/2.3.3": "Index Address Space",
    "hpack/4.2": "Maximum Table Size",
    "hpack/5.2": "String Literal Representation",
    "hpack/6.1": "Indexed Header Field Representation",
    "hpack/6.3": "Dynamic Table Size Update",
    "http2/3.5": "HTTP/2 Connection Preface",
    "http2/4.1": "Frame Format",
    "http2/4.2": "Frame Size",
    "http2/4.3": "Header Compression and Decompression",
    "http2/5.1": "Stream States",
    "http2/5.1.1": "Stream Identifiers",
    "http2/5.1.2": "Stream Concurrency",
    "http2/5.3.1": "Stream Dependencies",
    "http2/5.4.1": "Connection Error Handling",
    "http2/5.5": "Extending HTTP/2",
    "http2/6.1": "DATA",
    "http2/6.2": "HEADERS",
    "http2/6.3": "PRIORITY",
    "http2/6.4": "RST_STREAM",
    "http2/6.5": "SETTINGS",
    "http2/6.5.2": "Defined SETTINGS Parameters",
    "http2/6.5.3": "Settings Synchronization",
    "http2/6.7": "PING",
    "http2/6.8": "GOAWAY",
    "http2/6.9": "WINDOW_UPDATE",
    "http2/6.9.1": "The Flow-Control Window",
    "http2/6.9.2": "Initial Flow-Control Window Size",
    "http2/6.10": "CONTINUATION",
    "http2/7": "Error Codes",
    "http2/8.1": "HTTP Request/Response Exchange",
    "http2/8.1.2": "HTTP Header Fields",
    "http2/8.1.2.1": "Pseudo-Header Fields",
    "http2/8.1.2.2": "Connection-Specific Header Fields",
    "http2/8.1.2.3": "Request Pseudo-Header Fields",
    "http2/8.1.2.6": "Malformed Requests and Responses",
    "http2/8.2": "Server Push",
}
