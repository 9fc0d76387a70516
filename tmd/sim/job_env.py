"""One job's migration decision as an environment: richer than ``tmd.sim.fpi``'s finite
model, vectorised in numpy over ``B`` copies, for the network variant of Feasible
Policy Iteration (``tmd.sim.fpi_net``) and for rolling out any policy on held-out seeds.

Its numbers are ``tmd.sim.fpi.sim_model``'s, the ones the finite model is built from:
fail-slow episodes (a Poisson number of episodes of at least 5% a tick, lognormal
slowdowns and durations); machine failures, each failed over onto a ready standby or,
with none ready, a restart from the checkpoint; hangs and crashes, a restart from the
checkpoint; the pool's refill; the live migration, restart and checkpoint times. Every
tick a policy sees an ``Obs`` (``FEATURES``, normalised, for a network) and picks one of
``ACTIONS``:

- ``noop``;
- ``migrate_1``, ``migrate_2``: replace the machine of the worst or the second-worst
  straggler (the top two candidates) by a ready standby, ``live_s`` of downtime;
- ``checkpoint``: checkpoint now, ``checkpoint_s`` of pause (the job also checkpoints
  by itself every ``checkpoint_interval_s``);
- ``restart``: restart the job without the worst straggler's machine: ``restart_s``
  of downtime and the work since the last checkpoint lost; no standby used.

The reward is the tick's useful share of time: the job runs at ``1 / (1 + s)`` while
the worst straggler it still has is ``s`` slower, and the downtime and lost work of
the tick's decision and failures come off (a tick can end below 0). A limit of
``tmd.sim.fpi.Limits`` is broken (``LIMITS``) when the tick's migrations and those of
the hour before it exceed ``max_per_hour``, when at any point of the tick fewer than
``min_pool`` standbys are ready (a standby spent or failed over onto now is back one
tick later at the earliest), or when the downtime budget is below 0: a bucket of
``downtime_per_day_s`` that the policy's decisions spend and a day refills (failures
cost goodput, not budget).

Not modelled: a health flag (a machine with a pending GPU fault): no source gives how
often a warning precedes a failure, so there is no state to learn it from; episodes
begin at a tick's end; more than two concurrent stragglers (a third, slower one takes
the place of the lesser). Seeds: training draws from ``TRAIN_SEEDS``, evaluation from
``HELD_OUT`` on; ``evaluate`` refuses a training seed. A seed fixes every outside
event of its copy, whatever the policy does, so policies meet the same stragglers and
failures.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tmd.sim import fpi
from tmd.sim.mixes import SECONDS_PER_DAY

Array = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]

ACTIONS = ("noop", "migrate_1", "migrate_2", "checkpoint", "restart")
FEATURES = ("slowdown_1", "slowdown_2", "age_1", "pool", "recent", "budget", "since_checkpoint")
LIMITS = ("migrations_per_hour", "min_pool", "downtime_budget")
K = 2  # candidates: the worst stragglers a policy can name
AGE_CAP = 6  # ticks: older looks the same to a network
MAX_FAILURES = 3  # a tick's machine failures beyond this are not drawn (chance ~1e-5)
TRAIN_SEEDS = range(0, 1000)
HELD_OUT = 1000  # evaluation seeds start here


def held_out(n: int) -> range:
    return range(HELD_OUT, HELD_OUT + n)


@dataclass(frozen=True)
class Obs:
    """What a policy sees of ``B`` copies: stragglers worst first (0: none)."""

    slowdown: Array  # [B, K]
    age: Ints  # [B, K] ticks
    pool: Ints  # [B] ready standbys
    recent: Ints  # [B] migrations of the hour that still count for this tick
    budget_s: Array  # [B] downtime budget left
    since_checkpoint_s: Array  # [B]
    features: Array  # [B, len(FEATURES)], each about within [0, 1]


Policy = Callable[[Obs], Ints]


@dataclass(frozen=True)
class Step:
    reward: Array  # [B] the tick's useful share of time
    breach: npt.NDArray[np.bool_]  # [B, len(LIMITS)]
    migrated: npt.NDArray[np.bool_]  # [B] a migration took place
    restarted: npt.NDArray[np.bool_]
    checkpointed: npt.NDArray[np.bool_]


@dataclass(frozen=True)
class Outside:
    """Every outside event of ``B`` copies over ``ticks``, drawn per seed up front."""

    arrivals: Ints  # [T, B] episodes starting
    slowdown: Array  # [T, B, K] theirs
    duration_s: Array  # [T, B, K]
    failures: Ints  # [T, B] machine failures
    failure_u: Array  # [T, B, MAX_FAILURES] where in the checkpoint interval each falls
    rollbacks: Ints  # [T, B] hangs and crashes
    rollback_u: Array  # [T, B]
    refill_u: Array  # [T, B]

    @classmethod
    def draw(cls, sm: fpi.SimModel, seeds: Sequence[int], ticks: int) -> Outside:
        slow, dur = _quantiles(sm)
        per_seed = []
        for seed in seeds:
            rng = np.random.default_rng(seed)
            per_seed.append((
                rng.poisson(sm.episodes_per_tick, ticks),
                slow(rng.random((ticks, K))),
                dur(rng.random((ticks, K))),
                np.minimum(rng.poisson(sm.failures_per_tick, ticks), MAX_FAILURES),
                rng.random((ticks, MAX_FAILURES)),
                rng.poisson(sm.rollbacks_per_tick, ticks),
                rng.random(ticks),
                rng.random(ticks),
            ))  # fmt: skip
        return cls(*(np.stack(parts, axis=1) for parts in zip(*per_seed, strict=True)))


def _quantiles(sm: fpi.SimModel) -> tuple[Callable[[Array], Array], Callable[[Array], Array]]:
    """Inverse CDFs, by table, of the episodes' slowdown (at least 5%) and duration."""
    xs = np.geomspace(fpi.SLOW_EDGES[0], sm.slowdown_max, 2049)
    fx = np.array([sm.slowdown_cdf(x) for x in xs[:-1]] + [1.0])
    ts = np.geomspace(1.0, sm.duration_max_s, 2049)
    ft = np.array([1 - sm.survive(t) for t in ts[:-1]] + [1.0])
    lo = fx[0]
    return (lambda u: np.interp(lo + u * (1 - lo), fx, xs)), (lambda u: np.interp(u, ft, ts))


class JobEnv:
    """``B`` copies of the job, one per seed of ``outside``; ``step`` advances a tick."""

    def __init__(self, sm: fpi.SimModel, limits: fpi.Limits, outside: Outside) -> None:
        self.sm, self.limits, self.outside = sm, limits, outside
        self.B = int(outside.arrivals.shape[1])
        self.window = max(1, round(3600 / sm.tick_s)) - 1  # earlier ticks of the hour
        self.earn_s = limits.downtime_per_day_s * sm.tick_s / SECONDS_PER_DAY
        self.reset()

    def reset(self, rng: np.random.Generator | None = None) -> Obs:
        """Every copy to the start (no straggler, the pool full, nothing spent), or,
        with ``rng``, to a random state (training: to see states a policy rarely
        reaches)."""
        B, sm, lim = self.B, self.sm, self.limits
        if rng is None:  # a random state keeps the clock: the outside events go on
            self.t = 0
        self.slow, self.left_s = np.zeros((B, K)), np.zeros((B, K))
        self.age = np.zeros((B, K), dtype=np.int64)
        self.pool = np.full(B, sm.pool, dtype=np.int64)
        self.moves = np.zeros((B, self.window), dtype=np.int64)  # per earlier tick
        self.budget_s = np.full(B, float(lim.downtime_per_day_s))
        self.since_s = np.zeros(B)
        if rng is not None:
            slow, dur = _quantiles(sm)
            on = rng.random((B, K)) < 0.6
            self.slow = np.where(on, slow(rng.random((B, K))), 0.0)
            self.left_s = np.where(on, dur(rng.random((B, K))), 0.0)
            self.age = np.where(on, rng.integers(0, 4, (B, K)), 0)
            self.pool = rng.integers(0, sm.pool + 1, B)
            if self.window:
                self.moves[:, -1] = rng.integers(0, lim.max_per_hour + 2, B)
            self.budget_s = rng.uniform(-0.1, 1.0, B) * lim.downtime_per_day_s
            self.since_s = rng.uniform(0, sm.checkpoint_interval_s, B)
            self._sort()
        return self.observe()

    def observe(self) -> Obs:
        sm, lim = self.sm, self.limits
        recent = self.moves.sum(axis=1)
        s = self.slow
        features = np.column_stack([
            s[:, 0] / (1 + s[:, 0]), s[:, 1] / (1 + s[:, 1]),
            np.minimum(self.age[:, 0], AGE_CAP) / AGE_CAP, self.pool / sm.pool,
            recent / (lim.max_per_hour + 1),
            np.clip(self.budget_s / lim.downtime_per_day_s, -1.0, 1.0),
            self.since_s / sm.checkpoint_interval_s,
        ])  # fmt: skip
        return Obs(s.copy(), self.age.copy(), self.pool.copy(), recent, self.budget_s.copy(),
                   self.since_s.copy(), features)  # fmt: skip

    def step(self, actions: Ints) -> Step:
        sm, lim, out, t, rows = self.sm, self.limits, self.outside, self.t, np.arange(self.B)
        T = sm.tick_s
        # The decision, at the tick's start.
        slot = np.where(actions == 2, 1, 0)
        moved = np.isin(actions, (1, 2)) & (self.slow[rows, slot] > 0) & (self.pool > 0)
        restarted, checkpointed = actions == 4, actions == 3
        down = moved * sm.live_s + checkpointed * sm.checkpoint_s + restarted * sm.restart_s
        lost = np.where(restarted, self.since_s, 0.0)
        self.slow[rows, slot] = np.where(moved, 0.0, self.slow[rows, slot])
        self.slow[:, 0] = np.where(restarted, 0.0, self.slow[:, 0])
        self.left_s = np.where(self.slow > 0, self.left_s, 0.0)
        self._sort()
        self.since_s = np.where(restarted | checkpointed, 0.0, self.since_s)
        self.pool -= moved
        self.budget_s -= down
        # The tick: the worst straggler still there sets the pace until it ends.
        e0, e1 = np.minimum(self.left_s[:, 0], T), np.minimum(self.left_s[:, 1], T)
        running = (e0 / (1 + self.slow[:, 0]) + np.maximum(e1 - e0, 0) / (1 + self.slow[:, 1])
                   + T - np.maximum(e0, e1))  # fmt: skip
        useful = running * (T - np.minimum(down, T)) / T - lost
        interval = sm.checkpoint_interval_s
        for j in range(MAX_FAILURES):
            hit = out.failures[t] > j
            ready = hit & (self.pool > 0)
            self.pool -= ready
            unready = sm.unready_s + out.failure_u[t, :, j] * interval
            useful -= np.where(ready, sm.failover_s, np.where(hit, unready, 0.0))
        useful -= out.rollbacks[t] * (sm.rollback_s + out.rollback_u[t] * interval)
        recent = self.moves.sum(axis=1) + moved
        breach = np.column_stack(
            [recent > lim.max_per_hour, self.pool < lim.min_pool, self.budget_s < 0]
        )
        # The tick's end: episodes end and begin, the pool refills, the hour moves on.
        self.left_s = np.maximum(self.left_s - T, 0.0)
        self.age = np.where(self.left_s > 0, self.age + 1, 0)
        self.slow = np.where(self.left_s > 0, self.slow, 0.0)
        for j in range(K):
            new = (out.arrivals[t] > j) & (out.slowdown[t, :, j] > self.slow[:, -1])
            self.slow[:, -1] = np.where(new, out.slowdown[t, :, j], self.slow[:, -1])
            self.left_s[:, -1] = np.where(new, out.duration_s[t, :, j], self.left_s[:, -1])
            self.age[:, -1] = np.where(new, 0, self.age[:, -1])
            self._sort()
        self.pool += (self.pool < sm.pool) & (out.refill_u[t] < sm.refill_per_tick)
        if self.window:
            self.moves = np.column_stack([self.moves[:, 1:], moved])
        self.budget_s = np.minimum(self.budget_s + self.earn_s, lim.downtime_per_day_s)
        self.since_s = (self.since_s + T) % interval
        self.t += 1
        return Step(useful / T, breach, moved, restarted, checkpointed)

    def _sort(self) -> None:
        order = np.argsort(-self.slow, axis=1, kind="stable")
        self.slow = np.take_along_axis(self.slow, order, axis=1)
        self.left_s = np.take_along_axis(self.left_s, order, axis=1)
        self.age = np.take_along_axis(self.age, order, axis=1)


# -- the finite model's policies, acting here -------------------------------------------


def table_policy(mdp: fpi.MDP, table: Ints, limits: fpi.Limits) -> Policy:
    """A policy of ``fpi.migration_mdp``'s states acting in the environment: the state
    projected onto the model's (the worst straggler's slowdown bucket and age, the
    pool, the hour's migrations, each capped at the model's largest), its ``migrate``
    the worst straggler's, its ``restart`` the restart; it never checkpoints."""
    n_s, n_age = len(fpi.SLOWDOWNS), fpi.MAX_AGE + 1
    n_p = 1 + max(x[2] for x in mdp.states)
    n_m = limits.max_per_hour + 2
    lookup = np.zeros((n_s, n_age, n_p, n_m, 2), dtype=np.int64)
    to_env = np.array([ACTIONS.index(a) for a in ("noop", "migrate_1", "restart")])
    assert mdp.actions == fpi.ACTIONS
    for x, a in zip(mdp.states, table, strict=True):
        lookup[x] = to_env[a]

    def act(obs: Obs) -> Ints:
        s = np.searchsorted(fpi.SLOWDOWN_EDGES, obs.slowdown[:, 0], side="right")
        age = np.where(s > 0, np.minimum(obs.age[:, 0], fpi.MAX_AGE), 0)
        # No limit broken: the state a decision is taken in (the flag marks breaches).
        x = (s, age, np.minimum(obs.pool, n_p - 1), np.minimum(obs.recent, n_m - 1),
             np.zeros_like(s))  # fmt: skip
        chosen: Ints = lookup[x]
        return chosen

    return act


def constant(action: str) -> Policy:
    a = ACTIONS.index(action)
    return lambda obs: np.full(len(obs.pool), a, dtype=np.int64)


# -- evaluation -------------------------------------------------------------------------


def evaluate(
    policies: Mapping[str, Policy],
    sm: fpi.SimModel,
    limits: fpi.Limits,
    *,
    days: float,
    seeds: Sequence[int],
) -> dict[str, dict[str, Any]]:
    """Each policy for ``days`` from the start state on each of ``seeds`` (held out:
    a training seed is refused), all meeting the same outside events: ticks in breach
    of any limit (``violations``) and of each, the job's useful GPU-hours,
    migrations, restarts, checkpoints, and decisions (those three) per day."""
    if not seeds or any(s in TRAIN_SEEDS for s in seeds):
        raise ValueError(f"evaluation seeds must be held out: {HELD_OUT} and up")
    ticks = max(1, round(days * SECONDS_PER_DAY / sm.tick_s))
    outside = Outside.draw(sm, seeds, ticks)
    result: dict[str, dict[str, Any]] = {}
    for name, policy in policies.items():
        env = JobEnv(sm, limits, outside)
        obs = env.observe()
        useful, breach = 0.0, np.zeros(len(LIMITS), dtype=np.int64)
        any_breach = moves = restarts = checkpoints = 0
        for _ in range(ticks):
            step = env.step(policy(obs))
            obs = env.observe()
            useful += float(step.reward.sum())
            breach += step.breach.sum(axis=0)
            any_breach += int(step.breach.any(axis=1).sum())
            moves += int(step.migrated.sum())
            restarts += int(step.restarted.sum())
            checkpoints += int(step.checkpointed.sum())
        total_days = ticks * sm.tick_s / SECONDS_PER_DAY * len(seeds)
        result[name] = {
            "violations": any_breach,
            "violations_by_limit": dict(zip(LIMITS, (int(b) for b in breach), strict=True)),
            "goodput_gpu_h": round(useful * sm.tick_s * sm.gpus / 3600, 1),
            "migrations": moves,
            "restarts": restarts,
            "checkpoints": checkpoints,
            "decisions_per_day": round((moves + restarts + checkpoints) / total_days, 2),
        }
    return result
