"""Our protos must be wire-identical to the reference schemas in ../shared/reference.

Each proto is compiled with grpcio-tools' protoc into a FileDescriptorSet and compared,
element by element, with the reference JSON; a failure names the first difference by path.
Comments (source info) and the file name are not part of the wire schema and are not compared.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, json_format
from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parents[2]
REFERENCE = ROOT.parent / "shared" / "reference"

CASES = [
    ("cri_v1.proto", "cri-runtime-v1.descriptor.json"),
    ("runtime_hook_v1alpha1.proto", "koordinator-runtime-hook-v1alpha1.descriptor.json"),
]


def compile_descriptor(proto: str, tmp_path: pathlib.Path) -> dict[str, Any]:
    out = tmp_path / "set.pb"
    rc = protoc.main(["protoc", f"-I{ROOT / 'protos'}", f"--descriptor_set_out={out}", proto])
    assert rc == 0, f"protoc failed on {proto}"
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (fd,) = fds.file
    return json_format.MessageToDict(fd)


def _normalise(node: Any) -> Any:
    """Drop empty option dicts: `options: {}` and no options mean the same schema."""
    if isinstance(node, dict):
        return {k: _normalise(v) for k, v in node.items() if v != {}}
    if isinstance(node, list):
        return [_normalise(v) for v in node]
    return node


def first_difference(ours: Any, ref: Any, path: str = "") -> str | None:
    """Return a readable description of the first place ``ours`` and ``ref`` differ."""
    if isinstance(ref, dict) and isinstance(ours, dict):
        for key in sorted(set(ref) | set(ours)):
            if key not in ours:
                return f"{path}.{key}: missing in ours (reference has {ref[key]!r})"
            if key not in ref:
                return f"{path}.{key}: ours has {ours[key]!r}, reference has nothing"
            diff = first_difference(ours[key], ref[key], f"{path}.{key}")
            if diff:
                return diff
        return None
    if isinstance(ref, list) and isinstance(ours, list):
        for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
            label = b.get("name", i) if isinstance(b, dict) else i
            diff = first_difference(a, b, f"{path}[{label}]")
            if diff:
                return diff
        if len(ours) != len(ref):
            return f"{path}: ours has {len(ours)} entries, reference {len(ref)}"
        return None
    if ours != ref:
        return f"{path}: ours {ours!r} != reference {ref!r}"
    return None


class TestDescriptorsMatchReference:
    @pytest.mark.parametrize(("proto", "reference"), CASES)
    def test_wire_schema_equal(self, proto: str, reference: str, tmp_path: pathlib.Path) -> None:
        """Every message, field, enum, service and method equals the reference, in order."""
        ref_path = REFERENCE / reference
        if not ref_path.exists():
            pytest.skip(f"reference schema not available at {ref_path}")
        (ref,) = json.loads(ref_path.read_text())["file"]
        ours = compile_descriptor(proto, tmp_path)
        for doc in (ref, ours):
            doc.pop("name")  # the file name is not part of the wire schema
        diff = first_difference(_normalise(ours), _normalise(ref))
        assert diff is None, f"{proto} differs from {reference}: {diff}"

    def test_difference_is_reported(self) -> None:
        """The comparison names the first differing field by path (so a failure is readable)."""
        ref = {"messageType": [{"name": "A", "field": [{"name": "x", "number": 1}]}]}
        ours = {"messageType": [{"name": "A", "field": [{"name": "x", "number": 2}]}]}
        assert ".messageType[A].field[x].number: ours 2 != reference 1" == first_difference(ours, ref)
