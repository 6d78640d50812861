"""The rules of krproxy.fakes.strict: grpc-go's judgement of a request's headers, its message limit."""

from __future__ import annotations

import urllib.parse

import pytest

from krproxy.fakes.strict import MAX_MESSAGE, GrpcGo, check_request, grpc_message, timeout_error, too_large
from krproxy.relay.rpc import encode_grpc_timeout

POST = [(":method", "POST"), (":path", "/runtime.v1.RuntimeService/Version")]


@pytest.mark.parametrize("value", ["1n", "99999999H", "12345678u", "0S", "120000m"])
def test_up_to_8_digits_and_a_unit_is_a_valid_timeout(value: str) -> None:
    assert timeout_error(value) is None
    assert check_request([*POST, ("grpc-timeout", value)]) is None


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("119999808u", 'transport: timeout string is too long: "119999808u"'),  # krproxy's before d1b6bf2
        ("123456789S", 'transport: timeout string is too long: "123456789S"'),
        ("5", 'transport: timeout string is too short: "5"'),
        ("", 'transport: timeout string is too short: ""'),
        ("100s", 'transport: timeout unit is not recognized: "100s"'),
        ("1.5S", 'strconv.ParseUint: parsing "1.5": invalid syntax'),
        ("-1S", 'strconv.ParseUint: parsing "-1": invalid syntax'),
        ("١٢S", 'strconv.ParseUint: parsing "١٢": invalid syntax'),  # digits, but not ASCII ones
    ],
)
def test_a_malformed_timeout_is_refused_with_grpc_go_s_words(value: str, error: str) -> None:
    assert error == timeout_error(value)
    rejection = check_request([*POST, ("grpc-timeout", value)])
    assert rejection is not None
    assert (400, f"malformed grpc-timeout: {error}") == (rejection.http_status, rejection.message)


def test_every_timeout_krproxy_writes_passes() -> None:
    """From 1 ns to the 99999999 H cap, what the relay writes is what grpc-go accepts."""
    seconds = 1e-9
    while seconds < 4e11:
        assert timeout_error(encode_grpc_timeout(seconds).decode()) is None, seconds
        seconds *= 1.7


@pytest.mark.parametrize(("method", "shown"), [(None, ""), ("GET", "GET")])
def test_a_request_that_is_not_a_post_is_refused(method: str | None, shown: str) -> None:
    fields = [(":path", "/runtime.v1.RuntimeService/Version")]
    if method is not None:
        fields.insert(0, (":method", method))
    rejection = check_request(fields)
    assert rejection is not None
    assert (405, f'Received a HEADERS frame with :method "{shown}" which should be POST') == (
        rejection.http_status,
        rejection.message,
    )


def test_the_timeout_is_judged_before_the_method() -> None:
    """grpc-go's order: a bad grpc-timeout is the reason even when :method is missing too."""
    rejection = check_request([("grpc-timeout", "123456789m")])
    assert rejection is not None and rejection.http_status == 400


@pytest.mark.parametrize("sending", [False, True])
def test_too_large_is_said_as_grpc_go_says_it(sending: bool) -> None:
    verb = "trying to send message" if sending else "received message"
    assert f"grpc: {verb} larger than max (16777217 vs. 16777216)" == too_large(
        MAX_MESSAGE + 1, sending=sending
    )


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ([*POST, ("x-id", "a\x00b")], "invalid header field value for 'x-id'"),
        ([*POST, ("x-id", "a\rb")], "invalid header field value for 'x-id'"),
        ([*POST, ("x-id", "a\x7f")], "invalid header field value for 'x-id'"),
        ([(":path", "/a\n"), (":method", "POST")], "invalid header field value for ':path'"),
        ([*POST, ("X-Id", "1")], "invalid header field name 'X-Id'"),
        ([*POST, ("x id", "1")], "invalid header field name 'x id'"),
        ([*POST, ("x:id", "1")], "invalid header field name 'x:id'"),
        ([*POST, ("", "1")], "invalid header field name ''"),
        ([("x-id", "1"), *POST], "pseudo header field after regular"),
        ([*POST, (":protocol", "x")], "invalid pseudo-header ':protocol'"),
        ([*POST, (":method", "POST")], "duplicate pseudo-header ':method'"),
        ([(":status", "200"), *POST], "mix of request and response pseudo headers"),
    ],
)
def test_grpc_go_s_framer_refuses_before_operate_headers(fields: list[tuple[str, str]], error: str) -> None:
    """A stream error of the framer (``readMetaFrame``): no HTTP status, a reset in every version,
    and judged before a bad ``grpc-timeout``."""
    rejection = check_request([*fields, ("grpc-timeout", "123456789m")])
    assert rejection is not None
    assert (None, error) == (rejection.http_status, rejection.message)
    assert rejection.resets(GrpcGo.V1_6) and rejection.resets(GrpcGo.V2)


def test_grpc_go_s_framer_lets_through_what_http_allows() -> None:
    """Inner and outer whitespace (RFC 9113 forbids the outer; grpc-go does not check it), octets
    above ASCII, an empty value, every token character in a name."""
    fields = [*POST, ("x-id", " a\tb "), ("x-e", ""), ("x-u", "é"), ("!#$%&'*+-.^_`|~09az", "1")]
    assert check_request(fields) is None


def test_the_early_abort_is_trailers_only_with_internal() -> None:
    """grpc-go's earlyAbortStream, as both fakes send it (GrpcGo.V2)."""
    rejection = check_request([("grpc-timeout", "123456789m")])
    assert rejection is not None and not rejection.resets(GrpcGo.V2) and rejection.resets(GrpcGo.V1_6)
    assert [
        (":status", "400"),
        ("content-type", "application/grpc"),
        ("grpc-status", "13"),
        ("grpc-message", 'malformed grpc-timeout: transport: timeout string is too long: "123456789m"'),
    ] == rejection.early_abort_headers()


def test_the_early_abort_message_is_percent_encoded_as_grpc_go() -> None:
    """A value quoted in the message that is not printable ASCII (or holds ``%``) goes out
    percent-encoded, as grpc-go's encodeGrpcMessage writes it; grpcio and grpc-go decode it back."""
    rejection = check_request([*POST, ("grpc-timeout", "1é")])
    assert rejection is not None
    (message,) = [value for name, value in rejection.early_abort_headers() if name == "grpc-message"]
    assert 'malformed grpc-timeout: transport: timeout unit is not recognized: "1%C3%A9"' == message
    assert rejection.message == urllib.parse.unquote(message)
    assert "100%25 sure" == grpc_message("100% sure")


def test_a_framer_refusal_has_no_early_abort() -> None:
    rejection = check_request([*POST, ("x-id", "\x00")])
    assert rejection is not None
    with pytest.raises(ValueError, match="reset, not answered"):
        rejection.early_abort_headers()
