"""The fuzzing budget shared by the hypothesis fuzz tests (``tests/unit/test_fuzz_*``,
``tests/integration/test_faults_frames.py``).

Default runs stay fast: each fuzz test runs the moderate number of examples it asks for. A longer run:

    pytest tests/unit tests/integration -k fuzz_ --hypothesis-profile=fuzz     # 2000 examples each
    KRPROXY_FUZZ_EXAMPLES=20000 pytest ... --hypothesis-profile=fuzz           # any number

(the ``fuzz`` profile is registered in tests/conftest.py; it also lifts hypothesis' per-example deadline).
"""

from __future__ import annotations

import os

from hypothesis import settings
from hypothesis.errors import InvalidArgument

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
