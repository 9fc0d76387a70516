"""Seeded, labelled telemetry traces of data-parallel jobs, for measuring detectors.

A trace is the time-ordered stream of ``IterBatch`` messages that a job's ranks would
send, plus labels saying which node straggled (from which step, by how much) or which
rank went silent. What a real job does is modelled where it matters to a detector:
every rank's step time is the slowest rank's busy time plus the all-reduce, so only
busy time tells machines apart; ranks differ a little for good (hardware spread);
steps are noisy with occasional spikes (GC, page faults); every 100 steps an
evaluation pause hits all ranks; every 50 steps rank 0 writes a checkpoint; batches
arrive on each rank's own flush phase.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from tmd import wire

T0 = 1_800_000_000.0


@dataclass(frozen=True)
class Label:
    kind: str  # "straggler" | "stall"
    node: str
    ranks: tuple[int, ...]
    start_step: int
    end_step: int | None = None  # exclusive; None: to the end of the trace
    slowdown: float = 0.0


@dataclass
class Trace:
    scenario: str
    seed: int
    step_s: float
    steps: int
    batches: list[tuple[float, wire.IterBatch]]
    labels: list[Label] = field(default_factory=list)


@dataclass
class JobShape:
    ranks: int = 32
    ranks_per_node: int = 8
    steps: int = 400
    step_s: float = 1.0
    busy_fraction: float = 0.6
    noise: float = 0.03  # lognormal sigma of each step's busy time
    spike_p: float = 0.01  # chance of a 1.5-3x step on one rank
    hw_spread: float = 0.015  # per-rank static speed spread
    eval_every: int = 100
    eval_s: float = 2.0
    checkpoint_every: int = 50
    checkpoint_factor: float = 3.0


@dataclass
class Effects:
    """What happens in one trace, besides the normal life of a job."""

    slow: list[tuple[tuple[int, ...], int, int | None, float]] = field(default_factory=list)
    job_slow: tuple[int, int, float] | None = None  # (from, to, factor) for every rank
    stall: dict[int, int] = field(default_factory=dict)  # rank -> last step it reports
    join: dict[int, int] = field(default_factory=dict)  # rank -> first step it reports


def node_of(rank: int, shape: JobShape) -> str:
    return f"node-{rank // shape.ranks_per_node:03d}"


def generate(scenario: str, seed: int, shape: JobShape, effects: Effects) -> Trace:
    rng = random.Random(f"{scenario}/{seed}")
    n = shape.ranks
    speed = [1 + rng.gauss(0, shape.hw_spread) for _ in range(n)]
    base = shape.step_s * shape.busy_fraction
    per_rank: list[list[wire.StepTiming]] = [[] for _ in range(n)]
    t = T0
    for step in range(1, shape.steps + 1):
        busy = []
        for r in range(n):
            b = base * speed[r] * rng.lognormvariate(0, shape.noise)
            if rng.random() < shape.spike_p:
                b *= rng.uniform(1.5, 3.0)
            for ranks, start, end, factor in effects.slow:
                if r in ranks and step >= start and (end is None or step < end):
                    b *= 1 + factor
            if effects.job_slow and effects.job_slow[0] <= step < effects.job_slow[1]:
                b *= effects.job_slow[2]
            if shape.eval_every and step % shape.eval_every == 0:
                b += shape.eval_s
            if r == 0 and shape.checkpoint_every and step % shape.checkpoint_every == 0:
                b *= shape.checkpoint_factor
            busy.append(b)
        step_s = max(busy) + shape.step_s * 0.1
        t += step_s
        for r in range(n):
            ar = step_s - busy[r]
            opt, data = busy[r] * 0.08, busy[r] * 0.04
            compute = busy[r] - opt - data
            per_rank[r].append(wire.StepTiming(step, t, step_s, compute, ar, opt, data))
    batches: list[tuple[float, wire.IterBatch]] = []
    for r in range(n):
        phase = r / n * shape.step_s
        first = effects.join.get(r, 1)
        last = effects.stall.get(r, shape.steps)
        for s in per_rank[r]:
            if first <= s.step <= last:
                arrival = s.end_ts + phase + rng.uniform(0, 0.05)
                batches.append(
                    (
                        arrival,
                        wire.IterBatch(
                            ts=arrival,
                            job=f"{scenario}-{seed}",
                            rank=r,
                            node=node_of(r, shape),
                            steps=[s],
                        ),
                    )
                )
    batches.sort(key=lambda x: x[0])
    labels = [
        Label("straggler", node_of(ranks[0], shape), ranks, start, end, factor)
        for ranks, start, end, factor in effects.slow
    ] + [Label("stall", node_of(r, shape), (r,), last + 1) for r, last in effects.stall.items()]
    return Trace(scenario, seed, shape.step_s, shape.steps, batches, labels)


def _node_ranks(node: int, shape: JobShape) -> tuple[int, ...]:
    k = shape.ranks_per_node
    return tuple(range(node * k, (node + 1) * k))


def _one_gpu(node: int, shape: JobShape, rng: random.Random) -> tuple[int, ...]:
    return (node * shape.ranks_per_node + rng.randrange(shape.ranks_per_node),)


Scenario = Callable[[random.Random, JobShape], Effects]


def _onset(rng: random.Random) -> int:
    return rng.randrange(60, 200)


SCENARIOS: dict[str, Scenario] = {
    "clean": lambda rng, s: Effects(),
    "clean_job_slowdown": lambda rng, s: Effects(job_slow=(120, 220, 1.3)),
    "clean_late_join": lambda rng, s: Effects(join={r: 150 for r in _node_ranks(3, s)}),
    "node_10pct": lambda rng, s: Effects(
        slow=[(_node_ranks(rng.randrange(4), s), _onset(rng), None, 0.10)]
    ),
    "gpu_10pct": lambda rng, s: Effects(
        slow=[(_one_gpu(rng.randrange(4), s, rng), _onset(rng), None, 0.10)]
    ),
    "gpu_25pct": lambda rng, s: Effects(
        slow=[(_one_gpu(rng.randrange(4), s, rng), _onset(rng), None, 0.25)]
    ),
    "node_50pct": lambda rng, s: Effects(
        slow=[(_node_ranks(rng.randrange(4), s), _onset(rng), None, 0.50)]
    ),
    "recovers": lambda rng, s: (
        lambda at: Effects(slow=[(_one_gpu(1, s, rng), at, at + 80, 0.15)])
    )(_onset(rng)),
    "two_stragglers": lambda rng, s: Effects(
        slow=[
            (_one_gpu(0, s, rng), _onset(rng), None, 0.12),
            (_node_ranks(2, s), _onset(rng), None, 0.20),
        ]
    ),
    "during_job_slowdown": lambda rng, s: Effects(
        slow=[(_one_gpu(3, s, rng), 130, None, 0.15)], job_slow=(100, 250, 1.4)
    ),
    "noisy_15pct": lambda rng, s: Effects(
        slow=[(_one_gpu(rng.randrange(4), s, rng), _onset(rng), None, 0.15)]
    ),
    "late_join_straggler": lambda rng, s: Effects(
        join={r: 120 for r in _node_ranks(3, s)}, slow=[(_one_gpu(3, s, rng), 120, None, 0.20)]
    ),
    "rank_stall": lambda rng, s: Effects(stall={rng.randrange(s.ranks): _onset(rng)}),
}
NOISY = {"noisy_15pct": {"noise": 0.06, "spike_p": 0.04}}


def build(scenario: str, seed: int, shape: JobShape | None = None) -> Trace:
    shape = shape or JobShape()
    for key, value in NOISY.get(scenario, {}).items():
        setattr(shape, key, value)
    rng = random.Random(f"effects/{scenario}/{seed}")
    return generate(scenario, seed, shape, SCENARIOS[scenario](rng, shape))
