"""Stand-ins for the processes krproxy talks to (container runtime, hook plugins), for tests and demos."""

# Each fake is a subpackage with a public surface of its own (fakes.containerd, fakes.plugin, fakes.dockerd,
# fakes.nri); fakes.strict holds what grpc-go refuses, which the gRPC fakes apply.
__all__: list[str] = []
