"""krproxy: a CRI runtime proxy for Kubernetes nodes with out-of-process hook plugins."""

__version__ = "0.1.0"
