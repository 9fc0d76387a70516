"""Seeded, labelled telemetry traces of data-parallel jobs, for measuring detectors.

A trace is the time-ordered stream of ``IterBatch`` messages that a job's ranks would
send, plus labels saying which machine straggled (from which step, by how much) or
which rank went silent. What a real job does is modelled where it matters to a
detector, and made as hard as real jobs are:

- every rank's step time is the slowest rank's busy time plus the all-reduce, so only
  busy time tells machines apart; the *reported* all-reduce carries measurement
  jitter (``ar_jitter``), so step minus all-reduce is the busy time plus an error;
- a job is 16 machines of 8 ranks; ranks differ a little for good (``hw_spread``);
- each rank's speed drifts slowly: an AR(1) process in log busy time with lag-one
  correlation ``rho`` and stationary standard deviation ``sigma`` (defaults 0.98 and
  5%: a rank wanders by ~5% over ~50-step stretches, as thermals and neighbours do);
  the whole job drifts too (``job_rho``, ``job_sigma``: data, network, a shared store);
- steps are noisy (``noise``) with occasional spikes (GC, page faults); every 100
  steps an evaluation pause hits all ranks; every 50 steps rank 0 writes a
  checkpoint; batches arrive on each rank's own flush phase;
- slowdowns switch on at once, ramp up (``ramp_steps``) or come and go (``on_off``);
  two machines can straggle at once.

Each straggler label carries ``z``, its *separability*: how many standard deviations
of the slow per-rank noise (``sigma`` and ``hw_spread`` together, as ``noise_of``)
the slowdown stands out by, at the better of two granularities: its slowest rank
alone (``ln(1 + s) / noise``), or its machine's mean over ``n`` ranks when ``k`` of
them are slow (``k/n * ln(1 + s) / (noise / sqrt(n))``). A single GPU 10% slower
among ranks that drift by 5% for dozens of steps at a time looks, for as long as the
drift lasts, exactly like a rank in a slow phase; no detector can tell them apart
without raising false alarms, and ``tmd bench detect`` holds the detector to the
labels that are separable.

Everything is a pure function of (scenario, seed, shape): the same trace every time.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from operator import itemgetter
from typing import Any

from tmd import wire

T0 = 1_800_000_000.0


@dataclass(frozen=True)
class Slowdown:
    """``ranks`` take ``1 + factor`` times as long from ``start`` to ``end`` (exclusive;
    None: to the end). With ``ramp_steps`` the extra grows linearly from zero (a fan
    failing, a leak); with ``on_off = (on, off)`` it holds for ``on`` steps, then
    lets go for ``off`` (thermal throttling that comes and goes)."""

    ranks: tuple[int, ...]
    start: int
    end: int | None
    factor: float
    ramp_steps: int = 0
    on_off: tuple[int, int] | None = None

    def extra(self, step: int) -> float:
        """The slowdown at ``step``: 0 when not slow, up to ``factor``."""
        if step < self.start or (self.end is not None and step >= self.end):
            return 0.0
        into = step - self.start
        if self.on_off is not None and into % sum(self.on_off) >= self.on_off[0]:
            return 0.0
        if into < self.ramp_steps:
            return self.factor * (into + 1) / self.ramp_steps
        return self.factor


@dataclass(frozen=True)
class Label:
    kind: str  # "straggler" | "stall"
    node: str
    ranks: tuple[int, ...]
    start_step: int
    end_step: int | None = None  # exclusive; None: to the end of the trace
    slowdown: float = 0.0  # the full slowdown (after a ramp, while on)
    ramp_steps: int = 0
    on_off: tuple[int, int] | None = None
    z: float = math.inf  # separability in noise standard deviations (module docstring)


@dataclass
class JobShape:
    ranks: int = 128
    ranks_per_node: int = 8
    steps: int = 400
    step_s: float = 1.0
    busy_fraction: float = 0.6
    rho: float = 0.98  # lag-one correlation of each rank's slow drift ...
    sigma: float = 0.05  # ... and its stationary standard deviation (log busy time)
    job_rho: float = 0.99  # the same for the job as a whole
    job_sigma: float = 0.10
    noise: float = 0.03  # lognormal sigma of each step's own busy time
    spike_p: float = 0.01  # chance of a 1.5-3x step on one rank
    hw_spread: float = 0.015  # per-rank static speed spread
    ar_jitter: float = 0.02  # error of the reported all-reduce, in step times
    eval_every: int = 100
    eval_s: float = 2.0
    checkpoint_every: int = 50
    checkpoint_factor: float = 3.0

    @property
    def nodes(self) -> int:
        return self.ranks // self.ranks_per_node


@dataclass
class Trace:
    scenario: str
    seed: int
    step_s: float
    steps: int
    batches: list[tuple[float, wire.IterBatch]]
    labels: list[Label] = field(default_factory=list)
    shape: JobShape = field(default_factory=JobShape)


@dataclass
class Effects:
    """What happens in one trace, besides the normal life of a job."""

    slow: list[Slowdown] = field(default_factory=list)
    job_slow: tuple[int, int, float] | None = None  # (from, to, factor) for every rank
    stall: dict[int, int] = field(default_factory=dict)  # rank -> last step it reports
    join: dict[int, int] = field(default_factory=dict)  # rank -> first step it reports


def node_of(rank: int, shape: JobShape) -> str:
    return f"node-{rank // shape.ranks_per_node:03d}"


def noise_of(shape: JobShape) -> float:
    """Standard deviation of the per-rank noise that averaging over steps cannot remove:
    the slow drift and the static hardware spread."""
    return math.hypot(shape.sigma, shape.hw_spread)


def separability(slow: Slowdown, shape: JobShape) -> float:
    """``z`` of the module docstring: at full strength, how many noise standard
    deviations the slowdown stands out by, for its slowest rank or its machine's mean."""
    noise = noise_of(shape)
    if noise == 0:
        return math.inf
    effect, n = math.log1p(slow.factor), shape.ranks_per_node
    k = min(len(slow.ranks), n)
    return max(effect / noise, k / n * effect * math.sqrt(n) / noise)


def _busy_times(rng: random.Random, shape: JobShape, effects: Effects) -> list[list[float]]:
    """Every rank's true busy time at every step, ``[step - 1][rank]``."""
    n = shape.ranks
    speed = [1 + rng.gauss(0, shape.hw_spread) for _ in range(n)]
    base = shape.step_s * shape.busy_fraction
    drift = [rng.gauss(0, shape.sigma) for _ in range(n)]  # stationary from step 1
    kick = shape.sigma * math.sqrt(1 - shape.rho**2)
    job = rng.gauss(0, shape.job_sigma)
    job_kick = shape.job_sigma * math.sqrt(1 - shape.job_rho**2)
    rho, noise, spike_p = shape.rho, shape.noise, shape.spike_p
    gauss, uniform, rand, exp = rng.gauss, rng.uniform, rng.random, math.exp
    out = []
    for step in range(1, shape.steps + 1):
        job = shape.job_rho * job + job_kick * gauss(0, 1)
        scale = base * exp(job)
        if effects.job_slow and effects.job_slow[0] <= step < effects.job_slow[1]:
            scale *= effects.job_slow[2]
        busy = []
        for r in range(n):
            d = drift[r] = rho * drift[r] + kick * gauss(0, 1)
            b = scale * speed[r] * exp(d + noise * gauss(0, 1))
            if rand() < spike_p:
                b *= uniform(1.5, 3.0)
            busy.append(b)
        for slow in effects.slow:
            extra = slow.extra(step)
            if extra:
                for r in slow.ranks:
                    busy[r] *= 1 + extra
        if shape.eval_every and step % shape.eval_every == 0:
            busy = [b + shape.eval_s for b in busy]
        if shape.checkpoint_every and step % shape.checkpoint_every == 0:
            busy[0] *= shape.checkpoint_factor
        out.append(busy)
    return out


def _timings(
    rng: random.Random, shape: JobShape, busy: list[list[float]]
) -> list[list[wire.StepTiming]]:
    """What each rank reports: the job's step time, and its all-reduce wait as measured
    (with jitter), so that step minus all-reduce is only near its busy time."""
    per_rank: list[list[wire.StepTiming]] = [[] for _ in range(shape.ranks)]
    jitter, gauss = shape.ar_jitter * shape.step_s, rng.gauss
    t = T0
    for step, row in enumerate(busy, start=1):
        step_s = max(row) + shape.step_s * 0.1
        t += step_s
        for r, b in enumerate(row):
            ar = max(0.0, step_s - b + gauss(0, jitter))
            opt, data = b * 0.08, b * 0.04
            per_rank[r].append(wire.StepTiming(step, t, step_s, b - opt - data, ar, opt, data))
    return per_rank


def _label(s: Slowdown, shape: JobShape) -> Label:
    node = node_of(s.ranks[0], shape)
    z = separability(s, shape)
    return Label("straggler", node, s.ranks, s.start, s.end, s.factor, s.ramp_steps, s.on_off, z)


def generate(scenario: str, seed: int, shape: JobShape, effects: Effects) -> Trace:
    rng = random.Random(f"{scenario}/{seed}")
    per_rank = _timings(rng, shape, _busy_times(rng, shape, effects))
    batches: list[tuple[float, wire.IterBatch]] = []
    job, rand = f"{scenario}-{seed}", rng.random
    for r, timings in enumerate(per_rank):
        phase = r / shape.ranks * shape.step_s
        first = effects.join.get(r, 1)
        last = effects.stall.get(r, shape.steps)
        node = node_of(r, shape)
        for s in timings[first - 1 : last]:
            arrival = s.end_ts + phase + 0.05 * rand()  # rng.uniform(0, 0.05), inlined
            batch = wire.IterBatch(ts=arrival, job=job, rank=r, node=node, steps=[s])
            batches.append((arrival, batch))
    batches.sort(key=itemgetter(0))
    labels = [_label(s, shape) for s in effects.slow] + [
        Label("stall", node_of(r, shape), (r,), last + 1) for r, last in effects.stall.items()
    ]
    return Trace(scenario, seed, shape.step_s, shape.steps, batches, labels, shape)


def node_ranks(node: int, shape: JobShape) -> tuple[int, ...]:
    k = shape.ranks_per_node
    return tuple(range(node * k, (node + 1) * k))


def one_gpu(node: int, shape: JobShape, rng: random.Random) -> tuple[int, ...]:
    return (node * shape.ranks_per_node + rng.randrange(shape.ranks_per_node),)


Scenario = Callable[[random.Random, JobShape], Effects]


def _onset(rng: random.Random) -> int:
    return rng.randrange(60, 200)


def _node(rng: random.Random, s: JobShape, factor: float, ramp_steps: int = 0) -> Effects:
    ranks = node_ranks(rng.randrange(s.nodes), s)
    return Effects(slow=[Slowdown(ranks, _onset(rng), None, factor, ramp_steps)])


def _gpu(rng: random.Random, s: JobShape, factor: float, ramp_steps: int = 0) -> Effects:
    ranks = one_gpu(rng.randrange(s.nodes), s, rng)
    return Effects(slow=[Slowdown(ranks, _onset(rng), None, factor, ramp_steps)])


def _intermittent(rng: random.Random, s: JobShape) -> Effects:
    ranks = node_ranks(rng.randrange(s.nodes), s)
    return Effects(slow=[Slowdown(ranks, _onset(rng), None, 0.25, on_off=(40, 20))])


def _recovers(rng: random.Random, s: JobShape) -> Effects:
    at = _onset(rng)
    return Effects(slow=[Slowdown(node_ranks(rng.randrange(s.nodes), s), at, at + 80, 0.15)])


def _two(rng: random.Random, s: JobShape) -> Effects:
    a, b = rng.sample(range(s.nodes), 2)  # two different machines
    return Effects(
        slow=[
            Slowdown(one_gpu(a, s, rng), _onset(rng), None, 0.50),
            Slowdown(node_ranks(b, s), _onset(rng), None, 0.15),
        ]
    )


def _second(rng: random.Random, s: JobShape) -> Effects:
    """A job that already has a straggler (30% slower from early on, found and not yet
    moved) meets a second: it must be found as fast as the first."""
    a, b = rng.sample(range(s.nodes), 2)
    return Effects(
        slow=[
            Slowdown(node_ranks(a, s), 30, None, 0.30),
            Slowdown(node_ranks(b, s), rng.randrange(150, 250), None, 0.15),
        ]
    )


def _intermittent_long(rng: random.Random, s: JobShape) -> Effects:
    """Slow for 30 steps, normal for 40, again and again: calm for longer than a
    window between slow stretches. One finding, kept while the cycle lasts."""
    ranks = node_ranks(rng.randrange(s.nodes), s)
    return Effects(slow=[Slowdown(ranks, _onset(rng) - 40, None, 0.25, on_off=(30, 40))])


def _late_join_straggler(rng: random.Random, s: JobShape) -> Effects:
    ranks = node_ranks(rng.randrange(s.nodes), s)
    return Effects(join={r: 120 for r in ranks}, slow=[Slowdown(ranks, 120, None, 0.20)])


SCENARIOS: dict[str, Scenario] = {
    "clean": lambda rng, s: Effects(),
    "clean_job_slowdown": lambda rng, s: Effects(job_slow=(120, 220, 1.3)),
    "clean_late_join": lambda rng, s: Effects(join={r: 150 for r in node_ranks(3, s)}),
    "node_10pct": lambda rng, s: _node(rng, s, 0.10),
    "node_50pct": lambda rng, s: _node(rng, s, 0.50),
    "node_ramp": lambda rng, s: _node(rng, s, 0.20, ramp_steps=100),
    "node_intermittent": _intermittent,
    "gpu_10pct": lambda rng, s: _gpu(rng, s, 0.10),
    "gpu_25pct": lambda rng, s: _gpu(rng, s, 0.25),
    "gpu_50pct": lambda rng, s: _gpu(rng, s, 0.50),
    "gpu_ramp": lambda rng, s: _gpu(rng, s, 0.50, ramp_steps=150),
    "recovers": _recovers,
    "two_stragglers": _two,
    "during_job_slowdown": lambda rng, s: Effects(
        slow=[Slowdown(node_ranks(rng.randrange(s.nodes), s), 130, None, 0.15)],
        job_slow=(100, 250, 1.4),
    ),
    "noisy_15pct": lambda rng, s: _node(rng, s, 0.15),
    "late_join_straggler": _late_join_straggler,
    "second_straggler": _second,
    "intermittent_long": _intermittent_long,
    "rank_stall": lambda rng, s: Effects(stall={rng.randrange(s.ranks): _onset(rng)}),
}
NOISY: dict[str, dict[str, Any]] = {"noisy_15pct": {"noise": 0.06, "spike_p": 0.04}}


def build(scenario: str, seed: int, shape: JobShape | None = None) -> Trace:
    shape = replace(shape or JobShape(), **NOISY.get(scenario, {}))
    rng = random.Random(f"effects/{scenario}/{seed}")
    return generate(scenario, seed, shape, SCENARIOS[scenario](rng, shape))
