"""``straggler``: find the machine that is persistently slower than its peers.

In data-parallel training every rank waits for the slowest in the gradient
all-reduce, so step times are alike everywhere; the slow machine shows in its *busy*
time (compute + optimizer + data = step time minus all-reduce wait). For every step
that all live ranks of a job have reported, each rank's busy time is divided by the
median over ranks for that step. Dividing by the same step's median cancels whatever
hits the whole job (a slower phase, an evaluation pause on every rank); a robust mean
over a window of recent ratios ignores single slow steps (a checkpoint on rank 0, a
GC pause, noise). A rank is a straggler when the interquartile mean of its last
``window_steps`` ratios exceeds ``1 + min_slowdown`` and most of the window agrees
(``min_confidence``, as NVIDIA resiliency-ext's 0.75 score threshold); it clears when
that mean falls below ``1 + clear_slowdown``. Findings are per node (a machine is
what gets replaced), carrying the worst rank's slowdown.

The detector reads the cluster view's per-rank step rings on each tick instead of
observing every telemetry message: ingest already puts each step into the view once,
and scanning it once a second costs less than a second pass per message. Scoring is
the pure function ``score``. Ranks that fall more than ``stall_lag_steps`` behind do
not hold the others back (``rank_stalled`` reports them).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

from tmd.daemon import events
from tmd.daemon.view import JobView
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

    def validate(self) -> None:
        key = "detectors.straggler."
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


@dataclass(frozen=True)
class Score:
    slowdown: float  # interquartile mean of the window's ratios - 1: what decides
    confidence: float  # share of the window above 1 + min_slowdown / 2
    since_step: int  # first step of the current run above that level
    run_slowdown: float  # the same mean over that run alone: what is reported


def interquartile_mean(values: list[float]) -> float:
    """Mean of the middle half: as robust to spikes as the median, and with about 20%
    less spread on noisy steps, so the same window tells a 10% straggler from noise
    sooner."""
    ordered = sorted(values)
    k = len(ordered) // 4
    middle = ordered[k : len(ordered) - k]
    return sum(middle) / len(middle)


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
    # At first detection part of the window predates the onset and pulls the mean
    # down; the run since the onset says better how slow the machine is now.
    recent = ratios[-run:] if run >= 4 else ratios
    return Score(
        slowdown=interquartile_mean(ratios) - 1 if ratios else 0.0,
        confidence=sum(above) / len(ratios) if ratios else 0.0,
        since_step=since,
        run_slowdown=interquartile_mean(recent) - 1 if recent else 0.0,
    )


@dataclass
class _Rank:
    node: str
    window: deque[tuple[int, float]]
    flagged: bool = False


@dataclass
class _Job:
    ranks: dict[int, _Rank] = field(default_factory=dict)
    frontier: int = -1  # every step up to here has been scored
    flagged_nodes: dict[str, set[int]] = field(default_factory=dict)


class StragglerDetector(Detector):
    name = "straggler"
    Config = StragglerConfig
    tick_interval = timedelta(seconds=1)
    config: StragglerConfig

    def __init__(self, config: StragglerConfig, *, context: Context) -> None:
        super().__init__(config, context=context)
        self.jobs: dict[str, _Job] = {}

    def tick(self, now: float) -> Iterable[events.Event]:
        view_jobs = self.context.view.jobs
        for name in [n for n in self.jobs if n not in view_jobs]:
            del self.jobs[name]  # the view forgot it
        for name, vjob in view_jobs.items():
            job = self.jobs.get(name)
            if job is None:
                job = self.jobs[name] = _Job()
            yield from self._advance(name, vjob, job, now)

    def _advance(self, name: str, vjob: JobView, job: _Job, now: float) -> Iterator[events.Event]:
        cfg = self.config
        ranks = vjob.ranks
        if not ranks:
            return
        yield from self._follow_moves(name, vjob, job, now)
        front = max(r.last_step for r in ranks.values())
        ready = min(
            r.last_step for r in ranks.values() if r.last_step >= front - cfg.stall_lag_steps
        )
        # The rings hold the last `window` steps of each rank; older ones are gone.
        oldest = front - min(r.window for r in ranks.values()) + 1
        touched: set[int] = set()
        for step in range(max(job.frontier + 1, oldest), ready + 1):
            values = {}
            for r, state in ranks.items():
                busy = state.busy_at(step)
                if busy is not None:
                    values[r] = busy
            if len(values) >= cfg.min_ranks:
                median = statistics.median(values.values())
                if median > 0:
                    for r, busy in values.items():
                        track = job.ranks.get(r)
                        if track is None:
                            track = job.ranks[r] = _Rank(
                                ranks[r].node, deque(maxlen=cfg.window_steps)
                            )
                        track.window.append((step, busy / median))
                        touched.add(r)
        job.frontier = max(job.frontier, ready)
        for r in touched:
            yield from self._judge(name, job, r, now)

    def _follow_moves(
        self, name: str, vjob: JobView, job: _Job, now: float
    ) -> Iterator[events.Event]:
        """A rank now on another machine (a migration): its history and its flag were
        the old machine's."""
        for r, track in job.ranks.items():
            state = vjob.ranks.get(r)
            if state is not None and state.node != track.node:
                yield from self._unflag(name, job, r, now, "rank moved away")
                track.node = state.node
                track.window.clear()

    def _judge(self, name: str, job: _Job, r: int, now: float) -> Iterator[events.Event]:
        cfg = self.config
        rank = job.ranks[r]
        if len(rank.window) < cfg.window_steps:
            return  # too little history (a rank that joined late)
        if not rank.flagged and rank.window[-1][1] <= 1 + cfg.min_slowdown / 2:
            return  # the common case: a healthy step of a healthy rank, O(1)
        s = score(rank.window, cfg)
        if (
            not rank.flagged
            and s.slowdown >= cfg.min_slowdown
            and s.confidence >= cfg.min_confidence
        ):
            rank.flagged = True
            flagged = job.flagged_nodes.setdefault(rank.node, set())
            first = not flagged
            flagged.add(r)
            if first:
                yield events.StragglerFound(
                    ts=now,
                    job=name,
                    node=rank.node,
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
