"""OCI hooks (``hooks.d``, schema 1.0.0) for containerd, the way CRI-O and podman run them.

Two ways to run them, sharing one parser and one matcher:

- at the proxy (:mod:`krproxy.ocihooks.proxy`): ``krproxy serve --oci-hooks-dir DIR`` runs the
  matching hooks around StartContainer / StopContainer, with the state the proxy knows;
- inside the runtime (:mod:`krproxy.ocihooks.wrapper`): ``krproxy-runc-wrapper``, configured as a
  containerd runtime's ``BinaryName``, adds the matching hooks to the bundle's ``config.json`` on
  ``runc create`` so that runc itself runs them, with the true state.

The modules the wrapper imports (:mod:`.model`, :mod:`.execute`, :mod:`.wrapper`) use the
standard library only: the wrapper runs for every runc call, so its start-up time matters.
This package's ``__init__`` therefore imports nothing.
"""

# Its modules are the public surface: model (hook files, matching), execute, wrapper, proxy.
__all__: list[str] = []
