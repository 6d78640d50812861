"""Stand-ins for the processes krproxy talks to (container runtime, hook plugins), for tests and demos."""

# Each fake is a subpackage with a public surface of its own (krproxy.fakes.containerd, krproxy.fakes.plugin, krproxy.fakes.dockerd,
# krproxy.fakes.nri); krproxy.fakes.strict holds what grpc-go refuses, which the gRPC fakes apply.
__all__: list[str] = []
