"""Stand-ins for the processes krproxy talks to (container runtime, hook plugins), for tests and demos."""
