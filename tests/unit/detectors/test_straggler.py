"""straggler: table-tested on generated traces, replayed on simulated time."""

from __future__ import annotations

import math
import random
from typing import Any

import msgspec
import pytest

from tmd import wire
from tmd.clock import SystemClock
from tmd.daemon import events
from tmd.daemon.plugins import Context
from tmd.daemon.view import ClusterView
from tmd.detectors.straggler import (
    StragglerConfig,
    StragglerDetector,
    Threshold,
    interquartile_mean,
    robust_spread,
    score,
    thresholds,
)
from tmd.errors import ConfigError
from tmd.tools import traces
from tmd.tools.bench.detect import replay
from tmd.tools.traces import Slowdown

# A small quiet job: 4 machines of 4 ranks, no slow drift.
QUIET: dict[str, Any] = dict(ranks=16, ranks_per_node=4, steps=220, sigma=0.0)
# A job as hard as the bench's: 16 machines of 8 ranks drifting by 5% (rho 0.98).
DRIFTING: dict[str, Any] = dict(ranks=128, ranks_per_node=8, steps=260, sigma=0.05, rho=0.98)


def run(
    effects: traces.Effects, seed: int = 0, *, config: StragglerConfig | None = None, **shape: Any
) -> list[tuple[events.Event, int]]:
    shaped = traces.JobShape(**{**QUIET, **shape})
    trace = traces.generate("t", seed, shaped, effects)
    view = ClusterView()
    det = StragglerDetector(
        config or StragglerConfig(), context=Context(view=view, clock=SystemClock())
    )
    return replay(trace, [det], view).found


def found(out: list[tuple[events.Event, int]]) -> list[tuple[str, int]]:
    return [(e.node, s) for e, s in out if isinstance(e, events.StragglerFound)]


def kinds(out: list[tuple[events.Event, int]]) -> list[tuple[str, str]]:
    return [(type(e).__name__, e.node) for e, _ in out if isinstance(e, events.Finding)]


@pytest.mark.parametrize(
    "effects",
    [
        traces.Effects(),
        traces.Effects(job_slow=(50, 150, 1.5)),  # the whole job slows: nobody straggles
        traces.Effects(join={r: 100 for r in range(12, 16)}),  # a node joins late
        traces.Effects(slow=[Slowdown((5,), 60, None, 0.04)]),  # 4%: below the threshold
    ],
    ids=["clean", "job slowdown", "late join", "4 percent"],
)
def test_no_finding(effects: traces.Effects) -> None:
    for seed in range(3):
        assert found(run(effects, seed)) == []


@pytest.mark.parametrize(
    "effects",
    [traces.Effects(), traces.Effects(job_slow=(60, 160, 1.4))],
    ids=["clean", "job slowdown"],
)
def test_no_finding_when_every_rank_drifts_slowly(effects: traces.Effects) -> None:
    """Ranks wandering by 5% for ~50 steps at a time (and the job by 10%) are not
    stragglers: the threshold follows the peers' spread, not a fixed 8%."""
    for seed in range(2):
        assert found(run(effects, seed, **DRIFTING)) == []


@pytest.mark.parametrize(("ranks", "slowdown"), [((5,), 0.15), ((4, 5, 6, 7), 0.12), ((9,), 0.5)])
def test_found_with_node_slowdown_and_onset(ranks: tuple[int, ...], slowdown: float) -> None:
    out = run(traces.Effects(slow=[Slowdown(ranks, 80, None, slowdown)]))
    (finding,) = [e for e, _ in out if isinstance(e, events.StragglerFound)]
    assert isinstance(finding, events.StragglerFound)
    assert finding.node == f"node-{ranks[0] // 4:03d}"
    assert finding.slowdown == pytest.approx(slowdown, abs=0.04)
    assert 70 <= finding.since_step <= 110
    assert finding.confidence >= 0.75
    ((_, step),) = found(out)
    assert step - 80 <= 50


def test_a_whole_machine_10pct_slow_is_found_among_drifting_ranks() -> None:
    """One rank 10% slow hides in a 5% drift; eight of them, averaged, do not."""
    node = traces.node_ranks(6, traces.JobShape())
    for seed in range(2):
        out = run(traces.Effects(slow=[Slowdown(node, 100, None, 0.10)]), seed, **DRIFTING)
        assert [n for n, _ in found(out)] == ["node-006"]
        (finding,) = [e for e, _ in out if isinstance(e, events.StragglerFound)]
        assert "its ranks' me" in finding.detail  # the machine, by either path


def test_lost_telemetry_does_not_restart_a_machines_history() -> None:
    """Step telemetry is QoS 0: a machine's mean is over the ranks that reported the
    step, and a missing one does not wipe the window (2% of batches lost)."""
    node = traces.node_ranks(6, traces.JobShape())
    trace = traces.generate(
        "t", 0, traces.JobShape(**DRIFTING), traces.Effects(slow=[Slowdown(node, 100, None, 0.10)])
    )
    rng = random.Random(0)
    trace.batches = [b for b in trace.batches if rng.random() >= 0.02]
    view = ClusterView()
    det = StragglerDetector(StragglerConfig(), context=Context(view=view, clock=SystemClock()))

    assert [n for n, _ in found(replay(trace, [det], view).found)] == ["node-006"]


def test_no_finding_in_a_small_job_whose_machines_drift() -> None:
    """Four machines of one rank drifting by 5%: the spread of four levels is corrected
    for its small sample, so the drift is not taken for a straggler."""
    for seed in range(3):
        out = run(traces.Effects(), seed, ranks=4, ranks_per_node=1, steps=600, sigma=0.05)
        assert found(out) == []


def test_a_blatant_straggler_is_found_without_waiting_to_persist() -> None:
    slow = traces.Effects(slow=[Slowdown((6,), 80, None, 0.6)])
    ((_, at),) = found(run(slow))
    ((_, later),) = found(run(slow, config=StragglerConfig(persist_steps=40)))
    assert at == later and at - 80 <= 20


def test_a_ramp_is_found_once_it_stands_out() -> None:
    out = run(traces.Effects(slow=[Slowdown((6,), 40, None, 0.4, ramp_steps=100)]))
    ((node, step),) = found(out)
    assert node == "node-001" and 40 < step < 140


def test_a_slowdown_that_comes_and_goes_is_one_finding() -> None:
    """Off for less than a window between slow stretches: not cleared in between, so
    the policy sees one persistent straggler rather than a flapping one."""
    slow = Slowdown(traces.node_ranks(2, traces.JobShape()), 40, None, 0.25, on_off=(40, 20))
    out = run(traces.Effects(slow=[slow]), **DRIFTING)
    assert kinds(out) == [("StragglerFound", "node-002")]


def test_a_straggler_off_for_longer_than_a_window_is_still_one_finding() -> None:
    """Intermittent: slow for 30 steps, normal for 40, again and again. Kept flagged
    until calm for ``clear_steps``, so the rebalance policy's ``persist_s`` can ripen."""
    ranks = traces.node_ranks(2, traces.JobShape())
    slow = Slowdown(ranks, 40, None, 0.25, on_off=(30, 40))
    out = run(traces.Effects(slow=[slow]), **{**DRIFTING, "steps": 400})
    assert kinds(out) == [("StragglerFound", "node-002")]


@pytest.mark.parametrize("seed", range(3))
def test_a_sudden_slowdown_of_a_machine_is_found_within_a_few_steps(seed: int) -> None:
    """The change path: a whole machine 20% slower from one step on, in a job whose
    ranks drift by 5%, is found within ten steps, from its change against its own
    recent past (the level test alone needs a window and more)."""
    onset = 150
    slow = Slowdown(traces.node_ranks(5, traces.JobShape()), onset, None, 0.20)
    [(event, step)] = [(e, s) for e, s in run(traces.Effects(slow=[slow]), seed, **DRIFTING)
                       if isinstance(e, events.StragglerFound)]  # fmt: skip
    assert event.node == "node-005" and 0 <= step - onset <= 10
    assert "sudden change" in event.detail
    level_only = StragglerConfig(change_zscore=100)
    [(_, later)] = found(run(traces.Effects(slow=[slow]), seed, config=level_only, **DRIFTING))
    assert later > step


@pytest.mark.parametrize("seed", range(3))
def test_a_short_excursion_is_not_reported(seed: int) -> None:
    """One GPU 20% slow for 10 steps: fewer than the 3/4 of a window (16) that must
    agree. A slowdown of twice the threshold is reported once 12 steps show it (no
    further wait that far above), one just above it after ``persist_steps`` more."""
    burst = traces.Effects(slow=[Slowdown((6,), 80, 90, 0.2)])
    assert found(run(burst, seed)) == []
    short = StragglerConfig(window_steps=8, persist_steps=0)
    assert [n for n, _ in found(run(burst, seed, config=short))] == ["node-001"]


def test_recovery_clears_and_a_later_slowdown_is_found_again() -> None:
    # Calm for longer than clear_steps (64) between the two: gone, then back.
    late = Slowdown((2,), 200, None, 0.2)
    out = run(traces.Effects(slow=[Slowdown((2,), 40, 100, 0.2), late]), steps=280)
    assert kinds(out) == [
        ("StragglerFound", "node-000"),
        ("StragglerCleared", "node-000"),
        ("StragglerFound", "node-000"),
    ]


def test_two_stragglers_at_once() -> None:
    out = run(traces.Effects(slow=[Slowdown((1,), 60, None, 0.15), Slowdown((13,), 70, None, 0.3)]))
    assert sorted(n for n, _ in found(out)) == ["node-000", "node-003"]


def test_a_rank_that_moves_to_another_machine_clears_the_old_one() -> None:
    view = ClusterView()
    det = StragglerDetector(StragglerConfig(), context=Context(view=view, clock=SystemClock()))
    shape = traces.JobShape(**QUIET)
    trace = traces.generate("t", 0, shape, traces.Effects(slow=[Slowdown((3,), 20, None, 0.3)]))
    out = replay(trace, [det], view, tail_s=0).found
    assert found(out) and found(out)[0][0] == "node-000"
    t = traces.T0 + 1e4
    moved = wire.IterBatch(
        ts=t,
        job="t-0",
        rank=3,
        node="standby-0",
        steps=[wire.StepTiming(221, t, 1, 0.6, 0.3, 0.05, 0.05)],
    )
    view.apply_iter(moved, t)
    cleared = list(det.tick(t))
    assert kinds([(e, 0) for e in cleared]) == [("StragglerCleared", "node-000")]


def test_score_is_a_pure_function() -> None:
    th = Threshold(center=0.0, flag=math.log(1.08), clear=math.log(1.03))
    ratios = [1.0, 1.01, 1.2, 1.18, 1.22, 5.0, 1.19, 1.21]
    window = [(10 + i, math.log(r)) for i, r in enumerate(ratios)]
    s = score(window, th)
    assert s.since_step == 12  # the run of steps above half the threshold starts at 12
    assert s.confidence == pytest.approx(6 / 8)
    assert s.level == pytest.approx(interquartile_mean([v for _, v in window]))
    assert s.run_slowdown == pytest.approx(0.2, abs=0.01)  # the run alone, spike trimmed
    shifted = score(window, Threshold(center=math.log(1.2), flag=th.flag, clear=th.clear))
    assert shifted.level == pytest.approx(s.level - math.log(1.2))  # peers are the zero
    assert interquartile_mean([1, 2, 3, 4, 100, -50, 2.5, 3.5]) == pytest.approx(2.75)


def test_thresholds_follow_the_peers_spread_above_the_floor() -> None:
    cfg = StragglerConfig()  # min_slowdown 8%, clear 3%, min_zscore 5
    quiet = thresholds([0.0, 0.01, -0.01], 0.005, cfg)
    assert quiet.flag == pytest.approx(math.log(1.08))  # 5 x 0.5% is below the floor
    assert quiet.clear == pytest.approx(math.log(1.03))
    drifting = thresholds([0.02, 0.03, 0.04], 0.05, cfg)
    assert drifting.center == pytest.approx(0.03)
    assert drifting.flag == pytest.approx(0.25)
    assert drifting.clear == pytest.approx(0.25 * math.log(1.03) / math.log(1.08))
    assert thresholds([0.0] * 3, 0.05, StragglerConfig(min_zscore=0)).flag == quiet.flag


def test_robust_spread_is_the_sigma_of_the_bulk_not_of_the_outliers() -> None:
    rng = random.Random(1)
    bulk = [rng.gauss(0, 0.05) for _ in range(500)]
    assert robust_spread(bulk) == pytest.approx(0.05, rel=0.1)
    assert robust_spread(bulk + [2.0] * 25) == pytest.approx(0.05, rel=0.15)
    assert robust_spread([0.3]) == 0.0
    # Three values: the plain MAD is a third too low on average; corrected, it is not.
    small = [robust_spread([rng.gauss(0, 0.05) for _ in range(3)]) for _ in range(4000)]
    assert sum(small) / len(small) == pytest.approx(0.05, rel=0.1)


@pytest.mark.parametrize(
    ("key", "value"), [("min_zscore", -1.0), ("persist_steps", -1), ("clear_slowdown", 0.5)]
)
def test_bad_config_fails_at_start(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=key):
        StragglerConfig(**{key: value}).validate()  # type: ignore[arg-type]


def test_the_change_path_s_ring_keeps_its_older_part_sorted() -> None:
    import random
    from collections import deque

    from tmd.detectors.straggler import _Unit

    rng = random.Random(5)
    unit = _Unit("n", deque(maxlen=24))
    unit.steps = deque(maxlen=36)
    for step in range(200):
        unit.push(step, rng.gauss(0, 1), 4)
        values = [v for _, v in unit.steps]
        assert unit.before == sorted(values[:-4])
    unit.forget()
    assert not unit.steps and not unit.before and unit.changed_for == 0


def test_the_busy_time_fields_are_where_the_view_keeps_them() -> None:
    """The detector reads busy time from the view's columns by position (it imports the
    view, not its columns module): those positions must be the columns' own."""
    from tmd.daemon.columns import TIMING_FIELDS
    from tmd.detectors import straggler

    assert TIMING_FIELDS.index("step_s") == straggler._STEP_S
    assert TIMING_FIELDS.index("allreduce_s") == straggler._ALLREDUCE_S


class _Checked(StragglerDetector):
    """The detector, its frontier checked after every tick: thresholds are never of
    a step past what it has scored."""

    def tick(self, now: float) -> list[events.Event]:
        out = list(super().tick(now))
        for job in self.jobs.values():
            assert job.spread_step <= job.frontier, (job.spread_step, job.frontier)
        return out


def went_back(
    before: traces.Effects, after: traces.Effects, how: str, *, missing: tuple[int, ...] = ()
) -> list[tuple[events.Event, int]]:
    """A job of 220 steps, then the same job from its checkpoint of step 40 for 180
    steps (to 219 again), 150 s later: a new run its ranks name (``how`` "batches"),
    one its status names first ("status"), or a rollback in a new generation of the
    same run ("rollback"). The ranks in ``missing`` report nothing after."""
    shape = traces.JobShape(**QUIET)
    old = traces.generate("t", 0, shape, before)
    new = traces.generate("t", 1, traces.JobShape(**{**QUIET, "steps": 180}), after)
    job = old.batches[0][1].job
    shift = old.batches[-1][0] + 150.0 - new.batches[0][0]
    changed: dict[str, int] = {"generation": 1} if how == "rollback" else {"run": 1}

    def moved(b: wire.IterBatch) -> wire.IterBatch:
        steps = [
            msgspec.structs.replace(s, step=s.step + 40, end_ts=s.end_ts + shift) for s in b.steps
        ]
        return msgspec.structs.replace(b, job=job, ts=b.ts + shift, steps=steps, **changed)

    new.batches = [(t + shift, moved(b)) for t, b in new.batches if b.rank not in missing]
    view = ClusterView()
    det = _Checked(StragglerConfig(), context=Context(view=view, clock=SystemClock()))
    out = replay(old, [det], view).found
    if how == "status":
        members = [wire.Member(r, traces.node_of(r, shape), r % 4) for r in range(16)]
        t = new.batches[0][0] - 1.0
        status = wire.JobStatus(ts=t, job=job, generation=0, world_size=16, members=members, run=1)
        view.apply_job_status(status, t)
    return out + replay(new, [det], view).found


SLOW_5 = traces.Effects(slow=[Slowdown((5,), 60, None, 0.3)])  # node-001's rank 5, from 60


@pytest.mark.parametrize("missing", [(), (3,)], ids=["all back", "a rank missing"])
@pytest.mark.parametrize("how", ["batches", "status", "rollback"])
def test_the_steps_after_a_restart_are_scored_from_the_first(
    how: str, missing: tuple[int, ...]
) -> None:
    """The job goes back to its checkpoint and a rank is 30% slow from its step 60
    (100 of the new timeline): it is found before the new timeline passes the step
    the old one reached (219), even where a rank of the old one never reports again
    (its old steps are not the new timeline's)."""
    out = went_back(traces.Effects(), SLOW_5, how, missing=missing)
    assert [n for n, _ in found(out)] == ["node-001"]


def test_a_rank_hot_when_the_job_went_back_starts_over() -> None:
    """A rank slow for the last steps before a new run, not long enough to be found,
    and at speed after: its steps before are not counted with those after."""
    slow_late = traces.Effects(slow=[Slowdown((5,), 215, None, 0.3)])
    assert found(run(slow_late)) == []  # not yet found when the first run ends
    assert found(went_back(slow_late, traces.Effects(), "batches")) == []


@pytest.mark.parametrize("slow", [(5,), (4, 5, 6, 7)], ids=["a rank", "a machine"])
def test_a_straggler_calm_since_before_a_new_run_is_cleared_in_it(slow: tuple[int, ...]) -> None:
    """Found in the first run and calm from some 30 steps before its end, less than
    ``clear_steps``: the calm count starts over with the new run's steps, which go
    back, and the node is cleared once calm that long in the new run."""
    before = traces.Effects(slow=[Slowdown(slow, 60, 180, 0.3)])
    out = run(before)
    assert kinds(out) == [("StragglerFound", "node-001")]  # not cleared in the first run
    assert kinds(went_back(before, traces.Effects(), "batches")) == [
        ("StragglerFound", "node-001"),
        ("StragglerCleared", "node-001"),
    ]


class Fed:
    """16 ranks on 4 machines fed straight to the view, 10 steps a tick, all alike:
    for what the detector keeps of a job whose steps go back."""

    def __init__(self) -> None:
        self.view = ClusterView()
        self.det = StragglerDetector(
            StragglerConfig(), context=Context(view=self.view, clock=SystemClock())
        )
        self.t = 1000.0
        self.node = {r: f"n{r // 4}" for r in range(16)}  # where each rank runs
        self.slow: dict[int, float] = {}  # rank -> its step time's factor

    def feed(
        self, steps: range, ranks: Any = range(16), *, run: int | None = None, gen: int = 0
    ) -> None:
        for r in ranks:
            step_s = (1.0 + 0.01 * (r % 5)) * self.slow.get(r, 1.0)
            rows = [(s, self.t, step_s, 0.9, 0.05, 0.03, 0.02) for s in steps]
            self.view.apply_steps("j", r, self.node.get(r, f"n{r // 4}"), gen, run, rows, self.t)

    def steps(
        self, start: int, stop: int, ranks: Any = range(16), *, run: int | None = None,
        gen: int = 0,
    ) -> None:  # fmt: skip
        """Steps ``start`` to ``stop`` (excluded), a tick each 10."""
        for s0 in range(start, stop, 10):
            self.feed(range(s0, s0 + 10), ranks, run=run, gen=gen)
            self.tick()

    def tick(self) -> None:
        self.t += 1.0
        list(self.det.tick(self.t))

    def scored(self, rank: int = 0) -> tuple[int, int]:
        """(the frontier, how many steps of ``rank`` its history holds)."""
        job = self.det.jobs["j"]
        return job.frontier, int(job.ranks.count[job.ranks.slot[rank]])


def test_a_new_run_a_few_steps_back_restarts_the_histories() -> None:
    """19 steps back, fewer than ``stall_lag_steps``: the steps alone do not tell, the
    view's count of the runs does."""
    fed = Fed()
    fed.steps(0, 220, run=0)
    fed.steps(201, 211, run=1)
    assert fed.scored() == (210, 10)


def test_a_rank_back_late_on_the_new_timeline_is_waited_for() -> None:
    """A new run whose rank 3 reports its first steps 3 ticks after the others: its
    steps and theirs are scored from the run's first, not from where it came back."""
    fed = Fed()
    fed.steps(0, 220, run=0)
    others = [r for r in range(16) if r != 3]
    fed.steps(41, 71, others, run=1)
    assert fed.scored() == (-1, 0)  # waited for rank 3
    fed.feed(range(41, 71), [3], run=1)
    fed.steps(71, 141, run=1)
    assert fed.scored(0) == fed.scored(3) == (140, 100)


def test_a_rank_that_missed_a_rollback_is_not_a_second_one() -> None:
    """A rollback to step 41 (generation 1) whose rank 15 lost its batches, then a
    live migration (generation 2, the steps go on): rank 15's first batch of it is
    below the steps it last sent, yet the job did not go back again."""
    fed = Fed()
    fed.steps(0, 220)
    fed.steps(41, 101, range(15), gen=1)
    fed.feed(range(101, 111), [15], gen=2)
    fed.tick()
    fed.steps(101, 121, range(15), gen=2)
    assert (fed.view.jobs["j"].rewinds, fed.view.jobs["j"].rewound) == (1, (0, 1))
    assert fed.scored() == (110, 70)  # rank 15 is at 110


def test_a_job_the_view_forgot_and_took_up_again_starts_over() -> None:
    """The view forgets the job and takes it up again, at the same count of runs,
    before a tick: its histories restart."""
    fed = Fed()
    fed.steps(0, 10, run=0)
    fed.steps(5, 225, run=1)
    fed.view.forget_job("j")
    fed.steps(201, 211, run=2)  # run 2, the view's first: its count is 1 again
    assert fed.scored() == (210, 10)


def test_a_late_batch_of_the_old_run_waits_the_new_one_no_longer_than_a_stall() -> None:
    """A rank new to the view whose first batch is a late one of the run left behind
    holds the new run's scoring back no longer than a rank that stalled would."""
    fed = Fed()
    fed.steps(0, 220, run=0)
    fed.steps(41, 51, run=1)
    fed.feed(range(200, 210), [16], run=0)
    fed.steps(51, 141, run=1)
    assert fed.scored() == (140, 100)


@pytest.mark.parametrize("slow", [(13,), (12, 13, 14, 15)], ids=["a rank", "a machine"])
def test_a_straggler_the_job_went_on_without_is_cleared(slow: tuple[int, ...]) -> None:
    """Found, then the job goes on with its first 12 ranks (its status says so): the
    machine of ranks 12 to 15 is cleared, as nothing of it is scored again."""
    trace = traces.generate(
        "t", 0, traces.JobShape(**QUIET), traces.Effects(slow=[Slowdown(slow, 60, None, 0.3)])
    )
    view = ClusterView()
    det = StragglerDetector(StragglerConfig(), context=Context(view=view, clock=SystemClock()))
    out = replay(trace, [det], view).found
    assert kinds(out) == [("StragglerFound", "node-003")]
    t = trace.batches[-1][0] + 200.0
    members = [wire.Member(r, traces.node_of(r, trace.shape), r % 4) for r in range(12)]
    job = trace.batches[0][1].job
    view.apply_job_status(wire.JobStatus(ts=t, job=job, generation=1, world_size=12,
                                         members=members), t)  # fmt: skip
    cleared = [e for e in det.tick(t + 1) if isinstance(e, events.Finding)]
    assert [(type(e).__name__, e.node) for e in cleared] == [("StragglerCleared", "node-003")]
    assert det.jobs[job].flagged_nodes == {}
    ranks = det.jobs[job].ranks  # their histories gone from the peers' pool too
    assert [int(ranks.count[ranks.slot[r]]) for r in (11, 12, 15)] == [220, 0, 0]


def test_machines_migrated_away_give_their_slots_to_the_next() -> None:
    """A long job whose machine n1 is migrated 12 times: the detector holds a slot for
    each machine the job runs on now (and the one just left), not for every machine it
    ever ran on, and finds the machine it runs on last when that one is slow."""
    fed = Fed()
    fed.steps(0, 100)
    for k in range(12):
        for r in range(4, 8):
            fed.node[r] = f"m{k}"
        fed.steps(100 + 40 * k, 140 + 40 * k)
    job = fed.det.jobs["j"]
    assert job.machines.n <= 5 and sorted(job.machines.slot) == ["m11", "n0", "n2", "n3"]
    for r in range(4, 8):
        fed.slow[r] = 1.3
    found = []
    for s0 in range(580, 700, 10):
        fed.feed(range(s0, s0 + 10))
        fed.t += 1.0
        found += [e.node for e in fed.det.tick(fed.t) if isinstance(e, events.StragglerFound)]
    assert found == ["m11"]


def test_a_machine_the_job_left_and_one_that_came_back_start_afresh() -> None:
    """The slow machine n3 is found; the job goes on without it (its status), then
    takes a new machine n9 in its place (n3's slot, its history and flag not with
    it), then n3 again, still slow: found again, as a machine new to the job."""
    fed = Fed()
    for r in range(12, 16):
        fed.slow[r] = 1.3
    view = fed.view
    found: list[tuple[str, str]] = []

    def status(world: int) -> None:
        members = [wire.Member(r, fed.node[r], r % 4) for r in range(world)]
        view.apply_job_status(wire.JobStatus(ts=fed.t, job="j", generation=0,
                                             world_size=world, members=members), fed.t)  # fmt: skip

    def steps(start: int, stop: int, ranks: Any = range(16)) -> None:
        for s0 in range(start, stop, 10):
            fed.feed(range(s0, s0 + 10), ranks)
            fed.t += 1.0
            found.extend(
                (type(e).__name__, e.node)
                for e in fed.det.tick(fed.t)
                if isinstance(e, events.Finding)
            )

    steps(0, 150)
    status(12)
    steps(150, 200, range(12))
    for r in range(12, 16):
        fed.node[r], fed.slow[r] = "n9", 1.0
    status(16)
    steps(200, 300)
    job = fed.det.jobs["j"]
    assert found == [("StragglerFound", "n3"), ("StragglerCleared", "n3")]
    assert job.machines.n == 4  # n9 in n3's slot
    for r in range(12, 16):
        fed.node[r], fed.slow[r] = "n3", 1.3
    status(16)
    steps(300, 450)
    assert found[2:] == [("StragglerFound", "n3")] and job.machines.n == 4
