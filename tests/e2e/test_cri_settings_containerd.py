"""containerd's ``restrict_oom_score_adj`` as containerd itself reads it from each configuration layout
(``containerd -c FILE config dump``), against :func:`krproxy.nri.cri_settings.restricts_oom_score_adj`.

Only containerd 2.x matters here: 1.7's NRI (0.6.1) has no ``oom_score_adj`` adjustment, so krproxy
withholds a hook's value there whatever the setting says.
"""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

import pytest

from krproxy.nri.cri_settings import restricts_oom_score_adj
from tests.e2e.support import Containerd

GRPC, RUNTIME = '[plugins."io.containerd.grpc.v1.cri"]', '[plugins."io.containerd.cri.v1.runtime"]'


def _set(table: str, value: bool) -> str:
    return f"{table}\n  restrict_oom_score_adj = {str(value).lower()}\n"


#: Each layout: the main file and what it imports (``imp.toml``), by file name.
LAYOUTS: dict[str, dict[str, str]] = {
    "v2 grpc": {"config.toml": "version = 2\n" + _set(GRPC, True)},
    "v2 runtime over grpc": {"config.toml": "version = 2\n" + _set(GRPC, True) + _set(RUNTIME, False)},
    "v2 runtime": {"config.toml": "version = 2\n" + _set(GRPC, False) + _set(RUNTIME, True)},
    "v3 grpc": {"config.toml": "version = 3\n" + _set(GRPC, True)},
    "v3 runtime": {"config.toml": "version = 3\n" + _set(RUNTIME, True)},
    "no version grpc": {"config.toml": _set(GRPC, True)},
    "v1 grpc": {"config.toml": "version = 1\n" + _set(GRPC, True)},
    "v1 runtime": {"config.toml": "version = 1\n" + _set(RUNTIME, True)},
    "v3 imports v2 grpc": {
        "config.toml": "version = 3\nimports = ['imp.toml']\n",
        "imp.toml": "version = 2\n" + _set(GRPC, True),
    },
    "v3 runtime, imports v2 grpc off": {
        "config.toml": "version = 3\nimports = ['imp.toml']\n" + _set(RUNTIME, True),
        "imp.toml": "version = 2\n" + _set(GRPC, False),
    },
    "v3 runtime, imports v3 runtime off": {
        "config.toml": "version = 3\nimports = ['imp.toml']\n" + _set(RUNTIME, True),
        "imp.toml": "version = 3\n" + _set(RUNTIME, False),
    },
    "v2 grpc, imports v2 runtime off": {
        "config.toml": "version = 2\nimports = ['imp.toml']\n" + _set(GRPC, True),
        "imp.toml": "version = 2\n" + _set(RUNTIME, False),
    },
    "v2 grpc, imports v2 grpc off": {
        "config.toml": "version = 2\nimports = ['imp.toml']\n" + _set(GRPC, True),
        "imp.toml": "version = 2\n" + _set(GRPC, False),
    },
    "v2 imports unversioned grpc": {
        "config.toml": "version = 2\nimports = ['imp.toml']\n",
        "imp.toml": _set(GRPC, True),
    },
}


def _dumped(containerd: Containerd, config: Path) -> bool:
    binary = os.path.join(containerd.bin_dir, "containerd") if containerd.bin_dir else "containerd"
    out = subprocess.run(
        [binary, "-c", str(config), "config", "dump"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return bool(tomllib.loads(out)["plugins"]["io.containerd.cri.v1.runtime"]["restrict_oom_score_adj"])


def test_restrict_oom_score_adj_is_read_as_containerd_reads_it(
    containerd: Containerd, tmp_path: Path
) -> None:
    """For each layout (configuration version 1, 2 or 3, the 1.x key or 2.x's, imports of other versions),
    krproxy reads the setting containerd's own ``config dump`` shows (printed: containerd's, krproxy's)."""
    if containerd.major < 2:
        pytest.skip("containerd 1.x's NRI has no oom_score_adj adjustment")
    got = {}
    for name, files in LAYOUTS.items():
        directory = tmp_path / name.replace(" ", "_").replace(",", "")
        directory.mkdir()
        for file, text in files.items():
            (directory / file).write_text(text)
        config = directory / "config.toml"
        got[name] = (_dumped(containerd, config), restricts_oom_score_adj(str(config)))
    print(f"\n{containerd.version}: {got}")
    assert {name: dumped for name, (dumped, _) in got.items()} == {
        name: read for name, (_, read) in got.items()
    }
