"""examples/first_plugin.py works as docs/plugin-authoring.md says."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

import pytest

from krproxy.hookserver import (
    CgroupFile,
    ContainerContext,
    ContainerInfo,
    Executor,
    PodContext,
    PodInfo,
    Stage,
)
from krproxy.hookserver.testing import FakeNode, container_request, pod_request

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "first_plugin.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("first_plugin", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.pop("first_plugin", None)
    spec.loader.exec_module(module)
    return module


def test_plugin_functions(example: ModuleType) -> None:
    """The functions alone: POD_NAME is added; only BE pods become idle."""
    ctx = ContainerContext(ContainerInfo.from_proto(container_request(pod_request("web"), "app")))
    example.pod_name_env(ctx)
    assert {"POD_NAME": "web"} == ctx.response.add_envs
    be = PodContext(PodInfo.from_proto(pod_request("batch", qos="BE")))
    ls = PodContext(PodInfo.from_proto(pod_request("web")))
    example.be_idle(be)
    example.be_idle(ls)
    assert (1, None) == (be.response.resources.cpu_idle, ls.response.resources.cpu_idle)


def test_app_end_to_end(example: ModuleType, tmp_path: pathlib.Path) -> None:
    """Through the app (with a fake node): registration stages, env in the answer, cpu.idle written."""
    node = FakeNode(tmp_path).create()
    pod = pod_request("batch", qos="BE")
    node.add_cgroup(pod.cgroup_parent)
    app = example.app
    app.executor = Executor(node.cgroup_root, node.resctrl_root, 2)
    assert (Stage.PRE_RUN_POD_SANDBOX, Stage.PRE_CREATE_CONTAINER) == app.registry.stages()
    app.handle_pod(Stage.PRE_RUN_POD_SANDBOX, pod)
    assert "1" == node.read(pod.cgroup_parent, CgroupFile.CPU_IDLE)
    resp = app.handle_container(Stage.PRE_CREATE_CONTAINER, container_request(pod, "app"))
    assert {"POD_NAME": "batch"} == resp.container_envs


def test_the_guide_shows_the_whole_example() -> None:
    """plugin-authoring.md section 1 shows examples/first_plugin.py whole, so a reader who writes the
    file as shown gets a server (it showed only the hook functions: run as written, the file
    defined ``app`` and exited 0 without serving)."""
    guide = (EXAMPLE.parents[1] / "docs" / "plugin-authoring.md").read_text()
    first_block = guide.split("```python\n", 1)[1].split("```\n", 1)[0]
    assert EXAMPLE.read_text() == first_block
