"""The fuzzing budget shared by the hypothesis fuzz tests (``tests/unit/test_fuzz_*``,
``tests/integration/test_faults_frames.py``).

Default runs stay fast: each fuzz test runs the moderate number of examples it asks for. A longer run:

    pytest tests/unit tests/integration -k fuzz_ --hypothesis-profile=fuzz     # 2000 examples each
    KRPROXY_FUZZ_EXAMPLES=20000 pytest ... --hypothesis-profile=fuzz           # any number

(the ``fuzz`` profile is registered in tests/conftest.py; it also lifts hypothesis' per-example deadline).
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

_M = TypeVar("_M")

#: Examples per test under the ``fuzz`` profile unless KRPROXY_FUZZ_EXAMPLES says otherwise.
FUZZ_EXAMPLES = 2000


def examples(default: int) -> int:
    """How many examples a fuzz test runs: ``default``, or the long-run budget when asked for one."""
    if "KRPROXY_FUZZ_EXAMPLES" in os.environ:
        return int(os.environ["KRPROXY_FUZZ_EXAMPLES"])
    try:
        fuzz = settings.get_profile("fuzz")
    except InvalidArgument:  # imported outside pytest: tests/conftest.py registers the profile
        return default
    return FUZZ_EXAMPLES if settings.default is fuzz else default


#: Any int64, as protobuf's int64 fields hold.
INT64 = st.integers(-(1 << 63), (1 << 63) - 1)


def linux_resources(cls: type[_M], cpusets: st.SearchStrategy[str], **more: Any) -> st.SearchStrategy[_M]:
    """Any ``LinuxContainerResources`` of CRI (``v1``) or of the hook protocol (``v1alpha1``): the
    integer fields any int64, the cpusets from ``cpusets``, plus the strategies in ``more``."""
    integers = ("cpu_period", "cpu_quota", "cpu_shares", "memory_limit_in_bytes", "oom_score_adj")
    return st.builds(cls, **dict.fromkeys(integers, INT64), cpuset_cpus=cpusets, cpuset_mems=cpusets, **more)
