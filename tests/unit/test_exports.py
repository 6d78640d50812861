"""Every package states its public surface: an ``__all__`` whose names all exist (as trio's test_exports)."""

from __future__ import annotations

import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: krproxy's packages; the fakes (the folder fakes/) are its subpackage krproxy.fakes.
PACKAGES = sorted(
    ".".join(
        ("krproxy", *p.parent.relative_to(ROOT).parts) if top == "fakes" else p.parent.relative_to(ROOT).parts
    )
    for top in ("krproxy", "fakes")
    for p in (ROOT / top).rglob("__init__.py")
    if "proto" not in p.relative_to(ROOT).parts  # generated: the compiler writes its own __all__
)


@pytest.mark.parametrize("name", PACKAGES)
def test_the_package_has_all_and_every_name_in_it_exists(name: str) -> None:
    package = importlib.import_module(name)
    exported = getattr(package, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    missing = [attr for attr in exported if not hasattr(package, attr)]
    assert [] == missing
    assert len(set(exported)) == len(exported)
