"""Which object an id names: containerd's reading of a pod or container id, a unique prefix included.

containerd's CRI stores look every pod and container id up through a *truncindex* (``pkg/truncindex``, a copy
of moby's): any non-empty prefix of exactly one stored id names that object, so ``crictl start 3cdc06a66d67``
starts the container whose 64-digit id begins so. An empty id is refused (``prefix can't be empty``), a prefix
of two or more ids too (``Multiple IDs found with provided prefix: P``), and one that matches nothing is
``not found``. Pods and containers have an index each. krproxy's store (:mod:`krproxy.hooks.store`) keeps one
:class:`IdIndex` per kind, so that the interceptors find the record the runtime will act on, and name the same
object to the hooks, the store and the runtime (:mod:`krproxy.hooks.runtime`).

The truncindex's rules, as :meth:`IdIndex.resolve` keeps them:

* ``""`` is refused, whatever is stored;
* a key names the one stored id it is a prefix of (itself included); a key that is a prefix of two or more
  stored ids is ambiguous, *even when it is itself one of them* (the trie visits the whole subtree). Stored ids
  all of one length (containerd's are 64 hex digits) are never prefixes of one another, so there a stored id
  always names itself;
* a key that is a prefix of no stored id names nothing (the caller's own "not found").

Cost: a stored full id is one dict look-up (the kubelet's case: it only ever sends full ids). Only a key that is
not stored is looked for as a prefix, by bisection in a sorted list of the ids (log n comparisons); the list is
kept sorted as ids come and go (an insertion moves pointers, not strings).

The refusal is written as containerd writes it (:func:`refusal`): status UNKNOWN (containerd's ``errdefs``
knows neither error, and grpc-go sends an error without a status as UNKNOWN), the message its CRI method wraps
around the truncindex error. Measured against containerd 1.6.20, 1.7.24 and 2.1.9 (identical but for one
letter: 1.6's moby copy says ``Prefix can't be empty``; krproxy writes 1.7's and 2.x's ``prefix``).

Pure: no I/O, no event loop, no protobuf (the store imports it); the request naming the full id is written by
:func:`krproxy.hooks._reading.with_id`.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable
from typing import Final, final

from krproxy.grpcstatus import GRPCError, Status, go_quote

__all__ = ["EMPTY", "FIND_MESSAGES", "IdIndex", "IdRefused", "go_quote", "refusal"]

#: truncindex's ``ErrEmptyPrefix`` (containerd 1.7 and 2.x; 1.6 capitalises the first letter).
EMPTY: Final = "prefix can't be empty"


@final
class IdRefused(Exception):
    """The truncindex refuses *key*: it is empty, or a prefix of two or more stored ids (``str()``: the
    truncindex's own message)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.reason = EMPTY if not key else f"Multiple IDs found with provided prefix: {key}"
        super().__init__(self.reason)

    @property
    def empty(self) -> bool:
        return not self.key


@final
class IdIndex:
    """The ids of one kind of object (pods, or containers), resolved as containerd's truncindex resolves them."""

    __slots__ = ("_ids", "_lengths", "_sorted")

    def __init__(self, ids: Iterable[str] = ()) -> None:
        self._ids: set[str] = set()
        self._sorted: list[str] = []
        self._lengths: Counter[int] = Counter()
        self.replace(ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, ident: object) -> bool:
        return ident in self._ids

    def add(self, ident: str) -> None:
        """Store *ident* (again: nothing changes)."""
        if ident in self._ids:
            return
        self._ids.add(ident)
        bisect.insort(self._sorted, ident)
        self._lengths[len(ident)] += 1

    def discard(self, ident: str) -> None:
        """Forget *ident* (not stored: nothing changes)."""
        if ident not in self._ids:
            return
        self._ids.remove(ident)
        del self._sorted[bisect.bisect_left(self._sorted, ident)]
        self._lengths[len(ident)] -= 1
        if not self._lengths[len(ident)]:
            del self._lengths[len(ident)]

    def replace(self, ids: Iterable[str]) -> None:
        """Forget everything, then store *ids*."""
        self._ids = set(ids)
        self._sorted = sorted(self._ids)
        self._lengths = Counter(len(ident) for ident in self._ids)

    def resolve(self, key: str) -> str | None:
        """The stored id *key* names (see the module docstring), or None if it names none.

        Raises:
            IdRefused: *key* is empty, or a prefix of two or more stored ids.
        """
        if not key:
            raise IdRefused(key)
        if key in self._ids and len(self._lengths) == 1:
            return key  # ids of one length: none is a prefix of another
        ids = self._sorted
        at = bisect.bisect_left(ids, key)  # the first stored id >= key: the smallest key is a prefix of
        if at == len(ids) or not ids[at].startswith(key):
            return None
        if at + 1 < len(ids) and ids[at + 1].startswith(key):
            raise IdRefused(key)
        return ids[at]


#: How containerd's CRI methods word a truncindex error (its ``%q`` of the id sent, then the error), by method.
#: The same in 1.6.20, 1.7.24 and 2.1.9 (measured), and in 2.3's source for UpdatePodSandboxResources.
FIND_MESSAGES: Final[dict[str, str]] = {
    "StartContainer": "an error occurred when try to find container {id}: {reason}",
    "StopContainer": "an error occurred when try to find container {id}: {reason}",
    "RemoveContainer": "an error occurred when try to find container {id}: {reason}",
    "ContainerStatus": "an error occurred when try to find container {id}: {reason}",
    "UpdateContainerResources": "failed to find container: {reason}",
    "StopPodSandbox": "an error occurred when try to find sandbox {id}: {reason}",
    "RemovePodSandbox": "an error occurred when try to find sandbox {id}: {reason}",
    "PodSandboxStatus": "an error occurred when try to find sandbox: {reason}",
    "UpdatePodSandboxResources": "failed to find sandbox: {reason}",
    "CreateContainer": "failed to find sandbox id {id}: {reason}",
}


def refusal(method: str, refused: IdRefused) -> GRPCError:
    """The error containerd's *method* answers for the id *refused* names (UNKNOWN, its wording)."""
    message = FIND_MESSAGES[method].format(id=go_quote(refused.key), reason=refused.reason)
    return GRPCError(Status.UNKNOWN, message)
