"""The detector interface: a plug-in that emits findings."""

from __future__ import annotations

from tmd.plugins import Plugin


class Detector(Plugin):
    """Consumes wire messages (``tmd.wire``) and emits ``tmd.daemon.events.Finding``s."""
