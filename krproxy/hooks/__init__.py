"""Runtime hooks: the pure, synchronous core (records, conversions, merge rules, hook points, plugin
registration, store). The I/O parts (dispatch to plugins, directory watching) live in other modules of this
package and build on these.
"""

from krproxy.hooks.merge import Change as Change
from krproxy.hooks.merge import Merged as Merged
from krproxy.hooks.model import ContainerInfo as ContainerInfo
from krproxy.hooks.model import FrozenMap as FrozenMap
from krproxy.hooks.model import PodInfo as PodInfo
from krproxy.hooks.model import Resources as Resources
from krproxy.hooks.points import HookPoint as HookPoint
from krproxy.hooks.points import Stage as Stage
from krproxy.hooks.registration import FailurePolicy as FailurePolicy
from krproxy.hooks.registration import PluginRegistration as PluginRegistration
from krproxy.hooks.registration import RegistrationError as RegistrationError
from krproxy.hooks.registration import Registry as Registry
from krproxy.hooks.store import HookStore as HookStore
from krproxy.hooks.store import StoreStatistics as StoreStatistics

__all__ = [
    "Change",
    "ContainerInfo",
    "FailurePolicy",
    "FrozenMap",
    "HookPoint",
    "HookStore",
    "Merged",
    "PluginRegistration",
    "PodInfo",
    "RegistrationError",
    "Registry",
    "Resources",
    "Stage",
    "StoreStatistics",
]
