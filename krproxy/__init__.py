"""krproxy: a CRI runtime proxy for Kubernetes nodes with out-of-process hook plugins."""

__version__ = "0.1.0"

# The public parts are the subpackages and modules (docs/architecture.md); the package itself
# only says which krproxy this is.
__all__ = ["__version__"]
