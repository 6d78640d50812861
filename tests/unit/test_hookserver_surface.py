"""The SDK's package surface: ``krproxy.hookserver`` re-exports its public names lazily.

Each name is loaded from its module when first asked for, so the pure modules (contexts, cgroup
paths, the policy and its rules) import without trio (tests/integration/test_layers.py), and a
module that fails to import says why, not just "cannot import name".
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import krproxy.hookserver
from krproxy.hookserver import _WHERE


@pytest.mark.parametrize("name", krproxy.hookserver.__all__)
def test_each_public_name_is_its_modules_object(name: str) -> None:
    module = importlib.import_module(f"krproxy.hookserver.{_WHERE[name]}")
    assert getattr(module, name) is getattr(krproxy.hookserver, name)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        krproxy.hookserver.Nope  # noqa: B018
    with pytest.raises(ImportError, match="cannot import name 'Nope'"):
        from krproxy.hookserver import Nope  # noqa: F401


_WITHOUT_TRIO = """
import sys
sys.modules["trio"] = None  # any import of trio fails
from krproxy.hookserver import NodePolicy, Rules, ContainerContext, pod_cgroup_dir
print("pure names: ok")
try:
    from krproxy.hookserver import serve
except ImportError as e:
    print(type(e).__name__, e)
"""


def test_a_failing_import_reports_its_cause() -> None:
    """Without trio, the pure names import; ``serve`` fails naming trio, the real cause."""
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TRIO], check=True, capture_output=True, text=True, timeout=60
    )
    first, second = done.stdout.strip().splitlines()
    assert "pure names: ok" == first
    assert second.startswith("ModuleNotFoundError import of trio halted"), second
