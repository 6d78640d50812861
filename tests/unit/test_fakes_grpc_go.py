"""krproxy.fakes.grpc_go's metadata helpers: what the fakes' request logs and the tests' backend record."""

from __future__ import annotations

from krproxy.fakes.grpc_go import encode_metadata, metadata_items


def test_metadata_is_the_callers_fields_bin_values_decoded() -> None:
    """Metadata is the callers fields only with bin values decoded."""
    headers = [
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
        (b"user-agent", b"grpc-go/1.64.0"),
        (b"grpc-timeout", b"119999m"),
        (b"x-trace", b"abc"),
        (b"x-blob-bin", b"AP8"),  # unpadded base64 of 00 ff, as grpc-go sends it
        (b"x-bad-bin", b"not base64!"),
        (b"x-trace", b"again"),
    ]
    assert (
        ("x-trace", "abc"),
        ("x-blob-bin", b"\x00\xff"),
        ("x-bad-bin", "not base64!"),
        ("x-trace", "again"),
    ) == metadata_items(headers)


def test_encoded_metadata_reads_back() -> None:
    metadata = (("x-why", "test"), ("x-blob-bin", b"\x00\xff\x01"))
    assert [(b"x-why", b"test"), (b"x-blob-bin", b"AP8B")] == encode_metadata(metadata)
    assert metadata == metadata_items(encode_metadata(metadata))
