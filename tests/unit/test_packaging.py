"""``pip install krproxy`` puts one package into site-packages, ``krproxy``: the fakes ship as its
subpackage ``krproxy.fakes`` (the folder fakes/, reached through the symlink krproxy/fakes), so no
top-level ``fakes`` of ours can clash with another distribution's.

The wheel is built from a copy of the sources (setuptools writes build/ beside them), offline:
``pip wheel --no-deps --no-build-isolation`` with the setuptools of the test environment.
"""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys
import zipfile

from tests.unit.test_import_graph import _imports

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _wheel(tmp_path: pathlib.Path) -> zipfile.ZipFile:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "krproxy", src / "krproxy", symlinks=True, ignore=skip)
    shutil.copytree(ROOT / "fakes", src / "fakes", ignore=skip)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert 0 == built.returncode, f"pip wheel failed:\n{built.stdout}{built.stderr}"
    (wheel,) = (tmp_path / "dist").glob("krproxy-*.whl")
    return zipfile.ZipFile(wheel)


def test_the_wheel_ships_krproxy_alone_with_the_fakes_inside(tmp_path: pathlib.Path) -> None:
    """The wheel's top-level names are ``krproxy`` and its dist-info; the fakes are inside
    ``krproxy/fakes``, and every console script points into ``krproxy``."""
    with _wheel(tmp_path) as wheel:
        names = wheel.namelist()
        tops = {n.split("/")[0] for n in names}
        info = next(t for t in tops if t.endswith(".dist-info"))
        assert {"krproxy", info} == tops
        assert "krproxy\n" == wheel.read(f"{info}/top_level.txt").decode()
        fakes = {n.removeprefix("krproxy/") for n in names if n.startswith("krproxy/fakes/")}
        in_repo = {str(p.relative_to(ROOT)) for p in (ROOT / "fakes").rglob("*.py")}
        assert in_repo == {n for n in fakes if n.endswith(".py")}
        scripts = wheel.read(f"{info}/entry_points.txt").decode().split("[console_scripts]")[1]
        targets = [line.split("=", 1)[1].strip() for line in scripts.strip().splitlines()]
        assert [] == [t for t in targets if not t.startswith("krproxy.")]


def test_nothing_imports_the_fakes_by_their_old_top_level_name() -> None:
    """Code imports ``krproxy.fakes``, never a top-level ``fakes`` (which an installed krproxy
    does not have: from a source checkout it would load the same files a second time)."""
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for top in ("krproxy", "fakes", "tests", "scripts", "examples")
        for path in (ROOT / top).rglob("*.py")
        for name in _imports(ast.parse(path.read_text(), str(path)), "", type_checking=True)
        if name.split(".")[0] == "fakes"
    ]
    assert [] == found
