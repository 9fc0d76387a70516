"""Feasible Policy Iteration, exact and tabular (Yang et al., "Feasible Policy
Iteration", arXiv 2304.08845): the learned safe policy's theory, checked on a finite
model of the migration decision.

The problem. A finite MDP with transitions ``P[a, x, x']``, rewards ``r[x, a]`` and a
constraint signal ``h[x]`` (a limit is broken where ``h > 0``). A policy must keep the
chance of ever breaking a limit low, and within that win as much reward as it can.

FPI measures the first with the *constraint decay function*: ``F(x) = E[gamma^N]``,
``N`` the first step at which a limit is broken (``F = 1`` where one is broken now,
``0`` where none ever will be). For a policy ``pi`` it satisfies, with
``c(x) = 1[h(x) > 0]``,

    G(x, a) = c(x) + (1 - c(x)) * gamma * sum_x' P[a, x, x'] * F(x')
    F(x) = G(x, pi(x))

and the policy's *feasible region* is ``{x : F(x) <= p}``. Each iteration evaluates
the policy (its ``Q`` and ``G``, exactly: linear solves) and improves it region by
region: inside the region it takes the action of the highest ``Q`` among those whose
``G <= p``; outside, the action of the lowest ``G`` (back towards feasibility). No
Lagrange multiplier is tuned. The paper's theorem: the feasible region never shrinks
from one iteration to the next, and inside the old region the value never falls.
``iterate`` records both, iteration by iteration, so a run shows whether they held.

The theorem is about the exact algorithm, ``p = 0``: the region is the states from
which the policy never breaks a limit, every action kept inside it leads only to
such states, so the new policy's ``F`` is at most the old one's everywhere and,
inside, improving ``Q`` is plain policy iteration on a closed set of states. With
``p > 0`` (the relaxation the reference code's networks use, ``pf = 0.1``) an action
of ``G <= p`` may lead to states outside the region, and neither half holds in
general: ``tests/unit/sim/test_fpi.py`` finds random MDPs where each fails.

``migration_mdp`` builds the finite model of one job's decision every ``tick_s``
from the simulator's data (``tmd.sim.mixes``' fail-slow episodes, ``tmd.sim.cost``'s
times): the worst straggler's slowdown and age, the ready standby pool, and the
migrations of the last hour; actions no-op, migrate the straggler's machine,
restart without it; the limits: migrations per hour and the pool's minimum.
``sim_model`` holds the simulator's numbers it is built from, which
``tmd.sim.job_env``'s richer environment samples (``tmd.sim.fpi_net`` learns there).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.float64]


@dataclass(frozen=True)
class MDP:
    """``P[a, x, x']`` (rows sum to 1), ``r[x, a]``, ``h[x]`` (> 0: a limit broken).
    ``twin[x]``, where given: the state whose action ``x`` takes (a state that only
    marks a breach decides as the same state without the mark; by default its own)."""

    P: Array
    r: Array
    h: Array
    actions: tuple[str, ...] = ()
    states: tuple[tuple[int, ...], ...] = ()
    twin: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n_a, n_x, n_y = self.P.shape
        if n_x != n_y or self.r.shape != (n_x, n_a) or self.h.shape != (n_x,):
            raise ValueError(f"shapes: P {self.P.shape}, r {self.r.shape}, h {self.h.shape}")
        if not np.allclose(self.P.sum(axis=2), 1.0):
            raise ValueError("every row of P must sum to 1")
        if self.twin and len(self.twin) != n_x:
            raise ValueError(f"twin: {len(self.twin)} states, P has {n_x}")

    def tied(self, policy: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """``policy`` with every state taking its twin's action."""
        return policy[np.asarray(self.twin)] if self.twin else policy

    @property
    def n_states(self) -> int:
        return int(self.P.shape[1])

    @property
    def n_actions(self) -> int:
        return int(self.P.shape[0])


@dataclass(frozen=True)
class Evaluation:
    """A policy's values: ``V``, ``Q[x, a]``, ``F`` and ``G[x, a]``."""

    V: Array
    Q: Array
    F: Array
    G: Array


def evaluate(mdp: MDP, policy: npt.NDArray[np.int64], gamma: float) -> Evaluation:
    """Exact policy evaluation: ``V`` and ``F`` from linear systems, then ``Q``, ``G``."""
    n = mdp.n_states
    rows = np.arange(n)
    P_pi = mdp.P[policy, rows, :]  # [x, x'] under pi
    r_pi = mdp.r[rows, policy]
    V: Array = np.linalg.solve(np.eye(n) - gamma * P_pi, r_pi).astype(np.float64)
    c = (mdp.h > 0).astype(float)
    # F = c + (1 - c) * gamma * P_pi F
    F = np.linalg.solve(np.eye(n) - ((1 - c) * gamma)[:, None] * P_pi, c)
    F = np.clip(F, 0.0, 1.0)
    next_V = np.einsum("axy,y->xa", mdp.P, V)
    next_F = np.einsum("axy,y->xa", mdp.P, F)
    Q = mdp.r + gamma * next_V
    G = c[:, None] + (1 - c)[:, None] * gamma * next_F
    return Evaluation(V, Q, F, G)


TOL = 1e-9  # the linear solves' rounding: a value this close to the threshold is on it


def improve(ev: Evaluation, p: float) -> npt.NDArray[np.int64]:
    """Region-wise improvement: inside ``{F <= p}`` the best ``Q`` of the actions whose
    ``G <= p`` (the current action is one, so there always is one); outside, the
    lowest ``G``, and of actions tied at it (a risk no action changes: failures
    outside the policy's hands) the best ``Q``."""
    bar = p + TOL
    feasible = np.less_equal(ev.F, bar)
    allowed = np.less_equal(ev.G, bar)
    inside = np.where(allowed, ev.Q, -np.inf).argmax(axis=1)
    lowest = np.less_equal(ev.G, ev.G.min(axis=1, keepdims=True) + TOL)
    outside = np.where(lowest, ev.Q, -np.inf).argmax(axis=1)
    chosen: npt.NDArray[np.int64] = np.where(feasible, inside, outside).astype(np.int64)
    return chosen


@dataclass
class Run:
    """What ``iterate`` saw, iteration by iteration."""

    policies: list[npt.NDArray[np.int64]] = field(default_factory=list)
    evaluations: list[Evaluation] = field(default_factory=list)
    region_sizes: list[int] = field(default_factory=list)
    region_monotone: bool = True  # every region contains the one before
    value_monotone: bool = True  # inside the old region, V never fell
    iterations: int = 0

    @property
    def policy(self) -> npt.NDArray[np.int64]:
        return self.policies[-1]


def iterate(
    mdp: MDP,
    *,
    p: float,
    gamma: float,
    start: npt.NDArray[np.int64] | None = None,
    max_iterations: int = 100,
    tol: float = 1e-9,
) -> Run:
    """FPI from ``start`` (default: action 0 everywhere) until the policy is stable."""
    if not (0 < gamma < 1 and 0 <= p < 1):
        raise ValueError("gamma must be in (0, 1) and p in [0, 1)")
    policy = np.zeros(mdp.n_states, dtype=np.int64) if start is None else start.copy()
    policy = mdp.tied(policy)
    run = Run()
    ev = evaluate(mdp, policy, gamma)
    run.policies.append(policy)
    run.evaluations.append(ev)
    bar = p + TOL
    run.region_sizes.append(int((np.less_equal(ev.F, bar)).sum()))
    for _ in range(max_iterations):
        nxt = improve(ev, p)
        # Keep the current action where the new one is no better: a stable policy ends
        # the run (ties would otherwise flip between equal actions for ever).
        rows = np.arange(mdp.n_states)
        inside = np.less_equal(ev.F, bar)
        same = inside & (ev.Q[rows, nxt] <= ev.Q[rows, policy] + tol)
        at_lowest = ev.G[rows, policy] <= ev.G.min(axis=1) + TOL
        same |= ~inside & at_lowest & (ev.Q[rows, nxt] <= ev.Q[rows, policy] + tol)
        nxt = mdp.tied(np.where(same, policy, nxt))
        if np.array_equal(nxt, policy):
            break
        new = evaluate(mdp, nxt, gamma)
        old_region, new_region = np.less_equal(ev.F, bar), np.less_equal(new.F, bar)
        run.region_monotone &= bool(np.all(new_region[old_region]))
        run.value_monotone &= bool(np.all(new.V[old_region] >= ev.V[old_region] - 1e-7))
        policy, ev = nxt, new
        run.policies.append(policy)
        run.evaluations.append(ev)
        run.region_sizes.append(int((np.less_equal(ev.F, bar)).sum()))
        run.iterations += 1
    return run


def lagrangian(
    mdp: MDP, *, start: int, risk: float, gamma: float, iterations: int = 20
) -> tuple[npt.NDArray[np.int64], float]:
    """The baseline FPI is measured against: the optimal policy for ``r - lambda * c``
    (``c`` a limit broken; policy iteration, exact) with the smallest ``lambda``
    (bisection) whose discounted breaches from ``start`` are at most ``risk``. One
    multiplier for the whole problem, tuned to a budget of breaches: it keeps the
    expected breaches low on average, where FPI keeps them at ``p`` state by state."""
    c = (mdp.h > 0).astype(float)
    rows = np.arange(mdp.n_states)

    def solve(lam: float) -> npt.NDArray[np.int64]:
        penalised = MDP(mdp.P, mdp.r - lam * c[:, None], np.zeros(mdp.n_states))
        chosen = np.zeros(mdp.n_states, dtype=np.int64)
        for _ in range(100):
            q = evaluate(penalised, chosen, gamma).Q
            better = q.argmax(axis=1)
            better = np.where(q[rows, better] > q[rows, chosen] + 1e-9, better, chosen)
            if np.array_equal(better, chosen):
                break
            chosen = better.astype(np.int64)
        return mdp.tied(chosen)

    def breaches(policy: npt.NDArray[np.int64]) -> float:
        P = mdp.P[policy, rows, :]
        return float(np.linalg.solve(np.eye(mdp.n_states) - gamma * P, c)[start])

    lo, hi = 0.0, 1.0
    while breaches(solve(hi)) > risk and hi < 1e6:
        hi *= 4
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if breaches(solve(mid)) <= risk else (mid, hi)
    return solve(hi), hi


def as_run(mdp: MDP, policy: npt.NDArray[np.int64], *, p: float, gamma: float) -> Run:
    """A policy trained otherwise (``lagrangian``), evaluated, in ``iterate``'s form:
    what ``export`` writes."""
    policy = mdp.tied(policy)
    ev = evaluate(mdp, policy, gamma)
    size = int(np.less_equal(ev.F, p + TOL).sum())
    return Run(policies=[policy], evaluations=[ev], region_sizes=[size])


# -- the migration decision as a finite model -------------------------------------------

ACTIONS = ("noop", "migrate", "restart")
SLOWDOWNS = (0.0, 0.075, 0.15, 0.35, 0.75)  # bucket centres: none, 5-10%, 10-20%, 20-50%, >50%
MAX_AGE = 3  # ticks; the last bucket is "this old or older"


@dataclass(frozen=True)
class Limits:
    max_per_hour: int = 2  # migrations in the last hour beyond this break the limit
    min_pool: int = 1  # ready standbys below this break it
    # The downtime the policy's own decisions may cost a job, a rolling day's worth:
    # spent by migrations, checkpoints and restarts, earned back evenly over the day
    # (up to this much); below 0 the limit is broken. Only ``tmd.sim.job_env`` has it.
    downtime_per_day_s: float = 600.0


def migration_mdp(
    *,
    episodes_per_tick: float,
    slowdown_weights: tuple[float, ...],
    recover_hazard: tuple[float, ...],
    pool: int = 2,
    refill_per_tick: float = 0.5,
    drain_per_tick: float = 0.0,
    tick_s: float = 600.0,
    live_s: float = 30.0,
    restart_s: float = 900.0,
    limits: Limits | None = None,
) -> MDP:
    """One job's decision every ``tick_s``. State ``(s, age, pool, recent, broke)``: the
    worst straggler's slowdown bucket (``SLOWDOWNS``), its age in ticks (up to
    ``MAX_AGE``), ready standbys (up to ``pool``), migrations started in the last hour
    (up to ``max_per_hour + 1``, each leaving the count with chance ``tick_s / 3600`` a
    tick), and whether a limit broke in the tick that led here (``h``). A machine
    failure the runtime fails over by itself takes a ready standby with chance
    ``drain_per_tick`` a tick: no decision, but the pool's minimum is broken all the
    same if a migration spent the spare, even where the refill comes within the tick
    (a state at the tick's end alone would hide that: with a refill a tick, the pool
    is whole again by then).

    A straggler appears with chance ``episodes_per_tick`` when there is none, with a
    slowdown bucket drawn by ``slowdown_weights`` (buckets 1..); one of age ``k`` ends
    by itself with chance ``recover_hazard[k]``. ``migrate`` replaces its machine with
    a ready standby (``live_s`` lost; the pool refills one a tick with chance
    ``refill_per_tick``); ``restart`` restarts the job without it (``restart_s``
    lost, no standby used). The reward is the tick's useful share of time: the job
    runs at ``1 / (1 + s)``."""
    lim = limits or Limits()
    n_s, n_age, n_p, n_m = len(SLOWDOWNS), MAX_AGE + 1, pool + 1, lim.max_per_hour + 2
    if len(slowdown_weights) != n_s - 1 or len(recover_hazard) != n_age:
        raise ValueError("one weight per slow bucket, one hazard per age")
    weights = np.asarray(slowdown_weights, dtype=float) / sum(slowdown_weights)
    states = [(s, a, q, m, b) for s in range(n_s) for a in range(n_age)
              for q in range(n_p) for m in range(n_m) for b in (0, 1)
              if s or not a]  # fmt: skip
    index = {x: i for i, x in enumerate(states)}
    n = len(states)
    P = np.zeros((len(ACTIONS), n, n))
    r = np.zeros((n, len(ACTIONS)))
    h = np.zeros(n)
    decay = min(1.0, tick_s / 3600)

    def spread(i: int, a: int, s: int, age: int, q: int, m: int, prob: float) -> None:
        """Add ``prob`` of the straggler part (``s``, ``age``) to the pool's drain and
        refill and the hourly count's decay; whether a limit broke within the tick
        (the pool after the drain, before the refill, or the hour's count with this
        tick's migration) is the next state's flag."""
        drained = [(q - 1, drain_per_tick), (q, 1 - drain_per_tick)] if q > 0 else [(q, 1.0)]
        for qd, pd in drained:
            broke = int(qd < lim.min_pool or m > lim.max_per_hour)
            refill = [(qd + 1, refill_per_tick), (qd, 1 - refill_per_tick)] if qd < pool \
                else [(qd, 1.0)]  # fmt: skip
            for q2, pq in refill:
                for m2, pm in binomial_decay(m, decay):
                    P[a, i, index[(s, age if s else 0, q2, m2, broke)]] += prob * pd * pq * pm

    for i, (s, age, q, m, broke) in enumerate(states):
        h[i] = float(broke)
        slow = SLOWDOWNS[s]
        for a, name in enumerate(ACTIONS):
            moved = name == "migrate" and s > 0 and q > 0
            restarted = name == "restart" and s > 0
            lost = live_s if moved else restart_s if restarted else 0.0
            running = not (moved or restarted) and s > 0  # the straggler holds it back
            r[i, a] = 1 / (1 + slow) if running else (tick_s - lost) / tick_s
            q1 = q - 1 if moved else q
            m1 = min(m + 1, n_m - 1) if moved else m
            if moved or restarted or s == 0:  # no straggler now: one may come
                spread(i, a, 0, 0, q1, m1, 1 - episodes_per_tick)
                for b, w in enumerate(weights, start=1):
                    spread(i, a, b, 0, q1, m1, episodes_per_tick * w)
            else:
                end = recover_hazard[age]
                spread(i, a, 0, 0, q1, m1, end)
                spread(i, a, s, min(age + 1, MAX_AGE), q1, m1, 1 - end)
    twin = tuple(index[(*x[:-1], 0)] for x in states)
    return MDP(P, r, h, ACTIONS, tuple(states), twin)


def binomial_decay(m: int, p: float) -> list[tuple[int, float]]:
    """Of ``m`` counted events, each leaves with chance ``p``: how many stay, and how
    likely."""
    return [(k, math.comb(m, k) * (1 - p) ** k * p ** (m - k)) for k in range(m + 1)]


@dataclass(frozen=True)
class SimModel:
    """What ``tmd sim``'s data says about one job of ``gpus`` GPUs deciding every
    ``tick_s``: the numbers ``from_sim`` discretises into the finite model and
    ``tmd.sim.job_env`` samples from. Rates are Poisson means a tick; times seconds."""

    gpus: int
    machines: int
    tick_s: float
    pool: int  # standby machines at most
    episodes_per_tick: float  # fail-slow episodes of >= 5% starting (their rate per machine)
    slowdown_log_mean: float  # lognormal fractional slowdown, cut at slowdown_max
    slowdown_log_sigma: float
    slowdown_max: float
    duration_log_mean_s: float  # lognormal episode duration, cut at duration_max_s
    duration_log_sigma: float
    duration_max_s: float
    failures_per_tick: float  # machine failures (XIDs, lost hosts): each takes a standby
    rollbacks_per_tick: float  # hangs and crashes: the job restarts from its checkpoint
    refill_per_tick: float  # chance a missing standby is provisioned within a tick
    live_s: float  # a live migration's downtime
    restart_s: float  # requeue, start-up and checkpoint load; work lost not included
    failover_s: float  # a machine failure, a standby ready: detection, downtime, work lost
    unready_s: float  # a machine failure, none ready: detection and restart (the rest lost
    # is the work since the checkpoint)
    rollback_s: float  # a hang or a crash: detection and restart (likewise)
    checkpoint_s: float  # a checkpoint's blocking pause
    checkpoint_interval_s: float  # Daly's, for the failures that roll tmd back (as tmd sim)

    def slowdown_cdf(self, x: float) -> float:
        if x >= self.slowdown_max:
            return 1.0
        return _lognormal_cdf(x, self.slowdown_log_mean, self.slowdown_log_sigma)

    def survive(self, t: float) -> float:
        """The chance an episode lasts longer than ``t`` seconds."""
        if t >= self.duration_max_s:
            return 0.0
        return 1 - _lognormal_cdf(t, self.duration_log_mean_s, self.duration_log_sigma)


SLOW_EDGES = (0.05, 0.10, 0.20, 0.50, math.inf)  # SLOWDOWNS' buckets; under 5% is none


def sim_model(
    *,
    mix: str = "llama3",
    gpus: int = 16384,
    tick_s: float = 600.0,
    pool: int = 3,
    refill_s: float | None = None,
) -> SimModel:
    """The simulator's numbers for a job of ``gpus``: fail-slow episodes
    (``tmd.sim.mixes.load_failslow``: their rate per machine, lognormal slowdowns and
    durations); the mix's machine failures (XIDs, lost hosts), which take a standby,
    and its hangs and crashes, which roll the job back; ``tmd.sim.cost`` the live
    migration, the failover, the restart (requeue, start-up, load), the checkpoint's
    pause and interval (Daly, as ``tmd sim``'s engine) and the refill (a cold
    standby's provisioning, or ``refill_s``)."""
    from tmd.sim import cost, mixes  # the simulator's data: the `sim` extra

    m = mixes.load(mix)
    fs = mixes.load_failslow()
    machines = mixes.machines_for(m, gpus)
    c = cost.at_scale(cost.load(None), gpus)
    per_tick = tick_s / mixes.SECONDS_PER_DAY

    def slowdown_cdf(x: float) -> float:
        if x >= fs.slowdown_max:
            return 1.0
        return _lognormal_cdf(x, fs.slowdown_log_mean, fs.slowdown_log_sigma)

    mass = [slowdown_cdf(hi) - slowdown_cdf(lo) for lo, hi in itertools.pairwise(SLOW_EDGES)]
    seen = sum(mass)  # slowdowns under 5% are left out: no straggler to speak of

    def share(*signals: str) -> float:
        return sum(x.weight for x in m.causes if x.signal in signals)

    def weighted(signals: tuple[str, ...], ready: bool) -> float:
        """One event's detection, downtime and work lost (``since_checkpoint_s`` 0),
        averaged over the mix's causes of ``signals``."""
        total = 0.0
        for x in m.causes:
            if x.signal in signals:
                r = cost.recovery("tmd", x.signal, c, since_checkpoint_s=0.0, standby_ready=ready)
                total += x.weight * (r.detect_s + r.downtime_s + r.lost_work_s)
        return total / max(share(*signals), 1e-12)

    lost_machines = share("xid", "node_lost")
    rollback_rate = share("hang", "crash") * m.failures_per_node_day * machines
    mtbf = mixes.SECONDS_PER_DAY / rollback_rate if rollback_rate > 0 else mixes.SECONDS_PER_DAY
    return SimModel(
        gpus=gpus,
        machines=machines,
        tick_s=tick_s,
        pool=pool,
        episodes_per_tick=machines * fs.episodes_per_node_day * per_tick * seen,
        slowdown_log_mean=fs.slowdown_log_mean,
        slowdown_log_sigma=fs.slowdown_log_sigma,
        slowdown_max=fs.slowdown_max,
        duration_log_mean_s=fs.duration_log_mean_s,
        duration_log_sigma=fs.duration_log_sigma,
        duration_max_s=fs.duration_max_s,
        failures_per_tick=machines * m.failures_per_node_day * lost_machines * per_tick,
        rollbacks_per_tick=rollback_rate * per_tick,
        refill_per_tick=min(1.0, tick_s / (refill_s or c.cold_standby_s)),
        live_s=c.live_migration_s,
        restart_s=c.requeue_s + c.restart_init_s + c.checkpoint_load_s,
        failover_s=weighted(("xid", "node_lost"), True),
        unready_s=weighted(("xid", "node_lost"), False),
        rollback_s=weighted(("hang", "crash"), True),
        checkpoint_s=c.checkpoint_blocking_s,
        checkpoint_interval_s=cost.daly(c.checkpoint_blocking_s, mtbf),
    )


def from_sim(
    *,
    mix: str = "llama3",
    gpus: int = 16384,
    tick_s: float = 600.0,
    pool: int = 3,
    limits: Limits | None = None,
    refill_s: float | None = None,
) -> MDP:
    """``migration_mdp`` with ``sim_model``'s numbers for a job of ``gpus``: the
    episodes' rate, slowdowns and durations become the arrival chance, the slowdown
    buckets' weights and the hazard of ending by age; the machine failures the pool's
    drain; the restart loses half a tick of work besides its downtime."""
    sm = sim_model(mix=mix, gpus=gpus, tick_s=tick_s, pool=pool, refill_s=refill_s)
    mass = [sm.slowdown_cdf(hi) - sm.slowdown_cdf(lo) for lo, hi in itertools.pairwise(SLOW_EDGES)]
    # Of one this many ticks old, the chance it ends within the tick (the last age
    # stands for every older one: its hazard at that age).
    hazard = tuple(
        1 - sm.survive((k + 1) * tick_s) / max(sm.survive(k * tick_s), 1e-12)
        for k in range(MAX_AGE + 1)
    )
    return migration_mdp(
        episodes_per_tick=min(1.0, 1 - math.exp(-sm.episodes_per_tick)),
        slowdown_weights=tuple(mass),
        recover_hazard=hazard,
        pool=pool,
        refill_per_tick=sm.refill_per_tick,
        drain_per_tick=min(1.0, 1 - math.exp(-sm.failures_per_tick)),
        tick_s=tick_s,
        live_s=sm.live_s,
        restart_s=sm.restart_s + tick_s / 2,
        limits=limits,
    )


def _lognormal_cdf(x: float, mu: float, sigma: float) -> float:
    if x <= 0:
        return 0.0
    return 0.5 * (1 + math.erf((math.log(x) - mu) / (sigma * math.sqrt(2))))


# -- a trained table, for the ``fpi`` policy ------------------------------------------

MODEL_VERSION = 2  # 2: F counts a limit broken within a tick; each action's G
SLOWDOWN_EDGES = (0.05, 0.10, 0.20, 0.50)  # the buckets of SLOWDOWNS: under 5% is none


ALGORITHMS = {
    "fpi": "feasible policy iteration, exact, tabular (arXiv 2304.08845)",
    "lagrangian": "Lagrangian: one multiplier on breaches, bisected to a risk budget",
}


def export(
    mdp: MDP, run: Run, *, p: float, gamma: float, about: dict[str, object],
    algorithm: str = "fpi",
) -> dict[str, object]:  # fmt: skip
    """The trained policy as the ``fpi`` policy reads it (``policies/fpi.py``): per
    state its action, ``F``, and every action's ``Q`` and ``G``; the state's buckets;
    what it was trained for (``about``: GPUs, tick, pool, limits), so it can tell a
    state outside them. The
    states are ``(s, age, pool, recent)``: a decision is taken where no limit has
    broken (the flag only marks the breach for ``F``; the moves from a state are the
    same either way)."""
    ev = run.evaluations[-1]
    kept = [i for i, x in enumerate(mdp.states) if not x[-1]]
    return {
        "version": MODEL_VERSION,
        "algorithm": ALGORITHMS[algorithm],
        "p": p,
        "gamma": gamma,
        "actions": list(mdp.actions),
        "slowdown_edges": list(SLOWDOWN_EDGES),
        "max_age": MAX_AGE,
        "states": [list(mdp.states[i][:-1]) for i in kept],
        "policy": [int(run.policy[i]) for i in kept],
        "F": [round(float(ev.F[i]), 6) + 0.0 for i in kept],  # + 0.0: no -0 from the solver
        "Q": [[round(float(q), 6) + 0.0 for q in ev.Q[i]] for i in kept],
        "G": [[round(float(g), 6) + 0.0 for g in ev.G[i]] for i in kept],
        "region_sizes": run.region_sizes,
        "region_monotone": run.region_monotone,
        **about,
    }
