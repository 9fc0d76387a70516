"""Detectors (``tmd.detectors``): turn raw signals into typed findings.

Each detector is a ``tmd.plugins.Plugin`` whose ``observe``/``tick`` return findings
(``tmd.events.Finding``). They are pure about time: ``now`` is passed in, taken from
the injected clock. Built-ins are listed here by name; the name is also the config
section (``[detectors.NAME]``), the metric label and the logger name.
"""

from __future__ import annotations

from tmd.detectors.base import Detector
from tmd.detectors.node_lost import NodeLostDetector

BUILTIN: dict[str, type[Detector]] = {
    NodeLostDetector.name: NodeLostDetector,
}

__all__ = ["BUILTIN", "Detector"]
