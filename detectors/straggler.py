"""``straggler``: find the machine that is persistently slower than its peers.

In data-parallel training every rank waits for the slowest in the gradient
all-reduce, so step times are alike everywhere; the slow machine shows in its *busy*
time (compute + optimizer + data = step time minus all-reduce wait). For every step
that all live ranks of a job have reported, each rank's busy time is compared with
the median rank's *at the same step*, as ``log(busy / median)``. Dividing by the same
step's median cancels whatever hits the whole job (a slower phase, a slow drift of
the whole job, an evaluation pause on every rank).

Two kinds of unit are judged, both against their peers: every rank, and every
machine through the mean of its ranks' values (a machine is what gets replaced, and
averaging its ranks removes most of their independent noise, so a whole machine 10%
slow stands out where one rank 10% slow cannot). A unit's *level* is the
interquartile mean of its last ``window_steps`` values, which ignores single slow
steps (a checkpoint on rank 0, a GC pause). A unit is a straggler when its level is
above the peers' median level by at least ``min_slowdown`` *and* ``min_zscore``
robust spreads of the peers' levels (1.4826 x their median absolute deviation, which
the stragglers among them do not inflate), ``min_confidence`` of its window agrees
(is above half that; NVIDIA resiliency-ext scores with 0.75 the same way), and both
have held for ``persist_steps`` steps at the threshold, less the farther above it
(none at twice the threshold, which no drift reaches: such a unit is reported once
3/4 of its window shows it, a burst of 12 steps included). So in a quiet job the
threshold is near ``min_slowdown``, and in a job whose ranks drift by 5% for dozens
of steps at a time only what stands out from that drift is flagged. One estimate of
the spread comes from the units' current excursions, which a slow drift keeps for
dozens of steps, so the spread used is the median of the estimates over the last few
hundred steps; a machine's is at least its ranks' over the square root of its rank
count, so a job of few machines does not take its noise from too few of them. A unit
clears once its level has stayed below the clear level (the threshold scaled by
``clear_slowdown / min_slowdown``) for ``clear_steps`` (64) steps, so a slowdown
that comes and goes, calm for longer than a window between slow stretches, is one
finding, kept.

That *level* path needs a window and persistence, about 20 to 30 steps for a sudden
10% machine. The *change* path finds a sudden slowdown within a few steps: each machine's
median over its last ``change_steps`` steps (its per-step value the median of its
ranks', so one rank's spike does not move it) less its own median over the
``change_base_steps`` before them, against the same change of its peers at the same
step. A machine's static speed and slow drift cancel in its own change, so only a
change larger than the peers' changes stands out: by ``change_zscore`` of their
robust spreads (pooled over ``CHANGE_POOL`` steps, and only once that many are in)
and ``min_slowdown``, ``change_persist_steps`` steps in a row. Ranks get the same
test against the other ranks, with a higher bar (``rank_change_zscore``). What was
slow from the start (a machine that joins slow) or creeps up (a ramp) has no sudden
change: the level path finds it. Whichever fires first reports.

Findings are per node, carrying the slowdown of the unit that found it. The detector
reads the cluster view's per-rank step rings on each tick instead of observing every
telemetry message: ingest already puts each step into the view once. Scoring is the
pure functions ``thresholds`` and ``score``. Ranks that fall more than
``stall_lag_steps`` behind do not hold the others back (``rank_stalled`` reports them).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

from tmd.daemon import events
from tmd.daemon.view import JobView
from tmd.detectors.base import Detector
from tmd.errors import ConfigError
from tmd.plugins import Context

MAD_TO_SIGMA = 1.4826  # the median absolute deviation of a normal sample, in sigmas
SPREAD_EVERY = 8  # steps between two estimates of the peers' spread ...
SPREAD_POOL = 32  # ... and how many recent estimates its median pools (256 steps)
CHANGE_POOL = 64  # steps of the machines' change spread the change path pools
CHANGE_OFF = 100.0  # a change z-score this high turns that change path off (not computed)


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    min_slowdown: float = 0.08  # flag at 8% slower than the median rank, at the least
    clear_slowdown: float = 0.03
    window_steps: int = 16
    min_confidence: float = 0.75
    min_ranks: int = 3  # fewer ranks reporting a step: nothing to compare against
    stall_lag_steps: int = 64
    min_zscore: float = 5.0  # ... and this many robust spreads of the peers' levels
    persist_steps: int = 12  # ... for this many steps in a row
    # The change path: a machine whose last ``change_steps`` steps stand above its own
    # ``change_base_steps`` before them by ``change_zscore`` robust spreads of its
    # peers' changes (and ``min_slowdown``), ``change_persist_steps`` steps in a row.
    change_steps: int = 4
    change_base_steps: int = 32
    change_zscore: float = 6.0
    change_persist_steps: int = 3
    # ... and a rank, one GPU, against the other ranks: noisier, so a higher bar.
    rank_change_zscore: float = 8.0
    rank_change_persist_steps: int = 5
    clear_steps: int = 64  # a flagged unit clears once calm this long (>= window_steps)

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
        if not 0 <= self.min_zscore <= 100:
            raise ConfigError(key + "min_zscore", "must be in [0, 100]")
        if not 0 <= self.persist_steps <= 4096:
            raise ConfigError(key + "persist_steps", "must be in 0..4096")
        if not 1 <= self.change_steps <= 256:
            raise ConfigError(key + "change_steps", "must be in 1..256")
        if not 4 <= self.change_base_steps <= 1024:
            raise ConfigError(key + "change_base_steps", "must be in 4..1024")
        if not 0 < self.change_zscore <= 100:
            raise ConfigError(key + "change_zscore", "must be in (0, 100] (100: off)")
        if not 1 <= self.change_persist_steps <= 4096:
            raise ConfigError(key + "change_persist_steps", "must be in 1..4096")
        if not 0 < self.rank_change_zscore <= 100:
            raise ConfigError(key + "rank_change_zscore", "must be in (0, 100] (100: off)")
        if not 1 <= self.rank_change_persist_steps <= 4096:
            raise ConfigError(key + "rank_change_persist_steps", "must be in 1..4096")
        if not self.window_steps <= self.clear_steps <= 65536:
            raise ConfigError(key + "clear_steps", "must be in window_steps..65536")


@dataclass(frozen=True)
class Threshold:
    """Where the peers are (``center``, a log busy ratio) and how far above it a unit
    must be to straggle (``flag``) or to be calm again (``clear``), in log units."""

    center: float
    flag: float
    clear: float


@dataclass(frozen=True)
class Score:
    level: float  # interquartile mean of the window less the peers' center: what decides
    confidence: float  # share of the window above the center + half the threshold
    since_step: int  # first step of the current run above that
    run_level: float  # the same mean over that run alone: what is reported

    @property
    def slowdown(self) -> float:
        return math.expm1(self.level)

    @property
    def run_slowdown(self) -> float:
        return math.expm1(self.run_level)


def interquartile_mean(values: list[float]) -> float:
    """Mean of the middle half: as robust to spikes as the median, and with about 20%
    less spread on noisy steps, so the same window tells a 10% straggler from noise
    sooner."""
    ordered = sorted(values)
    k = len(ordered) // 4
    middle = ordered[k : len(ordered) - k]
    return sum(middle) / len(middle)


# Croux and Rousseeuw's small-sample factors for the MAD (1992; R's robustbase uses
# them): from few values it is biased low, by a third with three.
_MAD_SMALL_N = {2: 1.196, 3: 1.495, 4: 1.363, 5: 1.206, 6: 1.200, 7: 1.140, 8: 1.129, 9: 1.107}


def _sorted_median(ordered: list[float]) -> float:
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def robust_spread(values: list[float]) -> float:
    """Standard deviation estimated as 1.4826 x the median absolute deviation, with the
    small-sample correction: the stragglers among the values do not inflate it, and a
    job of three machines does not take its noise for a third of what it is."""
    n = len(values)
    if n < 2:
        return 0.0
    center = statistics.median(values)
    small = _MAD_SMALL_N.get(n, n / (n - 0.8))
    return small * MAD_TO_SIGMA * statistics.median(abs(v - center) for v in values)


def thresholds(levels: list[float], spread: float, config: StragglerConfig) -> Threshold:
    """The threshold for units whose peers' levels are ``levels`` and whose noise is
    ``spread`` (a standard deviation of levels, in log units)."""
    center = statistics.median(levels) if levels else 0.0
    flag = max(math.log1p(config.min_slowdown), config.min_zscore * spread)
    clear = flag * math.log1p(config.clear_slowdown) / math.log1p(config.min_slowdown)
    return Threshold(center, flag, clear)


def score(window: Iterable[tuple[int, float]], threshold: Threshold) -> Score:
    """Score one unit from its recent ``(step, log(busy / median busy))`` pairs, oldest
    first."""
    pairs = list(window)
    values = [v - threshold.center for _, v in pairs]
    level = threshold.flag / 2
    above = [v > level for v in values]
    since = pairs[-1][0] if pairs else 0
    run = 0
    for (step, _), hot in zip(reversed(pairs), reversed(above), strict=True):
        if not hot:
            break
        since, run = step, run + 1
    # At first detection part of the window predates the onset and pulls the mean
    # down; the run since the onset says better how slow the unit is now.
    recent = values[-run:] if run >= 4 else values
    return Score(
        level=interquartile_mean(values) if values else 0.0,
        confidence=sum(above) / len(values) if values else 0.0,
        since_step=since,
        run_level=interquartile_mean(recent) if recent else 0.0,
    )


Key = int | str  # a rank, or a machine by its node name
K = TypeVar("K", int, str)


@dataclass
class _Unit:
    """A rank, or a machine (the mean of its ranks): what is compared with its peers."""

    node: str
    window: deque[tuple[int, float]]  # (step, log of busy over the step's median)
    members: tuple[int, ...] = ()  # a machine's ranks behind its values
    flagged: bool = False
    hot_since: int | None = None  # not flagged, and above the flag level since this step
    calm_since: int | None = None  # flagged, and below the clear level since this step
    # The change path (machines): each step's median over the machine's ranks, and how
    # many steps in a row its change stood out, with the last change (log units).
    steps: deque[tuple[int, float]] = field(default_factory=deque)
    before: list[float] = field(default_factory=list)  # the steps' older part, sorted
    changed_for: int = 0
    change: float = 0.0

    def push(self, step: int, value: float, recent: int) -> None:
        """Add a step to the change path's ring; ``before`` keeps the values older than
        the last ``recent`` sorted, so its median costs no sort per step."""
        steps = self.steps
        if steps.maxlen is not None and len(steps) == steps.maxlen:
            _, gone = steps[0]
            del self.before[bisect.bisect_left(self.before, gone)]
        steps.append((step, value))
        if len(steps) > recent:
            bisect.insort(self.before, steps[-recent - 1][1])

    def forget(self) -> None:
        self.steps.clear()
        self.before.clear()
        self.changed_for = 0


@dataclass
class _Job:
    ranks: dict[int, _Unit] = field(default_factory=dict)
    machines: dict[str, _Unit] = field(default_factory=dict)
    frontier: int = -1  # every step up to here has been scored
    flagged_nodes: dict[str, set[Key]] = field(default_factory=dict)
    rank_threshold: Threshold | None = None
    machine_threshold: Threshold | None = None
    spread_step: int = -1  # the step the thresholds were estimated at
    spreads: deque[tuple[float, float | None]] = field(  # (ranks', machines') estimates
        default_factory=lambda: deque(maxlen=SPREAD_POOL)
    )
    change_spreads: deque[float] = field(default_factory=lambda: deque(maxlen=CHANGE_POOL))
    rank_change_spreads: deque[float] = field(default_factory=lambda: deque(maxlen=CHANGE_POOL))


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
        touched: set[Key] = set()
        # A machine's ranks as the view places them, not as a step's reports happen to
        # show them: a lost telemetry message must not restart its history.
        placed: dict[str, list[int]] = {}
        for r, state in ranks.items():
            placed.setdefault(state.node, []).append(r)
        machines = {node: tuple(sorted(rs)) for node, rs in placed.items()}
        for step in range(max(job.frontier + 1, oldest), ready + 1):
            self._add_step(vjob, job, step, machines, touched)
        job.frontier = max(job.frontier, ready)
        stale = job.frontier - job.spread_step >= SPREAD_EVERY or job.rank_threshold is None
        if touched and stale:
            self._estimate(job)
        for key in touched:
            yield from self._judge(name, job, key, now)

    def _add_step(
        self,
        vjob: JobView,
        job: _Job,
        step: int,
        machines: dict[str, tuple[int, ...]],
        touched: set[Key],
    ) -> None:
        """Append every rank's and every machine's value for ``step``; a machine's is
        the mean over those of its ranks (``machines``) that reported the step."""
        cfg = self.config
        ranks_change = cfg.rank_change_zscore < CHANGE_OFF
        logs: dict[int, float] = {}
        for r, state in vjob.ranks.items():
            busy = state.busy_at(step)
            if busy is not None and busy > 0:
                logs[r] = math.log(busy)
        if len(logs) < cfg.min_ranks:
            return
        median = _sorted_median(sorted(logs.values()))
        by_node: dict[str, list[tuple[int, float]]] = {}
        for r, v in logs.items():
            unit = job.ranks.get(r)
            if unit is None:
                unit = job.ranks[r] = _Unit(vjob.ranks[r].node, deque(maxlen=cfg.window_steps))
                unit.steps = deque(maxlen=cfg.change_base_steps + cfg.change_steps)
            unit.window.append((step, v - median))
            if ranks_change:
                unit.push(step, v - median, cfg.change_steps)
            touched.add(r)
            by_node.setdefault(unit.node, []).append((r, v - median))
        if ranks_change:
            self._changes(job.ranks, job.rank_change_spreads, step, cfg.rank_change_zscore)
        if len(by_node) < cfg.min_ranks or all(len(m) == 1 for m in machines.values()):
            return  # too few machines to compare, or one rank each: the ranks say it all
        for node, values in by_node.items():
            unit = job.machines.get(node)
            if unit is None:
                unit = job.machines[node] = _Unit(node, deque(maxlen=cfg.window_steps))
                unit.steps = deque(maxlen=cfg.change_base_steps + cfg.change_steps)
            members = machines.get(node, ())
            if members != unit.members:
                # Other ranks placed on it: its history is another machine's.
                unit.window.clear()
                unit.forget()
                unit.members, unit.hot_since = members, None
            unit.window.append((step, sum(v for _, v in values) / len(values)))
            unit.push(step, _sorted_median(sorted(v for _, v in values)), cfg.change_steps)
            touched.add(node)
        if cfg.change_zscore < CHANGE_OFF:
            self._changes(job.machines, job.change_spreads, step, cfg.change_zscore)

    def _changes(
        self, units: Mapping[K, _Unit], spreads: deque[float], step: int, zscore: float
    ) -> None:
        """The change path, at ``step``: each machine's change, the median of its last
        ``change_steps`` per-step medians less the median of the ``change_base_steps``
        before them, against its peers' changes at the same step. A machine compared
        with its own recent past needs no level of its own to stand out from its peers'
        drift, only a change larger than theirs, so a sudden slowdown shows within a
        few steps; one slow rank's spike does not move its machine's median. The same
        for every rank against the other ranks (``units``: the job's machines or its
        ranks; ``spreads``: their pool of spreads)."""
        cfg = self.config
        need = cfg.change_base_steps + cfg.change_steps
        changes: dict[K, float] = {}
        for key, unit in units.items():
            steps = unit.steps
            if len(steps) < need or steps[-1][0] != step:
                unit.changed_for = 0
                continue
            recent = _sorted_median(sorted(steps[-i][1] for i in range(1, cfg.change_steps + 1)))
            changes[key] = recent - _sorted_median(unit.before)
        if len(changes) < cfg.min_ranks:
            return
        center = _sorted_median(sorted(changes.values()))
        spreads.append(robust_spread(list(changes.values())))
        if len(spreads) < CHANGE_POOL:
            return  # the peers' changes are not known well enough yet
        bar = max(math.log1p(cfg.min_slowdown), zscore * statistics.median(spreads))
        for key, change in changes.items():
            unit = units[key]
            above = change - center
            unit.changed_for = unit.changed_for + 1 if above > bar else 0
            unit.change = above

    def _estimate(self, job: _Job) -> None:
        """Thresholds from the peers' current levels and their spread, pooled over the
        recent estimates: one estimate comes from the units' current excursions, and
        ranks that drift slowly keep them for dozens of steps."""
        cfg = self.config
        full = [u for u in job.ranks.values() if len(u.window) == cfg.window_steps]
        levels = [interquartile_mean([v for _, v in u.window]) for u in full]
        if len(levels) < cfg.min_ranks:
            return  # too few to tell what the peers' noise is: wait for more history
        machines = [u for u in job.machines.values() if len(u.window) == cfg.window_steps]
        m_levels = [interquartile_mean([v for _, v in u.window]) for u in machines]
        enough = len(m_levels) >= cfg.min_ranks
        job.spreads.append((robust_spread(levels), robust_spread(m_levels) if enough else None))
        spread = statistics.median(r for r, _ in job.spreads)
        job.rank_threshold = thresholds(levels, spread, cfg)
        if enough:
            per_machine = sum(len(u.members) for u in machines) / len(machines)
            m_spread = statistics.median(m for _, m in job.spreads if m is not None)
            m_spread = max(m_spread, spread / math.sqrt(per_machine))
            job.machine_threshold = thresholds(m_levels, m_spread, cfg)
        job.spread_step = job.frontier

    def _follow_moves(
        self, name: str, vjob: JobView, job: _Job, now: float
    ) -> Iterator[events.Event]:
        """A rank now on another machine (a migration): its history and its flag were
        the old machine's, and so was the old machine's mean."""
        for r, unit in job.ranks.items():
            state = vjob.ranks.get(r)
            if state is not None and state.node != unit.node:
                yield from self._unflag(name, job, r, unit, now, "rank moved away")
                old = job.machines.pop(unit.node, None)
                if old is not None:
                    yield from self._unflag(name, job, unit.node, old, now, f"rank {r} moved away")
                unit.node = state.node
                unit.window.clear()
                unit.forget()
                unit.hot_since = None

    def _unit(self, job: _Job, key: Key) -> _Unit:
        return job.ranks[key] if isinstance(key, int) else job.machines[key]

    def _judge(self, name: str, job: _Job, key: Key, now: float) -> Iterator[events.Event]:
        cfg = self.config
        unit = self._unit(job, key)
        persist = (cfg.rank_change_persist_steps if isinstance(key, int)
                   else cfg.change_persist_steps)  # fmt: skip
        if not unit.flagged and unit.changed_for >= persist:
            what = f"rank {key}" if isinstance(key, int) else "its ranks' median"
            # Many steps may have come in one tick: the run can be longer than the ring.
            since = unit.steps[-min(unit.changed_for, len(unit.steps))][0]
            yield from self._flag(name, job, key, unit, now, slowdown=math.expm1(unit.change),
                                  confidence=1.0, since=since,
                                  detail=f"{what}: busy {math.expm1(unit.change):+.1%} over "
                                  f"its own last {cfg.change_base_steps} steps, against its "
                                  "peers, from a sudden change")  # fmt: skip
            return
        th = job.rank_threshold if isinstance(key, int) else job.machine_threshold
        if th is None or len(unit.window) < cfg.window_steps:
            return  # too little history (a rank that joined late)
        quiet = unit.window[-1][1] - th.center <= th.flag / 2
        if quiet and not unit.flagged and unit.hot_since is None:
            return  # the common case: a healthy step of a healthy unit, O(1)
        s = score(unit.window, th)
        last = unit.window[-1][0]
        if not unit.flagged:
            if s.level < th.flag or s.confidence < cfg.min_confidence:
                unit.hot_since = None
                return
            if unit.hot_since is None:
                unit.hot_since = last
            # The farther above the threshold, the rarer a drift that goes there: the
            # wait falls from persist_steps at the threshold to none at twice it.
            wait = cfg.persist_steps * max(0.0, 2.0 - s.level / th.flag)
            if last - unit.hot_since < wait:
                return
            what = f"rank {key}" if isinstance(key, int) else "its ranks' mean"
            yield from self._flag(name, job, key, unit, now, slowdown=s.run_slowdown,
                                  confidence=s.confidence, since=s.since_step,
                                  detail=f"{what}: busy {s.run_slowdown:+.1%} vs the median "
                                  f"since step {s.since_step} (threshold "
                                  f"{math.expm1(th.flag):+.1%})")  # fmt: skip
        else:
            if s.level >= th.clear:
                unit.calm_since = None
            elif unit.calm_since is None:
                unit.calm_since = last
            elif last - unit.calm_since >= cfg.clear_steps:
                why = f"busy back to {s.slowdown:+.1%}"
                yield from self._unflag(name, job, key, unit, now, why)

    def _flag(
        self, name: str, job: _Job, key: Key, unit: _Unit, now: float, *,
        slowdown: float, confidence: float, since: int, detail: str,
    ) -> Iterator[events.Event]:  # fmt: skip
        unit.flagged, unit.hot_since, unit.calm_since = True, None, None
        flagged = job.flagged_nodes.setdefault(unit.node, set())
        first = not flagged
        flagged.add(key)
        if first:
            yield events.StragglerFound(
                ts=now, job=name, node=unit.node, slowdown=round(slowdown, 4),
                confidence=round(confidence, 3), since_step=since, detail=detail,
            )  # fmt: skip

    def _unflag(
        self, name: str, job: _Job, key: Key, unit: _Unit, now: float, why: str
    ) -> Iterator[events.Event]:
        if not unit.flagged:
            return
        unit.flagged, unit.calm_since = False, None
        flagged = job.flagged_nodes.get(unit.node, set())
        flagged.discard(key)
        if not flagged:
            job.flagged_nodes.pop(unit.node, None)
            what = f"rank {key}" if isinstance(key, int) else "its ranks' mean"
            yield events.StragglerCleared(ts=now, job=name, node=unit.node, detail=f"{what}: {why}")
