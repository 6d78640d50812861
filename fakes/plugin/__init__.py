"""A fake runtime hook plugin: a scriptable ``RuntimeHookService`` on a unix socket, for tests and demos.

:class:`FakePlugin` answers every hook (by default echoing the request as koordlet does, plus its
:class:`Changes`), can be told to misbehave (:class:`Misbehaviour`) and logs every call;
:func:`run_fake_plugin` serves it as a trio task (with ``answer_after``: listening but not answering, for
a while or for ever); :func:`write_registration` tells a proxy about it.
``python -m krproxy.fakes.plugin`` runs one from the command line.
"""

from __future__ import annotations

from krproxy.fakes.plugin.registration import ALL_HOOKS as ALL_HOOKS
from krproxy.fakes.plugin.registration import registration_document as registration_document
from krproxy.fakes.plugin.registration import remove_registration as remove_registration
from krproxy.fakes.plugin.registration import write_atomic as write_atomic
from krproxy.fakes.plugin.registration import write_registration as write_registration
from krproxy.fakes.plugin.server import GARBAGE as GARBAGE
from krproxy.fakes.plugin.server import Call as Call
from krproxy.fakes.plugin.server import Changes as Changes
from krproxy.fakes.plugin.server import FakePlugin as FakePlugin
from krproxy.fakes.plugin.server import Misbehaviour as Misbehaviour
from krproxy.fakes.plugin.server import echo_container as echo_container
from krproxy.fakes.plugin.server import echo_pod as echo_pod
from krproxy.fakes.plugin.server import request_type as request_type
from krproxy.fakes.plugin.server import run_fake_plugin as run_fake_plugin

__all__ = [
    "ALL_HOOKS",
    "GARBAGE",
    "Call",
    "Changes",
    "FakePlugin",
    "Misbehaviour",
    "echo_container",
    "echo_pod",
    "registration_document",
    "remove_registration",
    "request_type",
    "run_fake_plugin",
    "write_atomic",
    "write_registration",
]
