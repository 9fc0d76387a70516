"""Detectors (``tmd.detectors``): turn raw signals into typed findings.

Each detector is a ``tmd.daemon.plugins.Plugin`` whose ``observe``/``tick`` return findings
(``tmd.daemon.events.Finding``). They are pure about time: ``now`` is passed in, taken from
the injected clock. Built-ins are listed here by name; the name is also the config
section (``[detectors.NAME]``), the metric label and the logger name.
"""

from __future__ import annotations

from tmd.detectors.base import Detector
from tmd.detectors.gpu_health import GpuHealthDetector
from tmd.detectors.node_lost import NodeLostDetector
from tmd.detectors.rank_stalled import RankStalledDetector
from tmd.detectors.straggler import StragglerDetector

BUILTIN: dict[str, type[Detector]] = {
    d.name: d for d in (GpuHealthDetector, NodeLostDetector, RankStalledDetector, StragglerDetector)
}

__all__ = ["BUILTIN", "Detector"]
