"""The cpuset policy reads Koordinator's resource-status annotation as koordlet reads it
(krproxy.hookserver.policies.cpuset against tests/gojson, Go's encoding/json into Koordinator's
ResourceStatus).

koord-scheduler writes ``scheduling.koordinator.sh/resource-status``; koordlet reads it with Go's
``json.Unmarshal`` and pins the pod's containers to its ``cpuset``. A hook server built on the SDK in
koordlet's place must pin the same CPUs from the same value: a key Go folds (``CPUSet``), one given
twice, or a ``cpuSharedPools`` Go refuses (which leaves koordlet with no cpuset at all)."""

from __future__ import annotations

from typing import Any

import pytest

from krproxy.hookserver.policies.cpuset import ANNOTATION, cpuset_from_annotations
from tests.unit.gojson_support import go_reads, gojson  # noqa: F401 - the fixture

#: Annotation values: (name, value).
CASES = [
    ("plain", '{"cpuset":"0-3"}'),
    ("key spelt as Go's field", '{"CPUSet":"0-3"}'),
    ("key in capitals", '{"CPUSET":"2,4"}'),
    ("long s", '{"cpu\u017fet":"1"}'),
    ("twice", '{"cpuset":"0-3","CPUSet":"4-5"}'),
    ("null after", '{"cpuset":"0-3","cpuset":null}'),
    ("empty after", '{"cpuset":"0-3","cpuset":""}'),
    ("wrong type", '{"cpuset":5}'),
    ("wrong type first", '{"cpuset":5,"cpuset":"0-3"}'),
    ("pools", '{"cpuset":"0-3","cpuSharedPools":[{"socket":0,"node":1},null]}'),
    ("pools spelt otherwise", '{"cpuset":"0-3","CPUSharedPools":[{"Socket":0,"NODE":1}]}'),
    ("pools of wrong type", '{"cpuset":"0-3","cpuSharedPools":"0"}'),
    ("pool of wrong type", '{"cpuset":"0-3","cpuSharedPools":[1]}'),
    ("pool number as float", '{"cpuset":"0-3","cpuSharedPools":[{"socket":1.0}]}'),
    ("pool number with exponent", '{"cpuset":"0-3","cpuSharedPools":[{"node":1e0}]}'),
    ("pool number past int32", '{"cpuset":"0-3","cpuSharedPools":[{"socket":2147483648}]}'),
    ("pool number at int32's end", '{"cpuset":"0-3","cpuSharedPools":[{"socket":-2147483648}]}'),
    ("pool number as string", '{"cpuset":"0-3","cpuSharedPools":[{"socket":"1"}]}'),
    ("pool number as boolean", '{"cpuset":"0-3","cpuSharedPools":[{"node":true}]}'),
    ("unknown key", '{"cpuset":"0-3","numa":{"a":[1,2]}}'),
    ("null", "null"),
    ("array", '["0-3"]'),
    ("string", '"0-3"'),
    ("NaN elsewhere", '{"cpuset":"0-3","x":NaN}'),
    ("trailing data", '{"cpuset":"0-3"} {}'),
]


@pytest.fixture(scope="module")
def go_read(gojson: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:  # noqa: F811
    """What Go made of each case, by name."""
    documents = [value.encode() for _, value in CASES]
    reads = go_reads(gojson, tmp_path_factory.mktemp("statuses"), "resource-status", documents)
    return {name: read for (name, _), read in zip(CASES, reads, strict=True)}


@pytest.mark.parametrize("name", [name for name, _ in CASES])
def test_cpuset_read_as_koordlet_reads_it(name: str, go_read: dict[str, dict[str, Any]]) -> None:
    """The policy pins the cpuset koordlet's Go reading gives, and none where Go refuses the value."""
    read = go_read[name]
    expected = None if "error" in read else read["value"]["cpuset"] or None

    assert expected == cpuset_from_annotations({ANNOTATION: dict(CASES)[name]})
