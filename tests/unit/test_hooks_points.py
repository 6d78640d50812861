"""The hook point table (krproxy.hooks.points)."""

from __future__ import annotations

import pathlib
import re

import pytest

from krproxy.hooks.points import HookPoint, Stage, hook_points_for

HOOK_PROTO = pathlib.Path(__file__).resolve().parents[2] / "protos" / "runtime_hook_v1alpha1.proto"

P = HookPoint


class TestHookPoint:
    @pytest.mark.parametrize(
        ("point", "stage", "cri_method", "rpc_path", "pod_level"),
        [
            (P.PRE_RUN_POD_SANDBOX, Stage.PRE, "RunPodSandbox", "PreRunPodSandboxHook", True),
            (P.POST_STOP_POD_SANDBOX, Stage.POST, "StopPodSandbox", "PostStopPodSandboxHook", True),
            (P.PRE_CREATE_CONTAINER, Stage.PRE, "CreateContainer", "PreCreateContainerHook", False),
            (P.PRE_START_CONTAINER, Stage.PRE, "StartContainer", "PreStartContainerHook", False),
            (P.POST_START_CONTAINER, Stage.POST, "StartContainer", "PostStartContainerHook", False),
            (P.POST_STOP_CONTAINER, Stage.POST, "StopContainer", "PostStopContainerHook", False),
            (
                P.PRE_UPDATE_CONTAINER_RESOURCES,
                Stage.PRE,
                "UpdateContainerResources",
                "PreUpdateContainerResourcesHook",
                False,
            ),
            (
                P.PRE_UPDATE_POD_SANDBOX_RESOURCES,
                Stage.PRE,
                "UpdatePodSandboxResources",
                "PreUpdatePodSandboxResourcesHook",
                True,
            ),
        ],
    )
    def test_table(
        self, point: HookPoint, stage: Stage, cri_method: str, rpc_path: str, pod_level: bool
    ) -> None:
        """Each hook point has its stage, CRI method, RPC path and request kind."""
        expected = (
            stage,
            cri_method,
            f"/runtime.v1.RuntimeService/{cri_method}",
            f"/runtime.v1alpha1.RuntimeHookService/{rpc_path}",
            pod_level,
        )

        assert expected == (point.stage, point.cri_method, point.cri_path, point.rpc_path, point.is_pod_level)

    def test_rpc_paths_are_the_methods_of_the_proto_service(self) -> None:
        """Every hook point's RPC path, and its request kind, is a method of RuntimeHookService in
        protos/runtime_hook_v1alpha1.proto, and every method there is a hook point."""
        service = re.search(r"service RuntimeHookService \{(.*?)\n\}", HOOK_PROTO.read_text(), re.DOTALL)
        assert service is not None
        methods = dict(re.findall(r"^\s*rpc (\w+)\((\w+)\)", service.group(1), re.MULTILINE))

        assert {f"/runtime.v1alpha1.RuntimeHookService/{name}" for name in methods} == {
            p.rpc_path for p in HookPoint
        }
        assert all((methods[p.rpc_name] == "PodSandboxHookRequest") == p.is_pod_level for p in HookPoint)

    @pytest.mark.parametrize(
        ("method", "expected"),
        [
            ("StartContainer", (P.PRE_START_CONTAINER, P.POST_START_CONTAINER)),
            ("/runtime.v1.RuntimeService/StartContainer", (P.PRE_START_CONTAINER, P.POST_START_CONTAINER)),
            ("RunPodSandbox", (P.PRE_RUN_POD_SANDBOX,)),
            ("UpdatePodSandboxResources", (P.PRE_UPDATE_POD_SANDBOX_RESOURCES,)),
            ("StopPodSandbox", (P.POST_STOP_POD_SANDBOX,)),
            ("ListContainers", ()),
            ("RemovePodSandbox", ()),
            ("/runtime.v1.ImageService/StartContainer", ()),
            ("/runtime.v1.RuntimeService/SomethingNew", ()),
        ],
    )
    def test_hook_points_for(self, method: str, expected: tuple[HookPoint, ...]) -> None:
        """CRI methods map to their hook points, pre first; others to none."""
        assert expected == hook_points_for(method)

    @pytest.mark.parametrize(
        ("name", "expected"), [("PreCreateContainer", P.PRE_CREATE_CONTAINER), ("PreFoo", None)]
    )
    def test_from_name(self, name: str, expected: HookPoint | None) -> None:
        """Registration names resolve to hook points, unknown ones to None."""
        assert expected == HookPoint.from_name(name)
