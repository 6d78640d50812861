"""Every CRI method of our protos: its path, message classes and cardinality.

Read from the serialized descriptor of ``protos/cri_v1.proto`` (:mod:`krproxy.proto.descriptors`):
the generated betterproto2 code holds messages only (scripts/genproto.py), so this is where the
daemon, ``krproxy trace`` and the fake containerd find the route table.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import attrs
import betterproto2
from google.protobuf import descriptor_pb2

from krproxy.grpcstatus import Cardinality
from krproxy.proto import descriptors
from krproxy.proto.runtime import v1 as cri

__all__ = ["Method", "cri_methods"]


@attrs.frozen
class Method:
    """A CRI method: ``/runtime.v1.RuntimeService/Version``, its request and reply classes."""

    path: str
    request: type[betterproto2.Message]
    reply: type[betterproto2.Message]
    cardinality: Cardinality


def _message_class(full_name: str) -> type[betterproto2.Message]:
    cls: type[betterproto2.Message] = getattr(cri, full_name.rpartition(".")[2])
    return cls


@functools.cache
def cri_methods() -> Mapping[str, Method]:
    """Every RuntimeService and ImageService method, by path."""
    file = descriptor_pb2.FileDescriptorProto.FromString(descriptors.CRI_V1)
    methods = {}
    for service in file.service:
        for method in service.method:
            path = f"/{file.package}.{service.name}/{method.name}"
            cardinality = Cardinality((method.client_streaming, method.server_streaming))
            methods[path] = Method(
                path, _message_class(method.input_type), _message_class(method.output_type), cardinality
            )
    return methods
