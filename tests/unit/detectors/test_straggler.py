"""straggler: table-tested on generated traces, replayed on simulated time."""

from __future__ import annotations

import pytest

from tmd import wire
from tmd.clock import SystemClock
from tmd.daemon import events
from tmd.daemon.plugins import Context
from tmd.daemon.view import ClusterView
from tmd.detectors.straggler import StragglerConfig, StragglerDetector, interquartile_mean, score
from tmd.tools import traces
from tmd.tools.bench.detect import replay

SHAPE = dict(ranks=16, ranks_per_node=4, steps=220)


def run(effects: traces.Effects, seed: int = 0, **shape: float) -> list[tuple[events.Event, int]]:
    shaped = traces.JobShape(**{**SHAPE, **shape})  # type: ignore[arg-type]
    trace = traces.generate("t", seed, shaped, effects)
    view = ClusterView()
    det = StragglerDetector(StragglerConfig(), context=Context(view=view, clock=SystemClock()))
    return replay(trace, [det], view).found


def found(out: list[tuple[events.Event, int]]) -> list[tuple[str, int]]:
    return [(e.node, s) for e, s in out if isinstance(e, events.StragglerFound)]


@pytest.mark.parametrize(
    "effects",
    [
        traces.Effects(),
        traces.Effects(job_slow=(50, 150, 1.5)),  # the whole job slows: nobody straggles
        traces.Effects(join={r: 100 for r in range(12, 16)}),  # a node joins late
        traces.Effects(slow=[((5,), 60, None, 0.04)]),  # 4%: below the threshold
    ],
    ids=["clean", "job slowdown", "late join", "4 percent"],
)
def test_no_finding(effects: traces.Effects) -> None:
    for seed in range(3):
        assert found(run(effects, seed)) == []


@pytest.mark.parametrize(("ranks", "slowdown"), [((5,), 0.10), ((4, 5, 6, 7), 0.12), ((9,), 0.5)])
def test_found_with_node_slowdown_and_onset(ranks: tuple[int, ...], slowdown: float) -> None:
    out = run(traces.Effects(slow=[(ranks, 80, None, slowdown)]))
    (finding,) = [e for e, _ in out if isinstance(e, events.StragglerFound)]
    assert isinstance(finding, events.StragglerFound)
    assert finding.node == f"node-{ranks[0] // 4:03d}"
    assert finding.slowdown == pytest.approx(slowdown, abs=0.04)
    assert 70 <= finding.since_step <= 110
    assert finding.confidence >= 0.75
    ((_, step),) = found(out)
    assert step - 80 <= 50


def test_recovery_clears_and_a_later_slowdown_is_found_again() -> None:
    out = run(traces.Effects(slow=[((2,), 40, 100, 0.2), ((2,), 150, None, 0.2)]))
    kinds = [(type(e).__name__, e.node) for e, _ in out]
    assert kinds == [
        ("StragglerFound", "node-000"),
        ("StragglerCleared", "node-000"),
        ("StragglerFound", "node-000"),
    ]


def test_two_stragglers_at_once() -> None:
    out = run(traces.Effects(slow=[((1,), 60, None, 0.15), ((13,), 70, None, 0.3)]))
    assert sorted(n for n, _ in found(out)) == ["node-000", "node-003"]


def test_a_rank_that_moves_to_another_machine_clears_the_old_one() -> None:
    view = ClusterView()
    det = StragglerDetector(StragglerConfig(), context=Context(view=view, clock=SystemClock()))
    shape = traces.JobShape(**SHAPE)  # type: ignore[arg-type]
    trace = traces.generate("t", 0, shape, traces.Effects(slow=[((3,), 20, None, 0.3)]))
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
    assert [(type(e).__name__, e.node) for e in cleared] == [("StragglerCleared", "node-000")]


def test_score_is_a_pure_function() -> None:
    cfg = StragglerConfig(window_steps=8)
    window = [(10 + i, r) for i, r in enumerate([1.0, 1.01, 1.2, 1.18, 1.22, 5.0, 1.19, 1.21])]
    s = score(window, cfg)
    assert s.since_step == 12  # the run of steps above 1.04 starts at step 12
    assert s.confidence == pytest.approx(6 / 8)
    assert s.slowdown == pytest.approx(interquartile_mean([r for _, r in window]) - 1)
    assert interquartile_mean([1, 2, 3, 4, 100, -50, 2.5, 3.5]) == pytest.approx(2.75)
