"""``straggler``: find the machine that is persistently slower than its peers.

In data-parallel training every rank waits for the slowest in the gradient
all-reduce, so step times are alike everywhere; the slow machine shows in its *busy*
time (compute + optimizer + data = step time minus all-reduce wait). For every step
that all live ranks of a job have reported, each rank's busy time is divided by the
median over ranks for that step. Dividing by the same step's median cancels whatever
hits the whole job (a slower phase, an evaluation pause on every rank); the median
over a window of recent ratios ignores single slow steps (a checkpoint on rank 0, a
GC pause, noise). A rank is a straggler when the interquartile mean of its last
``window_steps`` ratios exceeds ``1 + min_slowdown`` and most of the window agrees
(``min_confidence``, as NVIDIA resiliency-ext's 0.75 score threshold); it clears when
that mean falls below ``1 + clear_slowdown``. Findings are per node (a machine is
what gets replaced), carrying the worst rank's slowdown.

Scoring is the pure function ``score``; the detector keeps per-job state fed by
``observe`` and advances on ``tick`` at the pace of the slowest live rank. Ranks that
fall more than ``stall_lag_steps`` behind do not hold the others back (``rank_stalled``
reports them).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from tmd import events, wire
from tmd.detectors.base import Detector
from tmd.errors import ConfigError
from tmd.plugins import Context


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    min_slowdown: float = 0.08  # flag at 8% slower than the median rank
    clear_slowdown: float = 0.03
    window_steps: int = 24
    min_confidence: float = 0.75
    min_ranks: int = 3  # fewer ranks reporting a step: nothing to compare against
    stall_lag_steps: int = 64
    max_pending_steps: int = 512
    forget_after_s: float = 3600.0  # a job silent this long is dropped

    def validate(self) -> None:
        key = "detectors.straggler."
        if not self.forget_after_s > 0:
            raise ConfigError(key + "forget_after_s", "must be > 0")
        if not 0 < self.min_slowdown < 10:
            raise ConfigError(key + "min_slowdown", "must be in (0, 10)")
        if not 0 <= self.clear_slowdown < self.min_slowdown:
            raise ConfigError(key + "clear_slowdown", "must be in [0, min_slowdown)")
        if not 4 <= self.window_steps <= 1024:
            raise ConfigError(key + "window_steps", "must be in 4..1024")
        if not 0.5 <= self.min_confidence <= 1:
            raise ConfigError(key + "min_confidence", "must be in [0.5, 1]")
        if self.min_ranks < 2:
            raise ConfigError(key + "min_ranks", "must be >= 2")
        if self.stall_lag_steps < 1:
            raise ConfigError(key + "stall_lag_steps", "must be >= 1")
        if self.max_pending_steps < self.stall_lag_steps:
            raise ConfigError(key + "max_pending_steps", "must be >= stall_lag_steps")


@dataclass(frozen=True)
class Score:
    slowdown: float  # interquartile mean of the window's ratios - 1: what decides
    confidence: float  # share of the window above 1 + min_slowdown / 2
    since_step: int  # first step of the current run above that level
    run_slowdown: float  # the same mean over that run alone: what is reported


def score(window: Iterable[tuple[int, float]], config: StragglerConfig) -> Score:
    """Score one rank from its recent ``(step, busy / median busy)`` pairs, oldest first."""
    pairs = list(window)
    ratios = [r for _, r in pairs]
    level = 1 + config.min_slowdown / 2
    above = [r > level for r in ratios]
    since = pairs[-1][0] if pairs else 0
    run = 0
    for (step, _), hot in zip(reversed(pairs), reversed(above), strict=True):
        if not hot:
            break
        since, run = step, run + 1
    slowdown = interquartile_mean(ratios) - 1 if ratios else 0.0
    # At first detection part of the window predates the onset and pulls the mean
    # down; the run since the onset says better how slow the machine is now.
    recent = ratios[-run:] if run >= 4 else ratios
    return Score(
        slowdown=slowdown,
        confidence=sum(above) / len(ratios) if ratios else 0.0,
        since_step=since,
        run_slowdown=interquartile_mean(recent) - 1 if recent else 0.0,
    )


def interquartile_mean(values: list[float]) -> float:
    """Mean of the middle half: as robust to spikes as the median, and with about 20%
    less spread on noisy steps, so the same window tells a 10% straggler from noise
    sooner."""
    ordered = sorted(values)
    k = len(ordered) // 4
    middle = ordered[k : len(ordered) - k]
    return sum(middle) / len(middle)


@dataclass
class _Rank:
    node: str
    window: deque[tuple[int, float]]
    last_step: int = -1
    flagged: bool = False
    worst: Score | None = None


@dataclass
class _Job:
    ranks: dict[int, _Rank] = field(default_factory=dict)
    pending: dict[int, dict[int, float]] = field(default_factory=dict)  # step -> rank -> busy
    frontier: int = -1  # every step up to here has been scored
    max_step: int = -1
    flagged_nodes: dict[str, set[int]] = field(default_factory=dict)
    last_seen: float = 0.0


class StragglerDetector(Detector):
    name = "straggler"
    Config = StragglerConfig
    consumes = (wire.IterBatch,)
    tick_interval = timedelta(seconds=1)
    config: StragglerConfig

    def __init__(self, config: StragglerConfig, *, context: Context) -> None:
        super().__init__(config, context=context)
        self.jobs: dict[str, _Job] = {}

    def observe(self, event: Any, now: float) -> Iterable[events.Event]:
        job = self.jobs.get(event.job)
        if job is None:
            job = self.jobs[event.job] = _Job()
        job.last_seen = now
        rank = job.ranks.get(event.rank)
        if rank is None:
            rank = job.ranks[event.rank] = _Rank(event.node, deque(maxlen=self.config.window_steps))
        elif rank.node != event.node:
            # The rank moved to another machine (a migration): its history was the
            # old machine's, and so is its flag.
            yield from self._unflag(event.job, job, event.rank, now, "rank moved away")
            rank.node = event.node
            rank.window.clear()
        for s in event.steps:
            if s.step <= job.frontier:
                continue  # already scored without it
            job.pending.setdefault(s.step, {})[event.rank] = s.step_s - s.allreduce_s
            rank.last_step = max(rank.last_step, s.step)
            job.max_step = max(job.max_step, s.step)

    def tick(self, now: float) -> Iterable[events.Event]:
        for name in [
            n for n, j in self.jobs.items() if now - j.last_seen > self.config.forget_after_s
        ]:
            del self.jobs[name]
        for name, job in self.jobs.items():
            yield from self._advance(name, job, now)

    def _advance(self, name: str, job: _Job, now: float) -> Iterator[events.Event]:
        cfg = self.config
        live = [
            r.last_step
            for r in job.ranks.values()
            if r.last_step >= job.max_step - cfg.stall_lag_steps
        ]
        if not live:
            return
        ready = min(live)
        # Bound memory: steps that can no longer complete are scored with what came.
        ready = max(ready, job.max_step - cfg.max_pending_steps)
        touched: set[int] = set()
        for step in sorted(s for s in job.pending if s <= ready):
            values = job.pending.pop(step)
            if len(values) >= cfg.min_ranks:
                median = statistics.median(values.values())
                if median > 0:
                    for r, busy in values.items():
                        job.ranks[r].window.append((step, busy / median))
                        touched.add(r)
            job.frontier = max(job.frontier, step)
        for r in touched:
            yield from self._judge(name, job, r, now)

    def _judge(self, name: str, job: _Job, r: int, now: float) -> Iterator[events.Event]:
        cfg = self.config
        rank = job.ranks[r]
        if len(rank.window) < cfg.window_steps:
            return  # too little history (a rank that joined late)
        last = rank.window[-1][1]
        level = 1 + cfg.min_slowdown / 2
        if not rank.flagged and last <= level:
            return  # the common case: a healthy step of a healthy rank, O(1)
        s = score(rank.window, cfg)
        node = rank.node
        flagged = job.flagged_nodes.setdefault(node, set())
        if (
            not rank.flagged
            and s.slowdown >= cfg.min_slowdown
            and s.confidence >= cfg.min_confidence
        ):
            rank.flagged, rank.worst = True, s
            first = not flagged
            flagged.add(r)
            if first:
                yield events.StragglerFound(
                    ts=now,
                    job=name,
                    node=node,
                    slowdown=round(s.run_slowdown, 4),
                    confidence=round(s.confidence, 3),
                    since_step=s.since_step,
                    detail=f"rank {r}: busy {s.run_slowdown:+.1%} vs the median rank "
                    f"since step {s.since_step}",
                )
        elif rank.flagged and s.slowdown < cfg.clear_slowdown:
            yield from self._unflag(name, job, r, now, f"busy back to {s.slowdown:+.1%}")

    def _unflag(self, name: str, job: _Job, r: int, now: float, why: str) -> Iterator[events.Event]:
        rank = job.ranks[r]
        if not rank.flagged:
            return
        rank.flagged = False
        flagged = job.flagged_nodes.get(rank.node, set())
        flagged.discard(r)
        if not flagged:
            job.flagged_nodes.pop(rank.node, None)
            yield events.StragglerCleared(
                ts=now, job=name, node=rank.node, detail=f"rank {r}: {why}"
            )
