"""rank_stalled: silent while peers go on, once per stall; a whole-job stop is not it."""

from __future__ import annotations

from tmd import events, wire
from tmd.clock import SystemClock
from tmd.detectors.rank_stalled import RankStalledConfig, RankStalledDetector
from tmd.plugins import Context
from tmd.view import ClusterView

T0 = 1_800_000_000.0


def b(rank: int, step: int) -> wire.IterBatch:
    return wire.IterBatch(
        ts=T0,
        job="j",
        rank=rank,
        node=f"n{rank}",
        steps=[wire.StepTiming(step, T0, 1, 0.6, 0.3, 0.05, 0.05)],
    )


def test_stalled_rank_is_reported_once_and_rearms() -> None:
    det = RankStalledDetector(
        RankStalledConfig(stall_after_s=10, stall_steps=5),
        context=Context(view=ClusterView(), clock=SystemClock()),
    )
    out: list[events.Event] = []
    for step in range(1, 41):
        t = T0 + step
        for r in range(4):
            if r != 2 or step <= 20:
                list(det.observe(b(r, step), t))
        out += det.tick(t)
    assert [(e.rank, e.last_step, e.node) for e in out] == [(2, 20, "n2")]  # type: ignore[attr-defined]
    list(det.observe(b(2, 41), T0 + 41))  # it is back
    later = []
    for step in range(42, 70):
        for r in (0, 1, 3):
            list(det.observe(b(r, step), T0 + step))
        later += det.tick(T0 + step)
    assert [e.rank for e in later] == [2]  # type: ignore[attr-defined]


def test_whole_job_stop_is_not_a_rank_stall() -> None:
    det = RankStalledDetector(
        RankStalledConfig(stall_after_s=10, stall_steps=5),
        context=Context(view=ClusterView(), clock=SystemClock()),
    )
    for step in range(1, 20):
        for r in range(4):
            list(det.observe(b(r, step), T0 + step))
    assert list(det.tick(T0 + 100)) == []
