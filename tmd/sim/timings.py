"""Step timings of the window's ranks, chunk by chunk: ``tmd.tools.traces``' model of a
data-parallel job (the one ``tmd bench detect`` holds the detectors to), in numpy so
that weeks of a job's steps cost seconds, and carried over from chunk to chunk (each
rank's slow drift and static speed persist, as on a real machine).

Per step: the job drifts (AR(1), ``job_rho``/``job_sigma``), each rank drifts
(``rho``/``sigma``) around its static speed (``hw_spread``), each step is noisy
(``noise``) with occasional spikes (``spike_p``, 1.5-3x); a slow machine's ranks take
``1 + s`` times as long. Every rank's step time is the slowest busy time plus a
tenth of a step (the all-reduce); the all-reduce each rank reports is what it
waited, with jitter (``ar_jitter``). Evaluation and checkpoint pauses are left out:
the simulation charges checkpoints itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from tmd import wire
from tmd.tools.traces import JobShape


class Timings:
    def __init__(self, shape: JobShape, seed: str) -> None:
        self.shape = shape
        self.rng = np.random.default_rng(list(seed.encode()))
        n = shape.ranks
        self.speed = 1 + self.rng.normal(0, shape.hw_spread, n)
        self.drift = self.rng.normal(0, shape.sigma, n)  # stationary from the start
        self.job = float(self.rng.normal(0, shape.job_sigma))

    def chunk(
        self, steps: int, *, first: int, t0: float, slow: Mapping[int, tuple[float, int]]
    ) -> list[list[wire.StepTiming]]:
        """``steps`` steps from step ``first``, the first ending one step after ``t0``;
        ``slow``: rank -> (its slowdown, the first of these steps it holds for, counted
        from 0). Returns ``[rank][step]``."""
        s, rng, n = self.shape, self.rng, self.shape.ranks
        kick = s.sigma * math.sqrt(1 - s.rho**2)
        job_kick = s.job_sigma * math.sqrt(1 - s.job_rho**2)
        factor = np.ones((steps, n))
        for rank, (slowdown, since) in slow.items():
            factor[max(0, since) :, rank] = 1 + slowdown
        busy = np.empty((steps, n))
        base = s.step_s * s.busy_fraction
        for i in range(steps):
            self.job = s.job_rho * self.job + job_kick * float(rng.normal())
            self.drift = s.rho * self.drift + kick * rng.normal(size=n)
            busy[i] = (
                base
                * math.exp(self.job)
                * self.speed
                * np.exp(self.drift + s.noise * rng.normal(size=n))
            )
        spikes = rng.random((steps, n)) < s.spike_p
        busy[spikes] *= rng.uniform(1.5, 3.0, int(spikes.sum()))
        busy *= factor
        step_s = busy.max(axis=1) + s.step_s * 0.1
        end = t0 + np.cumsum(step_s)
        ar = np.maximum(
            0.0, step_s[:, None] - busy + rng.normal(0, s.ar_jitter * s.step_s, busy.shape)
        )
        opt, data = busy * 0.08, busy * 0.04
        compute = busy - opt - data
        ends, step_list = end.tolist(), step_s.tolist()
        out = []
        for r in range(n):
            rows = zip(ends, step_list, compute[:, r].tolist(), ar[:, r].tolist(),
                       opt[:, r].tolist(), data[:, r].tolist(), strict=True)  # fmt: skip
            out.append([wire.StepTiming(first + i, *row) for i, row in enumerate(rows)])
        return out
