"""Our protos must be wire-identical to the reference schemas in ../shared/reference.

Each proto is compiled with grpcio-tools' protoc into a FileDescriptorSet and compared,
element by element, with the reference JSON; a failure names the first difference by path.
Comments (source info) and the file name are not part of the wire schema and are not compared.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, json_format

try:
    from grpc_tools import protoc
except ImportError:  # the test extra leaves grpcio-tools out on Python 3.15 (pyproject.toml says why)
    protoc = None

NO_PROTOC = "grpcio-tools is not installed (the test extra has none on Python 3.15: see pyproject.toml)"

ROOT = pathlib.Path(__file__).resolve().parents[2]
REFERENCE = pathlib.Path(os.environ.get("KRPROXY_REFERENCE_DIR", ROOT.parent / "shared" / "reference"))

CASES = [
    ("cri_v1.proto", "cri-runtime-v1.descriptor.json"),
    ("runtime_hook_v1alpha1.proto", "koordinator-runtime-hook-v1alpha1.descriptor.json"),
    ("nri_v1alpha1.proto", "nri-api-v0.12.2.descriptor.json"),
]

#: The hook protocol's one documented extension of Koordinator's (docs/hooks.md): the pod-level resize hook.
#: The comparison with the reference removes exactly this method, after checking its shape.
HOOK_EXTENSION = {
    "name": "PreUpdatePodSandboxResourcesHook",
    "inputType": ".runtime.v1alpha1.PodSandboxHookRequest",
    "outputType": ".runtime.v1alpha1.PodSandboxHookResponse",
}


def without_hook_extension(descriptor: dict[str, Any]) -> dict[str, Any]:
    """*descriptor* (of runtime_hook_v1alpha1.proto) without :data:`HOOK_EXTENSION`, which must be the
    service's last method, exactly as declared there."""
    (service,) = descriptor["service"]
    *methods, last = service["method"]
    assert _normalise(last) == HOOK_EXTENSION, f"the last hook method is not the documented extension: {last}"
    return {**descriptor, "service": [{**service, "method": methods}]}


def compile_descriptor(proto: str, tmp_path: pathlib.Path) -> dict[str, Any]:
    if protoc is None:
        pytest.skip(NO_PROTOC)
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
        if proto == "runtime_hook_v1alpha1.proto":
            ours = without_hook_extension(ours)
        diff = first_difference(_normalise(ours), _normalise(ref))
        assert diff is None, f"{proto} differs from {reference}: {diff}"

    def test_hook_extension_is_removed_once(self) -> None:
        """Only the documented extension is allowed: a second added method, or one of another shape, shows."""
        method = {"name": "PreRunPodSandboxHook", "inputType": ".x.A", "outputType": ".x.B"}
        ours = {"service": [{"name": "S", "method": [method, HOOK_EXTENSION]}]}
        assert {"service": [{"name": "S", "method": [method]}]} == without_hook_extension(ours)
        renamed = {"service": [{"name": "S", "method": [method, {**HOOK_EXTENSION, "name": "Other"}]}]}
        with pytest.raises(AssertionError, match="not the documented extension"):
            without_hook_extension(renamed)
        twice = {"service": [{"name": "S", "method": [method, HOOK_EXTENSION, HOOK_EXTENSION]}]}
        ref = {"service": [{"name": "S", "method": [method]}]}
        assert first_difference(without_hook_extension(twice), ref) is not None

    def test_difference_is_reported(self) -> None:
        """The comparison names the first differing field by path (so a failure is readable)."""
        ref = {"messageType": [{"name": "A", "field": [{"name": "x", "number": 1}]}]}
        ours = {"messageType": [{"name": "A", "field": [{"name": "x", "number": 2}]}]}
        assert ".messageType[A].field[x].number: ours 2 != reference 1" == first_difference(ours, ref)


# Ours equals NRI 0.12.2's api.proto (containerd 2.3; the reference above). The older ones come
# from Debian's NRI source package, one per containerd generation (trixie's containerd 1.7.24 is
# built with NRI 0.6.1, sid's 2.1.9 with 0.8.0): both must be subsets of ours (v1alpha1 only grew).
NRI_PACKAGE = "golang-github-containerd-nri-dev"
NRI_VERSIONS = {"0.8.0-1": "sid", "0.6.1-2": "trixie"}
NRI_PROTO = "usr/share/gocode/src/github.com/containerd/nri/pkg/api/api.proto"
DEB_CACHE = os.environ.get("KRPROXY_DEB_CACHE", "/var/cache/krproxy-debs")


def upstream_nri_descriptor(version: str, tmp_path: pathlib.Path) -> dict[str, Any]:
    """NRI's own api.proto of ``version``, compiled; skips (with the reason) where it cannot be had."""
    if protoc is None:
        pytest.skip(NO_PROTOC)
    fetch = [sys.executable, str(ROOT / "scripts" / "fetch-debian-package")]
    fetched = subprocess.run(
        [*fetch, NRI_VERSIONS[version], NRI_PACKAGE, version, DEB_CACHE],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if fetched.returncode != 0:
        pytest.skip(f"upstream NRI {version} api.proto not available: {fetched.stderr.strip()}")
    proto = pathlib.Path(fetched.stdout.strip()) / NRI_PROTO
    out = tmp_path / f"nri-{version}.pb"
    rc = protoc.main(["protoc", f"-I{proto.parent}", f"--descriptor_set_out={out}", proto.name])
    assert rc == 0, f"protoc failed on upstream {proto}"
    (fd,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    doc = json_format.MessageToDict(fd)
    doc.pop("name")
    doc.pop("options", None)  # go_package: not part of the wire schema (0.12.2's descriptor has none)
    for enum in doc["enumType"]:  # LAST is "one past the last event": it moves as events are added
        if enum["name"] == "Event":
            enum["value"] = [v for v in enum["value"] if v["name"] != "LAST"]
    return _normalise(doc)  # type: ignore[no-any-return]


def missing_from(ours: Any, older: Any, path: str = "") -> str | None:
    """The first element of ``older`` that ``ours`` lacks or has differently (lists matched by name)."""
    if isinstance(older, dict) and isinstance(ours, dict):
        for key, value in older.items():
            if key not in ours:
                return f"{path}.{key}: missing in ours (upstream has {value!r})"
            diff = missing_from(ours[key], value, f"{path}.{key}")
            if diff:
                return diff
        return None
    if isinstance(older, list) and isinstance(ours, list):
        named = {item.get("name"): item for item in ours if isinstance(item, dict)}
        for i, item in enumerate(older):
            if isinstance(item, dict) and "name" in item:
                if item["name"] not in named:
                    return f"{path}[{item['name']}]: missing in ours"
                diff = missing_from(named[item["name"]], item, f"{path}[{item['name']}]")
            else:
                diff = None if item in ours else f"{path}[{i}]: {item!r} missing in ours"
            if diff:
                return diff
        return None
    return None if ours == older else f"{path}: ours {ours!r} != upstream {older!r}"


class TestNriMatchesUpstream:
    @pytest.mark.parametrize(
        ("release", "version"),
        [
            pytest.param("0.8.0-1", "0.8.0", id="nri-0.8-containerd-2.0-2.1"),
            pytest.param("0.6.1-2", "0.6.1", id="nri-0.6-containerd-1.7"),
        ],
    )
    def test_upstream_release_is_a_subset(self, tmp_path: pathlib.Path, release: str, version: str) -> None:
        """Every message, field, enum value and method of an NRI release containerd ships (0.8.0:
        containerd 2.0, 2.1; 0.6.1: containerd 1.7) is in ours, the same."""
        upstream = upstream_nri_descriptor(release, tmp_path)
        ours = compile_descriptor("nri_v1alpha1.proto", tmp_path)
        ours.pop("name")
        diff = missing_from(_normalise(ours), upstream)
        assert diff is None, f"nri_v1alpha1.proto lacks part of NRI {version}: {diff}"

    def test_subset_check_names_what_is_missing(self) -> None:
        """The subset check reports a field the older schema has and ours lacks, by path."""
        older = {
            "messageType": [{"name": "A", "field": [{"name": "x", "number": 1}, {"name": "y", "number": 2}]}]
        }
        ours = {
            "messageType": [{"name": "A", "field": [{"name": "x", "number": 1}, {"name": "z", "number": 3}]}]
        }
        assert ".messageType[A].field[y]: missing in ours" == missing_from(ours, older)
        assert (
            missing_from(older, {"messageType": [{"name": "A", "field": [{"name": "x", "number": 1}]}]})
            is None
        )
