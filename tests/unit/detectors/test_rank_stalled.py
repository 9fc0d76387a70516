"""rank_stalled: silent while peers go on, once per stall; a whole-job stop is not it."""

from __future__ import annotations

from tmd import wire
from tmd.clock import SystemClock
from tmd.daemon import events
from tmd.daemon.plugins import Context
from tmd.daemon.view import ClusterView
from tmd.detectors.rank_stalled import RankStalledConfig, RankStalledDetector

T0 = 1_800_000_000.0


def b(rank: int, step: int) -> wire.IterBatch:
    return wire.IterBatch(
        ts=T0,
        job="j",
        rank=rank,
        node=f"n{rank}",
        steps=[wire.StepTiming(step, T0, 1, 0.6, 0.3, 0.05, 0.05)],
    )


def make() -> tuple[ClusterView, RankStalledDetector]:
    view = ClusterView()
    det = RankStalledDetector(
        RankStalledConfig(stall_after_s=10, stall_steps=5),
        context=Context(view=view, clock=SystemClock()),
    )
    return view, det


def test_stalled_rank_is_reported_once_and_rearms() -> None:
    view, det = make()
    out: list[events.Event] = []
    for step in range(1, 41):
        for r in range(4):
            if r != 2 or step <= 20:
                view.apply_iter(b(r, step), T0 + step)
        out += det.tick(T0 + step)
    assert [(e.rank, e.last_step, e.node) for e in out] == [(2, 20, "n2")]  # type: ignore[attr-defined]
    view.apply_iter(b(2, 41), T0 + 41)  # it is back ...
    later: list[events.Event] = []
    for step in range(42, 70):
        for r in (0, 1, 3):
            view.apply_iter(b(r, step), T0 + step)
        later += det.tick(T0 + step)
    assert [(e.rank, e.last_step) for e in later] == [(2, 41)]  # type: ignore[attr-defined]


def test_whole_job_stop_is_not_a_rank_stall() -> None:
    view, det = make()
    for step in range(1, 20):
        for r in range(4):
            view.apply_iter(b(r, step), T0 + step)
    assert list(det.tick(T0 + 100)) == []


def test_a_job_whose_ranks_messages_were_lost_on_the_way_settles_alone() -> None:
    """What a job's ranks published themselves went missing on the way (gaps in their
    numbers, ``JobView.lost_at``): its silences count from the loss, after the view's
    settling; another job's do not wait."""
    view, det = make()
    view.freshness.settle_s = 5.0  # as a daemon's view settles

    def other(rank: int, step: int) -> wire.IterBatch:
        timing = wire.StepTiming(step, T0, 1, 0.6, 0.3, 0.05, 0.05)
        return wire.IterBatch(ts=T0, job="k", rank=rank, node=f"m{rank}", steps=[timing])

    found: list[tuple[str, int, int]] = []
    for step in range(1, 41):
        for r in range(4):
            if r != 2 or step <= 10:
                view.apply_iter(b(r, step), T0 + step)
                view.apply_iter(other(r, step), T0 + step)
        if step == 15:
            view.jobs["j"].lost_at = T0 + step  # as ingest marks a gap in j's ranks
        found += [(e.job, e.rank, step) for e in det.tick(T0 + step)]  # type: ignore[attr-defined]
    # k's rank 2: silent past 10 s from step 10; j's: 10 s from the loss at 15.
    assert found == [("k", 2, 21), ("j", 2, 26)]


def test_a_job_settling_longer_than_a_stall_finds_nothing_meanwhile() -> None:
    view, det = make()
    view.freshness.settle_s = 15.0  # longer than stall_after_s (10)
    found: list[int] = []
    for step in range(1, 41):
        for r in range(4):
            if r != 2 or step <= 10:
                view.apply_iter(b(r, step), T0 + step)
        if step == 15:
            view.jobs["j"].lost_at = T0 + step
        found += [step for e in det.tick(T0 + step)]
    assert found == [30]  # settled at 30, and silent 10 s from the loss by then


def test_ranks_relayed_by_their_agents_stall_alike_and_columns_given_back_hold_nothing() -> None:
    """The columns the detector reads (``StepColumns.last_step``, ``last_seen``) as
    both ways of reporting write them: a relayed rank that goes silent is found; the
    columns of ranks that left hold nothing of them (ticks meanwhile read only the
    columns in use); ranks that come back take them in another order and are found
    by rank; the columns grown keep what they held."""
    from tmd.daemon.view import StepsApplied

    view, det = make()

    def status(world: int) -> None:
        members = [wire.Member(r, f"n{r}", 0) for r in range(world)]
        view.apply_job_status(wire.JobStatus(ts=T0, job="j", generation=0, world_size=world,
                                             members=members), T0)  # fmt: skip

    def steps(step: int, ranks: list[int]) -> list[events.Event]:
        for r in ranks:  # each machine's agent relays its one rank
            batch = b(r, step)
            (relayed,) = wire.RelayedBatches.of([batch])
            view.apply_relayed(relayed, batch.node, T0 + step, StepsApplied())
        return list(det.tick(T0 + step))

    status(6)
    out = [e for step in range(1, 31) for e in steps(step, [0, 2, 3, 4, 5] + [1] * (step <= 12))]
    assert [(e.rank, e.last_step, e.node) for e in out] == [(1, 12, "n1")]  # type: ignore[attr-defined]
    ranks = view.jobs["j"].ranks
    freed = [ranks[4].col, ranks[5].col]
    kept = sorted(ranks[r].col for r in range(4))
    status(4)  # ranks 4 and 5 leave: their columns go back
    cols = view.jobs["j"].cols
    assert cols is not None and sorted(cols.in_use().tolist()) == kept
    assert cols.last_step[freed].tolist() == [-1, -1] and cols.last_seen[freed].tolist() == [0, 0]
    out = [e for step in range(31, 41) for e in steps(step, [0, 2, 3])]
    assert out == []  # rank 1 again: not moved since it was found
    status(6)
    out = [e for step in range(41, 61) for e in steps(step, [0, 2, 3] + [4, 5] * (step == 41))]
    assert [(e.rank, e.last_step) for e in out] == [(4, 41), (5, 41)]  # type: ignore[attr-defined]
    assert [ranks[4].col, ranks[5].col] == freed[::-1]  # taken back in another order
    before = [(r, s.last_step, s.last_seen) for r, s in ranks.items()]
    cols.reserve(4 * cols.capacity)  # grown: what the columns held stays
    assert [(r, s.last_step, s.last_seen) for r, s in ranks.items()] == before
