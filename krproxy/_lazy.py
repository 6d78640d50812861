"""A package's lazy re-exports: each public name loaded from its module when first asked for.

A package whose ``__init__`` imported its whole surface would load the machinery (trio, the
metrics) for anyone importing one of its pure modules; with ``__getattr__ = reexport(...)`` it
loads nothing until a name is used (tests/integration/test_layers.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def reexport(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that gives ``name`` from ``package.where[name]``.

    A module that fails to import raises its own error (``from package import name`` shows it:
    Python turns only AttributeError into "cannot import name"); a name not in ``where`` is an
    AttributeError.
    """

    def __getattr__(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
