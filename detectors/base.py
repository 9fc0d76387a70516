"""The detector interface: a plug-in that emits findings."""

from __future__ import annotations

from typing import ClassVar

from tmd.plugins import Plugin


class Detector(Plugin):
    """Consumes wire messages (``tmd.wire``) and emits ``tmd.daemon.events.Finding``s.

    ``reads_ranks``: it reads the ranks of the view's jobs (their steps), so with
    ``ingest.shards`` it runs in each shard, on the jobs that shard owns, rather than in
    the daemon's process, whose view then holds the jobs' statuses but not their ranks
    (``tmd.daemon.shards``). Detectors of machines leave it False."""

    reads_ranks: ClassVar[bool] = False
