"""``rank_stalled``: a rank that stopped reporting while its peers went on.

In data-parallel training a rank whose process hangs usually stalls everyone in the
next all-reduce; a rank that goes silent while the others keep stepping has lost its
telemetry path, its process or its machine. Reported once per stall; a rank that
reports again re-arms. A job whose ranks all stop is not a rank stall. Reads the
view's step columns on each tick (every rank's last step and report, as vectors), not
every telemetry message, and only while the daemon's view is trusted
(``tmd.daemon.freshness``), counting silences from when it became current, or from
when what the job's ranks published themselves was last found lost on the way
(``JobView.lost_at``: that job's view settles anew).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import numpy as np

from tmd.daemon import events
from tmd.daemon.view import JobView
from tmd.detectors.base import Detector
from tmd.errors import ConfigError
from tmd.plugins import Context


@dataclass(frozen=True, kw_only=True)
class RankStalledConfig:
    stall_after_s: float = 30.0  # silent this long ...
    stall_steps: int = 5  # ... while the job's front moved this many steps past it

    def validate(self) -> None:
        key = "detectors.rank_stalled."
        if not self.stall_after_s > 0:
            raise ConfigError(key + "stall_after_s", "must be > 0")
        if self.stall_steps < 1:
            raise ConfigError(key + "stall_steps", "must be >= 1")


class RankStalledDetector(Detector):
    name = "rank_stalled"
    reads_ranks = True
    Config = RankStalledConfig
    tick_interval = timedelta(seconds=1)
    config: RankStalledConfig

    def __init__(self, config: RankStalledConfig, *, context: Context) -> None:
        super().__init__(config, context=context)
        self._reported: dict[tuple[str, int], int] = {}  # (job, rank) -> its last step then

    def tick(self, now: float) -> Iterable[events.Event]:
        since = self.context.view.freshness.since(now)
        if since is None:
            return  # the daemon's view is stale or settling: silence proves nothing
        jobs = self.context.view.jobs
        for key in [k for k in self._reported if k[0] not in jobs or k[1] not in jobs[k[0]].ranks]:
            del self._reported[key]  # the view forgot the job, or the rank left it
        for name, job in jobs.items():
            yield from self._check(name, job, now, since)

    def _check(self, name: str, job: JobView, now: float, since: float) -> Iterator[events.Event]:
        cfg = self.config
        if now - job.lost_at < self.context.view.freshness.settle_s:
            return  # what its ranks published was lost on the way: settling
        since = max(since, job.lost_at)  # silences count from the loss
        if not job.ranks or now - max(job.last_seen, since) > cfg.stall_after_s:
            return  # nobody is stepping: a job stall, not a rank stall
        cols = job.cols
        if cols is None:
            return
        # Every rank at once: its column's ``last_step`` and ``last_seen`` (``StepColumns``).
        used = cols.in_use()
        steps, seen = cols.last_step[used], cols.last_seen[used]
        front = int(steps.max())
        silent = now - np.maximum(seen, since) > cfg.stall_after_s
        hits = used[silent & (front - steps >= cfg.stall_steps)]
        for r in sorted(cols.rank[hits].tolist()):  # by rank: columns are reused in any order
            rank = job.ranks[r]
            if self._reported.get((name, r)) == rank.last_step:
                continue  # already reported, and it has not moved since
            self._reported[(name, r)] = rank.last_step
            yield events.RankStalled(
                ts=now,
                job=name,
                node=rank.node,
                rank=r,
                last_step=rank.last_step,
                detail=f"silent {now - rank.last_seen:.0f} s at step {rank.last_step}; "
                f"peers at step {front}",
            )
