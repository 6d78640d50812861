"""The transparent proxy in front of the fake containerd: large lists and event streams."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as pb
from cri_api.v1 import api_pb2_grpc as pb_grpc

from tests.integration.support import ProxiedFake, create_in_new_pod, in_thread, wait_until


class _InsertionOrder(random.Random):
    """An order for the fake's lists that is no shuffle at all."""

    def shuffle(self, x: Any) -> None:
        pass


class TestLargeList:
    async def test_1000_containers_forwarded_intact(
        self, proxied_fake: ProxiedFake, channel_to: Callable[[str], grpc.Channel]
    ) -> None:
        """ListContainers with 1000 containers (~860 KB) comes back byte-identical to a direct call."""
        fake = proxied_fake.fake
        fake.seed(pods=1000, containers_per_pod=1)
        path = "/runtime.v1.RuntimeService/ListContainers"
        request = pb.ListContainersRequest().SerializeToString()

        def raw(channel: grpc.Channel) -> bytes:
            call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
            answer: bytes = call(request, timeout=30)
            return answer

        # The fake shuffles every list anew, as containerd's order changes; here the point is the
        # bytes the proxy forwards, so the runtime answers both calls in one order.
        fake.state.settings.order = _InsertionOrder()
        through_proxy = await in_thread(raw, channel_to(proxied_fake.daemon.config.listen))
        direct = await in_thread(raw, channel_to(proxied_fake.socket))
        assert len(direct) > 800_000
        assert direct == through_proxy
        assert 1000 == len(pb.ListContainersResponse.FromString(through_proxy).containers)


class TestContainerEvents:
    async def test_events_stream_through(
        self, proxied_fake: ProxiedFake, channel_to: Callable[[str], grpc.Channel]
    ) -> None:
        """GetContainerEvents through the proxy delivers the lifecycle events of a container created
        while the stream is open, and cancelling the stream ends the backend's subscription."""
        fake = proxied_fake.fake
        runtime = pb_grpc.RuntimeServiceStub(channel_to(proxied_fake.daemon.config.listen))
        events = runtime.GetContainerEvents(pb.GetEventsRequest(), timeout=30)
        received: list[pb.ContainerEventResponse] = []
        two_container_events = threading.Event()

        def consume() -> None:
            try:
                for event in events:
                    received.append(event)
                    kinds = [
                        e.container_event_type for e in received if e.container_id != e.pod_sandbox_status.id
                    ]
                    if len(kinds) >= 2:
                        two_container_events.set()
            except grpc.RpcError:
                pass  # cancelled below

        consumer = threading.Thread(target=consume)
        consumer.start()
        try:
            await wait_until(lambda: fake.event_subscribers == 1)
            container_id = await create_in_new_pod(runtime)
            await in_thread(
                runtime.StartContainer,
                pb.StartContainerRequest(container_id=container_id),
                timeout=10,
            )
            await wait_until(two_container_events.is_set)
        finally:
            events.cancel()
            await in_thread(consumer.join)
        container_events = [
            (e.container_id, e.container_event_type) for e in received if e.container_id == container_id
        ]
        assert [
            (container_id, pb.CONTAINER_CREATED_EVENT),
            (container_id, pb.CONTAINER_STARTED_EVENT),
        ] == container_events
        await wait_until(lambda: fake.event_subscribers == 0)
