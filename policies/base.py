"""The policy interface: a plug-in that turns findings into decisions."""

from __future__ import annotations

from tmd.plugins import Plugin


class Policy(Plugin):
    """Consumes ``tmd.events.Finding``s and emits ``tmd.events.Decision``s."""
