"""``rank_stalled``: a rank that stopped reporting while its peers went on.

In data-parallel training a rank whose process hangs usually stalls everyone in the
next all-reduce; a rank that goes silent while the others keep stepping has lost its
telemetry path, its process or its machine. Reported once per stall; a rank that
reports again re-arms. A job whose ranks all stop is not a rank stall.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from tmd import events, wire
from tmd.detectors.base import Detector
from tmd.errors import ConfigError
from tmd.plugins import Context


@dataclass(frozen=True, kw_only=True)
class RankStalledConfig:
    stall_after_s: float = 30.0  # silent this long ...
    stall_steps: int = 5  # ... while the job's front moved this many steps past it
    forget_after_s: float = 3600.0

    def validate(self) -> None:
        key = "detectors.rank_stalled."
        if not self.stall_after_s > 0:
            raise ConfigError(key + "stall_after_s", "must be > 0")
        if self.stall_steps < 1:
            raise ConfigError(key + "stall_steps", "must be >= 1")
        if not self.forget_after_s > self.stall_after_s:
            raise ConfigError(key + "forget_after_s", "must be > stall_after_s")


@dataclass
class _Rank:
    node: str
    last_step: int
    last_seen: float
    stalled: bool = False


@dataclass
class _Job:
    ranks: dict[int, _Rank] = field(default_factory=dict)
    front: int = -1
    last_seen: float = 0.0


class RankStalledDetector(Detector):
    name = "rank_stalled"
    Config = RankStalledConfig
    consumes = (wire.IterBatch,)
    tick_interval = timedelta(seconds=1)
    config: RankStalledConfig

    def __init__(self, config: RankStalledConfig, *, context: Context) -> None:
        super().__init__(config, context=context)
        self.jobs: dict[str, _Job] = {}

    def observe(self, event: Any, now: float) -> Iterable[events.Event]:
        job = self.jobs.setdefault(event.job, _Job())
        last = max(s.step for s in event.steps)
        rank = job.ranks.get(event.rank)
        if rank is None:
            job.ranks[event.rank] = _Rank(event.node, last, now)
        else:
            rank.node, rank.last_seen, rank.stalled = event.node, now, False
            rank.last_step = max(rank.last_step, last)
        job.front = max(job.front, last)
        job.last_seen = now
        return ()

    def tick(self, now: float) -> Iterable[events.Event]:
        cfg = self.config
        for name in [n for n, j in self.jobs.items() if now - j.last_seen > cfg.forget_after_s]:
            del self.jobs[name]
        for name, job in self.jobs.items():
            yield from self._check(name, job, now)

    def _check(self, name: str, job: _Job, now: float) -> Iterator[events.Event]:
        cfg = self.config
        if now - job.last_seen > cfg.stall_after_s:
            return  # nobody is stepping: a job stall, not a rank stall
        for r, rank in job.ranks.items():
            if rank.stalled or now - rank.last_seen <= cfg.stall_after_s:
                continue
            if job.front - rank.last_step < cfg.stall_steps:
                continue
            rank.stalled = True
            yield events.RankStalled(
                ts=now,
                job=name,
                node=rank.node,
                rank=r,
                last_step=rank.last_step,
                detail=f"silent {now - rank.last_seen:.0f} s at step {rank.last_step}; "
                f"peers at step {job.front}",
            )
