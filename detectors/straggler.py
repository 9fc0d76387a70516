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
reads the cluster view on each tick instead of observing every telemetry message:
ingest already puts each step into the view once, as a row of the job's step columns
(``JobView.cols``: a column per rank, a row per step). Each new step is read as
vectors over those columns: every rank's busy time (``step_s - allreduce_s``, as
``RankState.busy_at`` takes it), its log, their median, each rank's value, and each
machine's mean and median of its ranks' values (group reductions through a
rank-to-machine index). A unit's recent values are a row of ring matrices
(``_Units``), so a step is appended to every unit by a few numpy calls, the change
path's medians and the levels are sorts along rows, and the quiet units are judged by
one mask. Per tick, Python reads each rank's node and last step (which no column
holds), and otherwise looks only at the units that are flagged, hot or near the
threshold, and at every rank only on a tick where some joined, left or moved. Scoring
is the pure functions ``thresholds`` and ``score``. Ranks that fall more than
``stall_lag_steps`` behind do not hold the others back (``rank_stalled`` reports them).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final, TypeVar, cast

import numpy as np
import numpy.typing as npt

from tmd.daemon import events
from tmd.daemon.ranks import RankState
from tmd.daemon.view import JobView
from tmd.detectors.base import Detector
from tmd.errors import ConfigError
from tmd.plugins import Context

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Mask = npt.NDArray[np.bool_]

MAD_TO_SIGMA = 1.4826  # the median absolute deviation of a normal sample, in sigmas
SPREAD_EVERY = 8  # steps between two estimates of the peers' spread ...
SPREAD_POOL = 32  # ... and how many recent estimates its median pools (256 steps)
CHANGE_POOL = 64  # steps of the machines' change spread the change path pools
CHANGE_OFF = 100.0  # a change z-score this high turns that change path off (not computed)
_NO_STEP: Final = -(1 << 63)  # hot_since, calm_since: not hot, not calm
# A step's durations in ``JobView.cols.timings``, in ``tmd.daemon.columns.TIMING_FIELDS``
# order (a detector reads the view, not that module): busy = step_s - allreduce_s.
_STEP_S: Final = 0
_ALLREDUCE_S: Final = 2
# A unit above half the threshold whose level, computed with the others at once, is
# this far below the threshold stays quiet; nearer, ``score`` decides, as for one unit.
_LEVEL_SLACK: Final = 1e-9


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


def _median(values: F64) -> float:
    """``np.median`` of a vector (the middle value, or the mean of the middle two),
    with one partition instead of its two."""
    half = values.size // 2
    part = np.partition(values, half)
    if values.size % 2:
        return float(part[half])
    return float((part[:half].max() + part[half]) / 2)


def robust_spread(values: Sequence[float] | F64) -> float:
    """Standard deviation estimated as 1.4826 x the median absolute deviation, with the
    small-sample correction: the stragglers among the values do not inflate it, and a
    job of three machines does not take its noise for a third of what it is."""
    v = np.asarray(values, dtype=np.float64)
    n = v.size
    if n < 2:
        return 0.0
    small = _MAD_SMALL_N.get(n, n / (n - 0.8))
    return small * MAD_TO_SIGMA * _median(np.abs(v - _median(v)))


def thresholds(levels: Sequence[float] | F64, spread: float, config: StragglerConfig) -> Threshold:
    """The threshold for units whose peers' levels are ``levels`` and whose noise is
    ``spread`` (a standard deviation of levels, in log units)."""
    center = _median(np.asarray(levels, dtype=np.float64)) if len(levels) else 0.0
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
A = TypeVar("A", bound=npt.NDArray[Any])


@dataclass
class _Unit:
    """One unit's change path as plain Python, the way the detector kept it per unit
    before ``_Units`` (the unit tests still exercise it): the reference for what
    ``_Units`` keeps for all units at once, where ``recent`` and ``before`` are
    ``steps`` here split at the last ``recent`` values, and a row of ``before`` is
    sorted only when its median is taken."""

    node: str
    window: deque[tuple[int, float]]  # (step, log of busy over the step's median)
    steps: deque[tuple[int, float]] = field(default_factory=deque)
    before: list[float] = field(default_factory=list)  # the steps' older part, sorted
    changed_for: int = 0

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


def _grown(a: A, capacity: int, fill: float) -> A:
    shape = (capacity, *a.shape[1:])
    # Zeros from the allocator cost nothing until written: the rows of a job's
    # 131,072 ranks are some 50 MB, which a fill would touch at once.
    out = np.zeros(shape, a.dtype) if fill == 0 else np.full(shape, fill, a.dtype)
    out[: a.shape[0]] = a
    return cast(A, out)


Rows = I64 | slice  # some units by slot, ascending; or slice(0, n): all, without a gather


def _flat(a: A) -> A:
    """A view of ``a`` (C-contiguous) as one vector: ``a[rows, cols]`` as one index
    ``rows * width + cols`` costs about half."""
    return cast(A, a.reshape(-1))


def _same(values: I64) -> int | None:
    """The value all of ``values`` share, if they do."""
    if values.size and values[0] == values[-1] and (values == values[0]).all():
        return int(values[0])
    return None


class _Units:
    """A job's units of one kind, its ranks or its machines, a slot each (the arrays
    line up with ``keys``; a machine's slot is released once it has left the job). A
    unit's history is rows of ring matrices: entry ``i`` since its history (re)started
    sits in column ``i % width`` of its row, so a step is appended to every unit that
    has it by one scatter per ring (one column, where all are as far along), and what
    the judging reads (the last value, a level, the change path's medians) is a
    reduction along rows. Rings are by entry, not by step: a unit that missed a step
    (a lost message) keeps its last ``window`` values, as a deque would."""

    def __init__(self, config: StragglerConfig, *, change: bool) -> None:
        self.window = config.window_steps
        self.need = config.change_steps + config.change_base_steps  # entries to judge a change
        self.span = max(self.window, self.need)  # entries whose step is kept
        self.change_on = change
        self.keys: list[Key] = []
        self.slot: dict[Key, int] = {}
        self.node: list[str] = []
        self.members: list[tuple[int, ...]] = []  # a machine's ranks behind its values
        self.n = 0
        self.free: list[int] = []  # slots released (``release``): the next ``add``s'
        self.births = 0  # units that have had a value
        widths = (config.change_steps, config.change_base_steps) if change else (0, 0)
        self.count: I64 = np.zeros(0, np.int64)  # entries since its history (re)started
        self.last: I64 = np.zeros(0, np.int64)  # the step of its last entry
        self.steps: I64 = np.zeros((0, self.span), np.int64)
        self.level: F64 = np.zeros((0, self.window))  # what the level path reads
        # The change path: its last ``change_steps`` entries, and the
        # ``change_base_steps`` before them (a ring each, so neither needs a gather).
        self.recent: F64 = np.zeros((0, widths[0]))
        self.before: F64 = np.zeros((0, widths[1]))
        self.changed_for: I64 = np.zeros(0, np.int64)
        self.change: F64 = np.zeros(0)
        self.flagged: Mask = np.zeros(0, np.bool_)
        self.hot_since: I64 = np.zeros(0, np.int64)  # not flagged, above the flag level since
        self.calm_since: I64 = np.zeros(0, np.int64)  # flagged, below the clear level since
        self.touched: Mask = np.zeros(0, np.bool_)  # got a value this tick
        self.born: I64 = np.zeros(0, np.int64)  # the order of first values (-1: none yet)
        self.sizes: I64 = np.zeros(0, np.int64)  # len(members)
        self.members_ok: Mask = np.zeros(0, np.bool_)  # members are where the view places
        # Where rows are sorted: reused, as a fresh one per step costs its page faults.
        self._scratch: F64 = np.zeros(0)

    def add(self, key: Key, node: str) -> int:
        if self.free:  # as ``forget`` left it: a new unit's state
            slot = self.free.pop()
            self.keys[slot], self.node[slot], self.members[slot] = key, node, ()
            self.slot[key] = slot
            return slot
        if self.n == self.count.shape[0]:
            self._grow(max(8, 2 * self.n))
        slot = self.n
        self.n += 1
        self.keys.append(key)
        self.slot[key] = slot
        self.node.append(node)
        self.members.append(())
        return slot

    def add_many(self, keys: list[Key], nodes: list[str]) -> None:
        """``add`` of each of ``keys`` (none held yet) on its node, in order: at once
        where no slot is free to reuse (a job's ranks seen for the first time)."""
        if self.free:
            for key, node in zip(keys, nodes, strict=True):
                self.add(key, node)
            return
        start, end = self.n, self.n + len(keys)
        self.reserve(end)
        self.keys.extend(keys)
        self.slot.update(zip(keys, range(start, end), strict=True))
        self.node.extend(nodes)
        self.members.extend([()] * len(keys))
        self.n = end

    def reserve(self, units: int) -> None:
        """Room for ``units`` in all, made now: a job's ranks seen for the first time
        take one allocation, not a copy at each doubling; and at least double what
        there was, so ranks that join a few a tick cost O(1) amortized, as ``add``."""
        capacity = self.count.shape[0]
        if units > capacity:
            self._grow(max(units, 2 * capacity))

    def _grow(self, capacity: int) -> None:
        self.count = _grown(self.count, capacity, 0)
        self.last = _grown(self.last, capacity, -1)
        self.steps = _grown(self.steps, capacity, -1)
        self.level = _grown(self.level, capacity, 0.0)
        self.recent = _grown(self.recent, capacity, 0.0)
        self.before = _grown(self.before, capacity, 0.0)
        self.changed_for = _grown(self.changed_for, capacity, 0)
        self.change = _grown(self.change, capacity, 0.0)
        self.flagged = _grown(self.flagged, capacity, False)
        self.hot_since = _grown(self.hot_since, capacity, _NO_STEP)
        self.calm_since = _grown(self.calm_since, capacity, _NO_STEP)
        self.touched = _grown(self.touched, capacity, False)
        self.born = _grown(self.born, capacity, -1)
        self.sizes = _grown(self.sizes, capacity, 0)
        self.members_ok = _grown(self.members_ok, capacity, False)

    def rows(self, slots: I64) -> Rows:
        """``slots`` (ascending) as an index."""
        return slice(0, self.n) if slots.size == self.n else slots

    def push(self, rows: Rows, step: int, values: F64, medians: F64 | None) -> None:
        """Append ``step`` to the units ``rows``: ``values`` to the level path's ring,
        ``medians`` (with the change path) to ``recent``, whose oldest moves on to
        ``before`` over the oldest there."""
        at = self.count[rows]
        k = _same(at)
        if k is None:  # some missed a step or started later: a column each
            if isinstance(rows, slice):
                rows = np.arange(self.n)
            self._push_at(rows, at, step, values, medians)
        else:  # all as far along: one column of each ring
            self.steps[rows, k % self.span] = step
            self.level[rows, k % self.window] = values
            if medians is not None:
                r, b = self.recent.shape[1], self.before.shape[1]
                if k >= r:
                    self.before[rows, (k - r) % b] = self.recent[rows, k % r]
                self.recent[rows, k % r] = medians
        self.count[rows] = at + 1
        self.last[rows] = step

    def _push_at(self, rows: I64, at: I64, step: int, values: F64, medians: F64 | None) -> None:
        _flat(self.steps)[rows * self.span + at % self.span] = step
        _flat(self.level)[rows * self.window + at % self.window] = values
        if medians is not None:
            r, b = self.recent.shape[1], self.before.shape[1]
            old = at >= r
            moving, k = rows[old], at[old]
            _flat(self.before)[moving * b + (k - r) % b] = _flat(self.recent)[moving * r + k % r]
            _flat(self.recent)[rows * r + at % r] = medians

    def last_values(self, rows: Rows) -> F64:
        """The level path's last value of the units ``rows`` (meaningless where none)."""
        at = self.count[rows] - 1
        k = _same(at)
        if k is not None:
            return self.level[rows, k % self.window]
        if isinstance(rows, slice):
            rows = np.arange(self.n)
        out: F64 = _flat(self.level)[rows * self.window + at % self.window]
        return out

    def sorted_rows(self, a: F64, rows: Rows) -> F64:
        """Rows ``rows`` of ``a``, each sorted: for all of them, in the scratch buffer
        (valid until the next call), where a fresh one would cost its page faults on
        every step."""
        if isinstance(rows, slice):
            size = self.n * a.shape[1]
            if self._scratch.size < size:
                self._scratch = np.empty(max(size, 2 * self._scratch.size))
            out = self._scratch[:size].reshape(self.n, a.shape[1])
            np.copyto(out, a[rows])
        else:
            out = a[rows]
        out.sort(axis=1)
        return out

    def restart(self, slot: int) -> None:
        """Its history is another's from here: drop it (not its flag)."""
        self.count[slot] = 0
        self.last[slot] = -1
        self.changed_for[slot] = 0
        self.hot_since[slot] = _NO_STEP

    def restart_all(self) -> None:
        """Every unit's history starts over (``restart`` each), and a flagged unit's
        calm count too, for its steps went back."""
        n = self.n
        self.count[:n] = 0
        self.last[:n] = -1
        self.changed_for[:n] = 0
        self.hot_since[:n] = _NO_STEP
        self.calm_since[:n] = _NO_STEP

    def forget(self, slot: int) -> None:
        """As if it had never been: the state of a new unit."""
        self.restart(slot)
        self.flagged[slot] = False
        self.calm_since[slot] = _NO_STEP
        self.change[slot] = 0.0
        self.members[slot] = ()
        self.sizes[slot] = 0
        self.members_ok[slot] = False

    def release(self, slot: int) -> None:
        """Its unit is gone for good (a machine none of the job's ranks are placed on,
        after a migration): forgotten, and its slot the next new unit's, so slots do
        not grow with every machine a long job has ever run on."""
        self.forget(slot)
        del self.slot[self.keys[slot]]
        self.born[slot] = -1
        self.free.append(slot)

    def window_of(self, slot: int) -> list[tuple[int, float]]:
        """Its last ``window`` entries as ``(step, value)``, oldest first."""
        count, w = int(self.count[slot]), self.window
        steps, level = self.steps[slot], self.level[slot]
        return [(int(steps[i % self.span]), float(level[i % w])) for i in range(count - w, count)]

    def step_back(self, slot: int, k: int) -> int:
        """The step of its ``k``-th last entry (``k`` <= ``need``)."""
        return int(self.steps[slot, (int(self.count[slot]) - k) % self.span])


def _row_medians(rows: F64) -> F64:
    """The median of each row: its middle value, or the mean of the middle two. Rows
    of four (``change_steps``' default) by comparisons, which cost less than a sort
    per row; ``sorted_rows`` passes rows already sorted."""
    width = rows.shape[1]
    if width == 4:
        a, b, c, d = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]
        # Neither the least nor the greatest of the four: the larger of the pairs'
        # minimums and the smaller of their maximums.
        inner = np.maximum(np.minimum(a, b), np.minimum(c, d))
        inner += np.minimum(np.maximum(a, b), np.maximum(c, d))
        out: F64 = inner / 2
        return out
    ordered = np.sort(rows, axis=1)
    return _sorted_row_medians(ordered)


def _sorted_row_medians(ordered: F64) -> F64:
    mid = ordered.shape[1] // 2
    if ordered.shape[1] % 2:
        return ordered[:, mid].copy()
    out: F64 = (ordered[:, mid - 1] + ordered[:, mid]) / 2
    return out


def _interquartile_means(ordered: F64) -> F64:
    """``interquartile_mean`` of each row of ``ordered`` (sorted rows), summed left to
    right as it sums."""
    k = ordered.shape[1] // 4
    middle = ordered[:, k : ordered.shape[1] - k]
    total = middle[:, 0].copy()
    for j in range(1, middle.shape[1]):
        total += middle[:, j]
    out: F64 = total / middle.shape[1]
    return out


def _group_medians(
    groups: I64, place: I64, values: F64, counts: I64, present: I64, width: int
) -> F64:
    """The median of ``values`` in each group of ``present`` (``groups``: each value's
    group, ``place``: its place among the group's members, at most ``width``;
    ``counts``: values per group), as ``_row_medians`` takes it."""
    k = counts[present]
    if counts.size * width <= 4 * values.size + 1024:
        # A row per group, padded past its values: one short sort per row.
        table = np.full((counts.size, width), np.inf)
        table[groups, place] = values
        table = np.sort(table[present], axis=1)
        rows = np.arange(present.size)
        low, high = table[rows, (k - 1) // 2], table[rows, k // 2]
    else:  # a few machines hold most ranks: sort by group, then by value
        ordered = values[np.lexsort((values, groups))]
        start = (np.cumsum(counts) - counts)[present]
        low, high = ordered[start + (k - 1) // 2], ordered[start + k // 2]
    out: F64 = (low + high) / 2
    return out


@dataclass
class _Job:
    ranks: _Units
    machines: _Units
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
    # The view's ranks as last seen (``_sync``), and what was derived from them: the
    # rank slot of each of the view's columns, each rank's machine and place on it.
    states: list[RankState] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    placed: dict[str, tuple[int, ...]] = field(default_factory=dict)  # node -> its ranks
    col_slot: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    state_cols: I64 = field(default_factory=lambda: np.zeros(0, np.int64))  # of ``states``
    in_order: bool = True  # col_slot ascending over the columns in use
    rank_machine: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    rank_place: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    width: int = 1  # the most ranks on one machine
    singletons: bool = True  # one rank per machine: the ranks say it all
    # The view's job and its count of the times the job went back (``JobView.rewinds``)
    # as last seen; the front when it did. Which of ``states`` are still of a timeline
    # the job left (their indexes), and so which are of the one it is on (None: all),
    # by rank and by column.
    vjob: JobView | None = None
    rewinds: int = 0
    went_back_at: int = -1
    behind: list[int] = field(default_factory=list)
    current: Mask | None = None
    col_ok: Mask | None = None


class StragglerDetector(Detector):
    name = "straggler"
    reads_ranks = True
    Config = StragglerConfig
    tick_interval = timedelta(seconds=1)
    config: StragglerConfig

    def __init__(self, config: StragglerConfig, *, context: Context) -> None:
        super().__init__(config, context=context)
        self.jobs: dict[str, _Job] = {}

    def tick(self, now: float) -> Iterable[events.Event]:
        cfg = self.config
        view_jobs = self.context.view.jobs
        for name in [n for n in self.jobs if n not in view_jobs]:
            del self.jobs[name]  # the view forgot it
        for name, vjob in view_jobs.items():
            job = self.jobs.get(name)
            if job is None:
                job = self.jobs[name] = _Job(
                    _Units(cfg, change=cfg.rank_change_zscore < CHANGE_OFF),
                    _Units(cfg, change=cfg.change_zscore < CHANGE_OFF),
                )
            yield from self._advance(name, vjob, job, now)

    def _advance(self, name: str, vjob: JobView, job: _Job, now: float) -> Iterator[events.Event]:
        cfg = self.config
        if not vjob.ranks or vjob.cols is None:
            return
        states = list(vjob.ranks.values())
        seen = job.states
        yield from self._sync(name, vjob, job, states, now)
        # A new run or a rollback, as the view counts them; or a job the view forgot and
        # took up again (its count starts over).
        went_back = vjob is not job.vjob or vjob.rewinds != job.rewinds
        if went_back or job.states is not seen:
            self._current(vjob, job, range(len(states)))
        elif job.behind:  # only they can have changed: a rank behind can only catch up
            self._current(vjob, job, job.behind)
        # Each rank's last step, from its column (``StepColumns.last_step``).
        steps = vjob.cols.last_step[job.state_cols]
        if job.current is not None:  # only the ranks on the job's timeline
            steps = steps[job.current]
            if not steps.size:
                return
        front = int(steps.max())
        # Or every rank far behind the steps already scored.
        if went_back or front + cfg.stall_lag_steps < job.frontier:
            self._went_back(job)
            job.vjob, job.rewinds, job.went_back_at = vjob, vjob.rewinds, front
        ready = int(steps[steps >= front - cfg.stall_lag_steps].min())
        if job.behind and front < job.went_back_at + cfg.stall_lag_steps:
            # Ranks not back on the new timeline yet are waited for, as a rank is until
            # it is that far behind: their first steps are scored with the others'.
            ready = job.frontier
        # The columns hold the last `window` steps of each rank; older ones are gone.
        oldest = front - vjob.cols.window + 1
        ranks, machines = job.ranks, job.machines
        ranks.touched[:] = False
        machines.touched[:] = False
        for step in range(max(job.frontier + 1, oldest), ready + 1):
            self._add_step(vjob, job, step)
        job.frontier = max(job.frontier, ready)
        stale = job.frontier - job.spread_step >= SPREAD_EVERY or job.rank_threshold is None
        if stale and ranks.touched.any():
            self._estimate(job)
        # Where a rank and its machine find the node in one tick, the first reports it:
        # the ranks by number, then the machines (mostly how a set of both iterated).
        yield from self._judge_all(name, job, ranks, job.rank_threshold, now)
        yield from self._judge_all(name, job, machines, job.machine_threshold, now)

    def _went_back(self, job: _Job) -> None:
        """The job went back (a new run from its checkpoint, or a rollback: the view
        counts it, ``JobView.rewinds``), or every rank is far behind the steps already
        scored. Each unit's history starts over, as its steps do, so the new steps are
        scored as they come and the hot and calm counts run from them; flags and
        thresholds stay (what was found stays found until its unit is seen calm, and
        the spread of the peers has not changed)."""
        for units in (job.ranks, job.machines):
            units.restart_all()
        job.frontier = -1
        job.spread_step = -1

    def _current(self, vjob: JobView, job: _Job, among: Iterable[int]) -> None:
        """Which ranks are still of a timeline the job left (``JobView.behind``), of
        ``among`` (indexes into ``job.states``; the others are not): one of an earlier
        run or generation holds the steps of that timeline (it has not reported since,
        or never will), whose numbers the new steps take again. O(ranks) only where
        the job went back or its ranks changed; else O(ranks behind)."""
        states = job.states
        behind = [i for i in among if vjob.behind(states[i])] if vjob.rewinds else []
        if among is job.behind and behind == job.behind:
            return  # none caught up
        job.behind = behind
        if not behind:
            job.current = job.col_ok = None
            return
        cols = vjob.cols
        assert cols is not None
        job.current = np.ones(len(states), np.bool_)
        job.current[behind] = False
        job.col_ok = np.ones(cols.n, np.bool_)
        job.col_ok[[states[i].col for i in behind]] = False

    def _sync(
        self, name: str, vjob: JobView, job: _Job, states: list[RankState], now: float
    ) -> Iterator[events.Event]:
        """Follow the view's ranks where they changed since the last tick: joined, left,
        or moved to another machine (``_moved``). Python over every rank then; a read of
        their nodes and two list comparisons on a tick where nothing changed."""
        nodes = [s.node for s in states]
        cols = vjob.cols
        assert cols is not None
        if states == job.states and nodes == job.nodes and job.col_slot.size == cols.n:
            return  # (the columns handed out are those mapped: none taken since)
        ranks = job.ranks
        moved: list[tuple[int, str]] = []
        joined: list[Key] = []
        joined_on: list[str] = []
        for state in states:
            slot = ranks.slot.get(state.rank)
            if slot is None:
                joined.append(state.rank)
                joined_on.append(state.node)
            elif ranks.node[slot] != state.node:
                if ranks.born[slot] >= 0:
                    moved.append((slot, state.node))
                else:  # no history yet: nothing was the old machine's
                    ranks.node[slot] = state.node
        ranks.add_many(joined, joined_on)
        # In the order the ranks' histories began.
        for slot, node in sorted(moved, key=lambda m: int(ranks.born[m[0]])):
            yield from self._moved(name, job, slot, node, now)
        # A machine's ranks as the view places them, not as a step's reports happen to
        # show them: a lost telemetry message must not restart its history.
        placed: dict[str, list[int]] = {}
        for state in states:
            placed.setdefault(state.node, []).append(state.rank)
        job.placed = {node: tuple(sorted(rs)) for node, rs in placed.items()}
        # A flagged rank the view no longer holds (the job went on without it), or a
        # flagged machine none of whose ranks it places: nothing of theirs is scored
        # again, so they would stay flagged, and found no more should they come back.
        held = {s.rank for s in states}
        for slot in np.flatnonzero(ranks.flagged[: ranks.n]).tolist():
            if ranks.keys[slot] not in held:
                yield from self._unflag(name, job, ranks, slot, now, "rank left the job")
        for slot in np.flatnonzero(ranks.count[: ranks.n]).tolist():
            if ranks.keys[slot] not in held:
                ranks.restart(slot)  # its last levels are not a peer's now (``_estimate``)
        machines = job.machines
        for slot in np.flatnonzero(machines.flagged[: machines.n]).tolist():
            if machines.node[slot] not in job.placed:
                yield from self._unflag(name, job, machines, slot, now, "its ranks left the job")
        job.width = max(len(rs) for rs in job.placed.values())
        job.singletons = job.width == 1
        if not job.singletons:  # else the machines are never judged: no slots for them
            self._place(job)
        job.col_slot = np.full(cols.n, -1, np.int64)
        on = job.state_cols = np.fromiter([s.col for s in states], np.int64, len(states))
        job.col_slot[on] = np.fromiter([ranks.slot[s.rank] for s in states], np.int64, on.size)
        used = job.col_slot[job.col_slot >= 0]
        job.in_order = bool((used[1:] > used[:-1]).all())
        job.states, job.nodes = states, nodes

    def _place(self, job: _Job) -> None:
        """Each rank's machine slot and place among its ranks, as ``job.placed`` has
        them, and which machines' histories are still of the ranks placed on them."""
        ranks, machines = job.ranks, job.machines
        for m, node in enumerate(machines.node):
            if node not in job.placed and machines.slot.get(node) == m:
                machines.release(m)  # (unflagged in ``_sync``: it was left)
        slots: list[int] = []
        machines.reserve(len(job.placed))
        for node in job.placed:
            slot = machines.slot.get(node)
            slots.append(machines.add(node, node) if slot is None else slot)
        sizes = np.fromiter(map(len, job.placed.values()), np.int64, len(slots))
        members = [ranks.slot[r] for rs in job.placed.values() for r in rs]
        job.rank_machine = np.zeros(ranks.n, np.int64)
        job.rank_place = np.zeros(ranks.n, np.int64)
        job.rank_machine[members] = np.repeat(slots, sizes)
        job.rank_place[members] = np.arange(len(members)) - np.repeat(
            np.cumsum(sizes) - sizes, sizes
        )
        for m, node in enumerate(machines.node):
            machines.members_ok[m] = machines.members[m] == job.placed.get(node, ())

    def _moved(
        self, name: str, job: _Job, slot: int, node: str, now: float
    ) -> Iterator[events.Event]:
        """A rank now on another machine (a migration): its history and its flag were
        the old machine's, and so was the old machine's mean."""
        ranks, machines = job.ranks, job.machines
        yield from self._unflag(name, job, ranks, slot, now, "rank moved away")
        old = machines.slot.get(ranks.node[slot])
        if old is not None:
            why = f"rank {ranks.keys[slot]} moved away"
            yield from self._unflag(name, job, machines, old, now, why)
            machines.forget(old)
        ranks.node[slot] = node
        ranks.restart(slot)

    def _add_step(self, vjob: JobView, job: _Job, step: int) -> None:
        """Append every rank's and every machine's value for ``step``; a machine's is
        the mean over those of its ranks (``job.placed``) that reported the step."""
        cfg = self.config
        cols = vjob.cols
        assert cols is not None
        row, n = step % cols.window, cols.n
        # As RankState.busy_at: the difference in float32, widened.
        timings = cols.timings
        busy = (timings[_STEP_S, row, :n] - timings[_ALLREDUCE_S, row, :n]).astype(np.float64)
        held = (cols.tags[row, :n] == step + 1) & (busy > 0)  # the step + 1 (``tags``)
        if job.col_ok is not None:  # not a rank still on the timeline the job left
            held &= job.col_ok[:n]
        at = np.flatnonzero(held)
        if at.size < cfg.min_ranks:
            return
        logs = np.log(busy if at.size == n else busy[at])
        values = logs - _median(logs)
        ranks = job.ranks
        slots = job.col_slot[at]
        if not job.in_order:  # a column given back and taken again: slots ascending
            order = np.argsort(slots)
            slots, values = slots[order], values[order]
        rows = ranks.rows(slots)
        if ranks.births < ranks.n:  # some have had no value yet
            new = slots[ranks.born[rows] < 0]
            ranks.born[new] = np.arange(ranks.births, ranks.births + new.size)
            ranks.births += new.size
        ranks.push(rows, step, values, values if ranks.change_on else None)
        ranks.touched[rows] = True
        if ranks.change_on:
            self._changes(ranks, job.rank_change_spreads, step, cfg.rank_change_zscore)
        if job.singletons:
            return  # one rank each: the ranks say it all
        machines = job.machines
        groups = job.rank_machine[rows]
        counts = np.bincount(groups, minlength=machines.n)
        present = np.flatnonzero(counts)
        if present.size < cfg.min_ranks:
            return  # too few machines to compare
        for m in present[~machines.members_ok[present]].tolist():
            # Other ranks placed on it: its history is another machine's.
            machines.restart(m)
            machines.members[m] = job.placed.get(machines.node[m], ())
            machines.sizes[m] = len(machines.members[m])
            machines.members_ok[m] = True
        means = np.bincount(groups, weights=values, minlength=machines.n)[present] / counts[present]
        medians = None
        if machines.change_on:  # the change path's per-step value: one rank's spike moves it not
            medians = _group_medians(
                groups, job.rank_place[rows], values, counts, present, job.width
            )
        m_rows = machines.rows(present)
        machines.push(m_rows, step, means, medians)
        machines.touched[m_rows] = True
        if machines.change_on:
            self._changes(machines, job.change_spreads, step, cfg.change_zscore)

    def _changes(self, units: _Units, spreads: deque[float], step: int, zscore: float) -> None:
        """The change path, at ``step``: each machine's change, the median of its last
        ``change_steps`` per-step medians less the median of the ``change_base_steps``
        before them, against its peers' changes at the same step. A machine compared
        with its own recent past needs no level of its own to stand out from its peers'
        drift, only a change larger than theirs, so a sudden slowdown shows within a
        few steps; one slow rank's spike does not move its machine's median. The same
        for every rank against the other ranks (``units``: the job's machines or its
        ranks; ``spreads``: their pool of spreads)."""
        cfg = self.config
        n = units.n
        judged = (units.count[:n] >= units.need) & (units.last[:n] == step)
        units.changed_for[:n][~judged] = 0
        idx = np.flatnonzero(judged)
        if idx.size < cfg.min_ranks:
            return
        rows = units.rows(idx)
        recent = _row_medians(units.recent[rows])
        changes = recent - _sorted_row_medians(units.sorted_rows(units.before, rows))
        center = _median(changes)
        spreads.append(robust_spread(changes))
        if len(spreads) < CHANGE_POOL:
            return  # the peers' changes are not known well enough yet
        bar = max(math.log1p(cfg.min_slowdown), zscore * statistics.median(spreads))
        above = changes - center
        units.changed_for[rows] = np.where(above > bar, units.changed_for[rows] + 1, 0)
        units.change[rows] = above

    def _estimate(self, job: _Job) -> None:
        """Thresholds from the peers' current levels and their spread, pooled over the
        recent estimates: one estimate comes from the units' current excursions, and
        ranks that drift slowly keep them for dozens of steps."""
        cfg = self.config
        ranks, machines = job.ranks, job.machines
        full = np.flatnonzero(ranks.count[: ranks.n] >= cfg.window_steps)
        if full.size < cfg.min_ranks:
            return  # too few to tell what the peers' noise is: wait for more history
        levels = _interquartile_means(ranks.sorted_rows(ranks.level, ranks.rows(full)))
        m_full = np.flatnonzero(machines.count[: machines.n] >= cfg.window_steps)
        m_rows = machines.rows(m_full)
        m_levels = _interquartile_means(machines.sorted_rows(machines.level, m_rows))
        enough = m_levels.size >= cfg.min_ranks
        job.spreads.append((robust_spread(levels), robust_spread(m_levels) if enough else None))
        spread = statistics.median(r for r, _ in job.spreads)
        job.rank_threshold = thresholds(levels, spread, cfg)
        if enough:
            per_machine = int(machines.sizes[m_rows].sum()) / m_full.size
            m_spread = statistics.median(m for _, m in job.spreads if m is not None)
            m_spread = max(m_spread, spread / math.sqrt(per_machine))
            job.machine_threshold = thresholds(m_levels, m_spread, cfg)
        job.spread_step = job.frontier

    def _judge_all(
        self, name: str, job: _Job, units: _Units, th: Threshold | None, now: float
    ) -> Iterator[events.Event]:
        """Judge the units that got a value this tick. The common case, a healthy step
        of a healthy unit (quiet: its last value within half the threshold, neither
        flagged nor hot), is settled by a mask; so is a unit above that whose level is
        still short of the threshold. ``_judge`` takes the rest, one by one."""
        cfg = self.config
        idx = np.flatnonzero(units.touched[: units.n])
        if idx.size == 0:
            return
        rows = units.rows(idx)
        persist = (
            cfg.change_persist_steps if units is job.machines else cfg.rank_change_persist_steps
        )
        flagged = units.flagged[rows]
        look = ~flagged & (units.changed_for[rows] >= persist)
        if th is not None:
            full = units.count[rows] >= cfg.window_steps
            busy = full & (flagged | (units.hot_since[rows] != _NO_STEP))
            above = units.last_values(rows) - th.center > th.flag / 2
            loud = full & ~busy & ~look & above
            look |= busy
            if loud.any():
                near = idx[loud]
                ordered = np.sort(units.level[near] - th.center, axis=1)
                level = _interquartile_means(ordered)
                look[np.flatnonzero(loud)[level >= th.flag - _LEVEL_SLACK]] = True
        for slot in sorted(idx[look].tolist(), key=units.keys.__getitem__):
            yield from self._judge(name, job, units, slot, th, now)

    def _judge(
        self, name: str, job: _Job, units: _Units, slot: int, th: Threshold | None, now: float
    ) -> Iterator[events.Event]:
        cfg = self.config
        key = units.keys[slot]
        persist = (cfg.rank_change_persist_steps if isinstance(key, int)
                   else cfg.change_persist_steps)  # fmt: skip
        changed_for = int(units.changed_for[slot])
        if not units.flagged[slot] and changed_for >= persist:
            what = f"rank {key}" if isinstance(key, int) else "its ranks' median"
            change = float(units.change[slot])
            # Many steps may have come in one tick: the run can be longer than the ring.
            since = units.step_back(slot, min(changed_for, int(units.count[slot]), units.need))
            yield from self._flag(name, job, units, slot, now, slowdown=math.expm1(change),
                                  confidence=1.0, since=since,
                                  detail=f"{what}: busy {math.expm1(change):+.1%} over "
                                  f"its own last {cfg.change_base_steps} steps, against its "
                                  "peers, from a sudden change")  # fmt: skip
            return
        if th is None or units.count[slot] < cfg.window_steps:
            return  # too little history (a rank that joined late)
        window = units.window_of(slot)
        flagged, hot_since = bool(units.flagged[slot]), int(units.hot_since[slot])
        quiet = window[-1][1] - th.center <= th.flag / 2
        if quiet and not flagged and hot_since == _NO_STEP:
            return  # the common case: a healthy step of a healthy unit
        s = score(window, th)
        last = window[-1][0]
        if not flagged:
            if s.level < th.flag or s.confidence < cfg.min_confidence:
                units.hot_since[slot] = _NO_STEP
                return
            if hot_since == _NO_STEP:
                hot_since = units.hot_since[slot] = last
            # The farther above the threshold, the rarer a drift that goes there: the
            # wait falls from persist_steps at the threshold to none at twice it.
            wait = cfg.persist_steps * max(0.0, 2.0 - s.level / th.flag)
            if last - hot_since < wait:
                return
            what = f"rank {key}" if isinstance(key, int) else "its ranks' mean"
            yield from self._flag(name, job, units, slot, now, slowdown=s.run_slowdown,
                                  confidence=s.confidence, since=s.since_step,
                                  detail=f"{what}: busy {s.run_slowdown:+.1%} vs the median "
                                  f"since step {s.since_step} (threshold "
                                  f"{math.expm1(th.flag):+.1%})")  # fmt: skip
        else:
            calm_since = int(units.calm_since[slot])
            if s.level >= th.clear:
                units.calm_since[slot] = _NO_STEP
            elif calm_since == _NO_STEP:
                units.calm_since[slot] = last
            elif last - calm_since >= cfg.clear_steps:
                why = f"busy back to {s.slowdown:+.1%}"
                yield from self._unflag(name, job, units, slot, now, why)

    def _flag(
        self, name: str, job: _Job, units: _Units, slot: int, now: float, *,
        slowdown: float, confidence: float, since: int, detail: str,
    ) -> Iterator[events.Event]:  # fmt: skip
        units.flagged[slot] = True
        units.hot_since[slot] = units.calm_since[slot] = _NO_STEP
        node = units.node[slot]
        flagged = job.flagged_nodes.setdefault(node, set())
        first = not flagged
        flagged.add(units.keys[slot])
        if first:
            yield events.StragglerFound(
                ts=now, job=name, node=node, slowdown=round(slowdown, 4),
                confidence=round(confidence, 3), since_step=since, detail=detail,
            )  # fmt: skip

    def _unflag(
        self, name: str, job: _Job, units: _Units, slot: int, now: float, why: str
    ) -> Iterator[events.Event]:
        if not units.flagged[slot]:
            return
        units.flagged[slot] = False
        units.calm_since[slot] = _NO_STEP
        node, key = units.node[slot], units.keys[slot]
        flagged = job.flagged_nodes.get(node, set())
        flagged.discard(key)
        if not flagged:
            job.flagged_nodes.pop(node, None)
            what = f"rank {key}" if isinstance(key, int) else "its ranks' mean"
            yield events.StragglerCleared(ts=now, job=name, node=node, detail=f"{what}: {why}")
