"""How one fake containerd behaves where a test may choose: its clock, its IDs, the containerd version
it imitates and the few policies that differ from it on request. Every part of
:class:`~krproxy.fakes.containerd.state.RuntimeState` holds the same :class:`Settings`, so a change
(``state.settings.order = ...``) is seen by all of them at once."""

from __future__ import annotations

import random
from collections.abc import Callable

import attrs

from krproxy.fakes.containerd.versions import Imitation, imitation


@attrs.define(eq=False)
class Settings:
    """The choices of one fake containerd (the defaults are :class:`RuntimeState`'s arguments').

    Attributes:
        clock: returns the current time in nanoseconds since the epoch.
        new_id: returns a fresh 64-hex ID for each sandbox and container.
        force_remove_running: RemoveContainer on a RUNNING container kills it first (containerd's
            behaviour). When false it is refused with UNKNOWN "container is still running, to stop
            first", the message containerd's own guard would give.
        require_pulled_images: when true, CreateContainer of an image nobody pulled is NOT_FOUND
            (like containerd); by default the image is recorded on the fly, so tests need no pulls.
        order: shuffles every list answer (ListPodSandbox, ListContainers, ListContainerStats,
            ListImages) anew on each call: containerd's lists come from maps and their order
            changes from call to call, so nobody may rely on one. Seeded by
            :func:`~krproxy.fakes.containerd.records.list_order`, or pass ``random.Random(seed)``.
        imitate: the containerd version imitated where versions differ
            (:mod:`krproxy.fakes.containerd.versions`): "1.6" (the default), "1.7", "2.1" ("2.x") or
            "2.3", or an :class:`Imitation`.
        pod_resize: answer UpdatePodSandboxResources as containerd 2.3 does (true), or with UNIMPLEMENTED
            "unknown method ..." as containerd 1.6 to 2.1, whose CRI server lacks it (false); None (the
            default): as the imitated version does.
    """

    clock: Callable[[], int]
    new_id: Callable[[], str]
    force_remove_running: bool
    require_pulled_images: bool
    order: random.Random
    imitate: Imitation = attrs.field(converter=imitation)
    pod_resize: bool | None

    @property
    def answers_pod_resize(self) -> bool:
        """Whether UpdatePodSandboxResources is answered: :attr:`pod_resize` if set, else as the
        imitated version does."""
        return self.imitate.pod_resize if self.pod_resize is None else self.pod_resize
