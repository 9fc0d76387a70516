"""The plug-in API for detectors and policies, built-in and third-party alike.

A third-party plug-in starts with ``from tmd.plugins import Plugin`` and registers its
class under the entry-point group ``tmd.detectors`` or ``tmd.policies``. What it may
read comes in its ``Context`` (the cluster view and the clock); what it returns are
events from ``tmd.daemon.events``. The registry and the runner that supervises every
plug-in live in ``tmd.daemon.plugins``; this module is the stable name to import.
"""

from tmd.daemon.plugins import Context, NoConfig, Plugin

__all__ = ["Context", "NoConfig", "Plugin"]
