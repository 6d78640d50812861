"""NRI's requests decoded with upb (protobuf's C implementation) instead of betterproto2.

Every NRI event carries the whole pod and, for container events, the whole container (mounts, env,
namespaces, resources, annotations: a few KiB); betterproto2 decodes that in pure Python in milliseconds,
several times per pod start, while containerd waits for the answer. upb does it in microseconds. The
classes are built at import from the descriptor of our own ``protos/nri_v1alpha1.proto``
(:mod:`krproxy.proto.descriptors`) in a private descriptor pool, maps read as their entries as
:mod:`krproxy.hooks.wire` does (:func:`krproxy.hooks.wire.entries` turns them into dicts in wire order).

Only decoding goes through here; the answers krproxy builds (adjustments, updates) stay betterproto2
messages. The classes are created at run time, so they are typed ``Any``; an unset sub-message reads as an
empty one (``HasField`` tells them apart), so an unset ``OptionalInt64`` reads as value 0, as the
converters want.
"""

from __future__ import annotations

import functools
from typing import Any

from google.protobuf import message_factory

from krproxy.hooks.wire import entries, private_pool
from krproxy.proto import descriptors

__all__ = ["entries", "message_class"]

_POOL = private_pool(descriptors.NRI_V1ALPHA1)


@functools.cache
def message_class(name: str) -> Any:
    """The upb message class of the ``nri.pkg.api.v1alpha1`` message *name* (e.g. ``"StartContainerRequest"``)."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"nri.pkg.api.v1alpha1.{name}"))


def parse(name: str, payload: bytes) -> Any:
    """``payload`` decoded as the message *name*; :class:`google.protobuf.message.DecodeError` if it is none."""
    message = message_class(name)()
    message.ParseFromString(payload)
    return message
