"""The bounded soak: many mixed CRI calls from many concurrent clients through the proxy, with plugins.

``python -m tests.soak [--calls N] [--seconds S] [--clients C] [--processes P]`` or ``nox -s soak``.
See :mod:`tests.soak.run`.
"""
