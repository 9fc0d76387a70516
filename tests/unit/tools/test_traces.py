"""The labelled traces are as hard as asked: slow per-rank drift with the asked
correlation, jittery all-reduce timings, ramps, intermittent and double stragglers,
jobs of 16 machines of 8 ranks; and the same trace for the same seed."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from tmd import wire
from tmd.tools import traces
from tmd.tools.traces import JobShape, Slowdown

# Nothing but the slow drift: busy time is base x exp(drift), exactly.
DRIFT_ONLY = dict(
    noise=0.0, spike_p=0.0, hw_spread=0.0, ar_jitter=0.0, job_sigma=0.0,
    eval_every=0, checkpoint_every=0,
)  # fmt: skip


def by_rank(trace: traces.Trace) -> dict[int, list[wire.StepTiming]]:
    out: dict[int, list[wire.StepTiming]] = {}
    for _, batch in trace.batches:
        out.setdefault(batch.rank, []).extend(batch.steps)
    for steps in out.values():
        steps.sort(key=lambda s: s.step)
    return out


def log_busy(trace: traces.Trace) -> dict[int, list[float]]:
    base = trace.shape.step_s * trace.shape.busy_fraction
    return {
        r: [math.log((s.step_s - s.allreduce_s) / base) for s in steps]
        for r, steps in by_rank(trace).items()
    }


@pytest.mark.parametrize(("rho", "sigma"), [(0.98, 0.05), (0.9, 0.03)])
def test_drift_is_ar1_with_the_asked_correlation_and_spread(rho: float, sigma: float) -> None:
    shape = JobShape(rho=rho, sigma=sigma, steps=300, **DRIFT_ONLY)  # type: ignore[arg-type]
    x = log_busy(traces.generate("ar", 0, shape, traces.Effects()))
    # Stationary from the first step: the spread across ranks is sigma at every step.
    across = [statistics.pstdev(col) for col in zip(*x.values(), strict=True)]
    assert statistics.mean(across) == pytest.approx(sigma, rel=0.1)
    # Lag-one correlation, pooled over ranks around the known zero mean.
    num = sum(a * b for xs in x.values() for a, b in itertools.pairwise(xs))
    den = sum(a * a for xs in x.values() for a in xs[:-1])
    assert num / den == pytest.approx(rho, abs=0.02)


def test_without_drift_the_busy_times_do_not_wander() -> None:
    shape = JobShape(sigma=0.0, steps=50, **DRIFT_ONLY)  # type: ignore[arg-type]
    x = log_busy(traces.generate("flat", 0, shape, traces.Effects()))
    assert max(abs(v) for xs in x.values() for v in xs) < 1e-6


def test_reported_allreduce_carries_jitter() -> None:
    """Step minus all-reduce is not the busy time exactly: the measured wait is off by
    about ``ar_jitter`` step times, both ways."""
    shape = JobShape(steps=40)
    errors = [
        s.step_s - s.allreduce_s - (s.compute_s + s.optimizer_s + s.data_s)
        for steps in by_rank(traces.generate("j", 0, shape, traces.Effects())).values()
        for s in steps
    ]
    assert statistics.pstdev(errors) == pytest.approx(shape.ar_jitter * shape.step_s, rel=0.1)
    assert min(errors) < 0 < max(errors)
    exact = JobShape(steps=40, ar_jitter=0.0)
    for steps in by_rank(traces.generate("j", 0, exact, traces.Effects())).values():
        for s in steps:
            assert s.step_s == pytest.approx(
                s.allreduce_s + s.compute_s + s.optimizer_s + s.data_s, abs=1e-9
            )


def test_a_job_is_16_machines_of_8_ranks() -> None:
    trace = traces.build("clean", 0, JobShape(steps=5))
    nodes: dict[str, set[int]] = {}
    for _, b in trace.batches:
        nodes.setdefault(b.node, set()).add(b.rank)
    assert len(nodes) >= 16 and {len(r) for r in nodes.values()} == {8}


def test_ramp_and_on_off_shape_the_slowdown() -> None:
    ramp = Slowdown((1,), 10, None, 0.4, ramp_steps=4)
    assert [ramp.extra(s) for s in range(9, 16)] == pytest.approx([0, 0.1, 0.2, 0.3, 0.4, 0.4, 0.4])
    blink = Slowdown((1,), 10, 25, 0.3, on_off=(3, 2))
    assert [blink.extra(s) for s in range(9, 26)] == pytest.approx(
        [0, 0.3, 0.3, 0.3, 0, 0, 0.3, 0.3, 0.3, 0, 0, 0.3, 0.3, 0.3, 0, 0, 0]
    )


def test_a_gradual_onset_ramps_in_the_trace() -> None:
    shape = JobShape(sigma=0.0, steps=160, **DRIFT_ONLY)  # type: ignore[arg-type]
    effects = traces.Effects(slow=[Slowdown((3,), 40, None, 0.3, ramp_steps=100)])
    x = log_busy(traces.generate("ramp", 0, shape, effects))[3]
    quarter = [statistics.mean(x[i : i + 25]) for i in range(39, 139, 25)]
    assert quarter == sorted(quarter) and quarter[0] < 0.06 and quarter[-1] > 0.2
    assert x[150] == pytest.approx(math.log(1.3))  # then it holds
    assert max(abs(v) for v in x[:39]) < 1e-6  # nothing before the onset


def test_two_stragglers_on_two_machines_are_both_labelled() -> None:
    for seed in range(4):
        trace = traces.build("two_stragglers", seed, JobShape(steps=5))
        labels = [lb for lb in trace.labels if lb.kind == "straggler"]
        assert len(labels) == 2 and labels[0].node != labels[1].node
        for lb in labels:
            assert {traces.node_of(r, trace.shape) for r in lb.ranks} == {lb.node}


def test_every_scenario_is_labelled_the_way_its_name_says() -> None:
    shape = JobShape(steps=5)
    ramps = traces.build("node_ramp", 0, shape).labels
    assert ramps[0].ramp_steps > 0 and len(ramps[0].ranks) == 8
    (blink,) = traces.build("node_intermittent", 0, shape).labels
    assert blink.on_off is not None
    (gpu,) = traces.build("gpu_50pct", 0, shape).labels
    assert len(gpu.ranks) == 1 and gpu.slowdown == 0.5
    assert traces.build("clean", 0, shape).labels == []


def test_separability_is_noise_sigmas_at_the_better_granularity() -> None:
    shape = JobShape()  # sigma 5%, hw_spread 1.5%
    noise = math.hypot(0.05, 0.015)
    machine = Slowdown(traces.node_ranks(0, shape), 1, None, 0.10)
    gpu = Slowdown((3,), 1, None, 0.25)
    assert traces.separability(machine, shape) == pytest.approx(
        math.log(1.1) * math.sqrt(8) / noise
    )
    assert traces.separability(gpu, shape) == pytest.approx(math.log(1.25) / noise)
    assert traces.separability(machine, shape) > 5 > traces.separability(gpu, shape)
    quiet = JobShape(sigma=0.0, hw_spread=0.0)
    assert traces.separability(gpu, quiet) == math.inf


def test_same_scenario_and_seed_same_trace_other_seed_other_trace() -> None:
    shape = JobShape(steps=30)
    a, b = traces.build("gpu_ramp", 3, shape), traces.build("gpu_ramp", 3, shape)
    assert a.batches == b.batches and a.labels == b.labels
    assert traces.build("gpu_ramp", 4, shape).batches != a.batches


def test_noisy_scenario_does_not_change_the_shape_it_was_given() -> None:
    shape = JobShape(steps=5)
    trace = traces.build("noisy_15pct", 0, shape)
    assert trace.shape.noise == 0.06 and shape.noise == 0.03
