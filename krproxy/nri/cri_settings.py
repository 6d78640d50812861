"""containerd's CRI settings that NRI's adjustment goes around (pure, but for reading files).

containerd's CRI plugin applies some settings to the container it builds from kubelet's request, and so to
a hook server's answer in proxy mode; an NRI adjustment is applied to the OCI spec after them and passes
them by. The one read here is ``restrict_oom_score_adj``: containerd then never gives a container an
``oom_score_adj`` below its own (``restrictOOMScoreAdj``), but NRI's ``oom_score_adj`` adjustment lands in
the spec as the plugin wrote it. Measured on containerd 2.1.9 with ``restrict_oom_score_adj = true`` and a
hook server answering ``-500``: through ``krproxy serve`` the container got 0 (containerd's own); through
NRI the spec said -500 and runc, without CAP_SYS_RESOURCE, failed to start it (with it, the container
would have had -500). :func:`restricts_oom_score_adj` reads the setting from ``--containerd-config``, as
:mod:`krproxy.nri.validator` reads that file; :func:`krproxy.nri.convert.adjustment` then raises an
``oom_score_adj`` below containerd's own to it, as containerd would have: containerd's own is read from
the NRI socket's peer (:func:`krproxy.nri.plugin.peer_oom_score_adj`); unknown, the one containerd chose for the container
(never below its own) bounds it instead. Measured on 2.1.9: kubelet asking 900, a hook answering 450
(containerd's own 0), proxy mode gave 450, and krproxy nri, bounding by 900, had withheld it.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from typing import Any

from krproxy.nri.validator import load_config

__all__ = ["CRI_PLUGIN_KEYS", "restricts_oom_score_adj"]

#: Where ``restrict_oom_score_adj`` lives: containerd 1.x's CRI plugin, 2.x's CRI runtime plugin.
CRI_PLUGIN_KEYS = ("io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime")


def _version(path: str) -> Any:
    with open(path, "rb") as file:  # (load_config read it already: it is TOML)
        return tomllib.load(file).get("version", 0)


def restricts_oom_score_adj(path: str) -> bool:
    """Whether containerd's configuration at *path* (with its imports) sets ``restrict_oom_score_adj``, as
    containerd 2.1.9's ``config dump`` shows it: the CRI runtime plugin's value when the merged files set
    one; else the 1.x CRI plugin's, which containerd 2.x migrates only from a file of version 2 among those
    read (a version 3 file's, or a version 1 or unversioned main file's, is an unknown key it ignores).
    containerd 1.7 reads the 1.x key of a version 2 file, as here (its ``[plugins.cri]`` of version 1 is not
    read: 1.7's NRI has no ``oom_score_adj`` to withhold).

    Raises:
        ConfigError: a file cannot be read or is not TOML.
    """
    document, files, _ = load_config(path)
    plugins = document.get("plugins")
    if not isinstance(plugins, Mapping):
        return False
    grpc, runtime = (plugins.get(key) for key in CRI_PLUGIN_KEYS)
    if isinstance(runtime, Mapping) and "restrict_oom_score_adj" in runtime:
        return runtime["restrict_oom_score_adj"] is True
    migrated = any(_version(file) == 2 for file in files)
    return migrated and isinstance(grpc, Mapping) and grpc.get("restrict_oom_score_adj") is True
