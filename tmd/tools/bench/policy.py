"""``tmd bench policy``: the learned safe policy against the rebalance threshold policy
and a Lagrangian one, on the finite model of the migration decision and in a richer
environment, where a network variant of the learned policy runs too.

The model (``tmd.sim.fpi.from_sim``): one job of ``--gpus`` GPUs deciding every
``--tick-s`` from ``tmd sim``'s data (fail-slow episodes, machine failures that
drain the standby pool, the cost model's migration, restart and refill times), with
the limits of ``tmd.sim.fpi.Limits`` (migrations per hour, the pool's minimum).

Three policies, each a table over the model's states:

- ``fpi``: Feasible Policy Iteration (``tmd.sim.fpi.iterate``, exact, ``--p``),
  started from the policy that always migrates (which breaks the limits), so the
  feasible region has to grow;
- ``rebalance``: what ``policies/rebalance.py`` and the guardrails do, as a table:
  migrate a straggler of at least 10% once it has lasted a tick, if a standby beyond
  the pool's minimum is ready and the hour's migrations are under the limit;
- ``lagrangian``: the best policy for reward minus ``lambda`` per tick in breach of
  a limit (policy iteration), ``lambda`` found by bisection as the smallest whose
  discounted breaches from the start state are at most ``--risk``.

Each is rolled out on the model for ``--days`` per seed on held-out seeds (the
training is exact and uses none), counting the ticks in breach of a limit
(``violations``), the job's useful GPU-hours (``goodput_gpu_h``), migrations and
decisions per day. ``feasible_region_monotone``: whether FPI's region grew at every
iteration (``region_sizes``) with the value inside it never falling.

``env``: the same tables in ``tmd.sim.job_env`` (the same data, but continuous
slowdowns, two candidate stragglers, the time since the checkpoint, a rolling daily
downtime budget as a third limit, failures with and without a ready standby), their
state projected onto the model's; with them ``noop`` and ``always_migrate`` for
scale, and ``fpi_net``, FPI's network variant (``tmd.sim.fpi_net``, trained here on
the environment's training seeds, ``net_train_s`` CPU seconds; ``--no-net`` skips
it). All roll out ``--days`` on each of the held-out seeds, meeting the same
stragglers and failures; per policy the ticks in breach (and per limit), goodput,
migrations, restarts, checkpoints and decisions per day. ``--plot`` draws FPI's
feasible region per iteration and the network's feasible share per epoch.

What it is not: the policies run on the model and the environment, not on
``tmd sim``'s engine with the real daemon; the environment is ours, built from the
same published rates as the model, not a trace; the network is trained once, on
one seed, so how much it varies from one training to the next is not measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from tmd.sim import fpi, job_env
from tmd.sim.mixes import SECONDS_PER_DAY
from tmd.tools.bench import Progress
from tmd.tools.bench.measure import Load

GAMMA = 0.99
HELD_OUT = 1000  # rollout seeds start here; nothing was tuned on any


def rebalance_table(mdp: fpi.MDP, limits: fpi.Limits) -> npt.NDArray[np.int64]:
    migrate, noop = fpi.ACTIONS.index("migrate"), fpi.ACTIONS.index("noop")
    out = np.full(mdp.n_states, noop, dtype=np.int64)
    for i, (s, age, pool, recent, _) in enumerate(mdp.states):
        slow_enough = fpi.SLOWDOWNS[s] >= 0.10 and age >= 1
        if slow_enough and pool > limits.min_pool and recent < limits.max_per_hour:
            out[i] = migrate
    return out


def rollout(
    mdp: fpi.MDP, policy: npt.NDArray[np.int64], *, start: int, ticks: int, seed: int
) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    cum = np.cumsum(mdp.P, axis=2)
    x, breach, moves, restarts, reward = start, 0, 0, 0, 0.0
    migrate, restart = fpi.ACTIONS.index("migrate"), fpi.ACTIONS.index("restart")
    for _ in range(ticks):
        a = int(policy[x])
        moves += a == migrate and mdp.states[x][0] > 0 and mdp.states[x][2] > 0
        restarts += a == restart and mdp.states[x][0] > 0
        reward += float(mdp.r[x, a])
        x = int(np.searchsorted(cum[a, x], rng.random(), side="right"))
        x = min(x, mdp.n_states - 1)
        breach += bool(mdp.h[x] > 0)
    return {"violations": breach, "migrations": moves, "restarts": restarts, "reward": reward}


def run(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    limits = fpi.Limits(max_per_hour=args.max_per_hour, min_pool=args.min_pool,
                        downtime_per_day_s=args.downtime_per_day_s)  # fmt: skip
    mdp = fpi.from_sim(mix=args.mix, gpus=args.gpus, tick_s=args.tick_s, pool=args.pool,
                       limits=limits, refill_s=args.refill_s)  # fmt: skip
    start = mdp.states.index((0, 0, args.pool, 0, 0))
    t0 = time.process_time()
    always = np.full(mdp.n_states, fpi.ACTIONS.index("migrate"), dtype=np.int64)
    trained = fpi.iterate(mdp, p=args.p, gamma=GAMMA, start=always)
    fpi_s = time.process_time() - t0
    progress.say(f"fpi: {trained.iterations} iterations, regions {trained.region_sizes}")
    t0 = time.process_time()
    lagrangian, lam = fpi.lagrangian(mdp, start=start, risk=args.risk, gamma=GAMMA)
    lagrangian_s = time.process_time() - t0
    tables = {"fpi": trained.policy, "rebalance": rebalance_table(mdp, limits),
              "lagrangian": lagrangian}  # fmt: skip
    ticks = int(args.days * SECONDS_PER_DAY / args.tick_s)
    seeds = range(HELD_OUT, HELD_OUT + args.seeds)
    out: dict[str, Any] = {}
    for name, table in tables.items():
        progress.say(f"rolling out {name}")
        runs = [rollout(mdp, table, start=start, ticks=ticks, seed=s) for s in seeds]
        days = args.days * len(runs)
        useful_h = sum(r["reward"] for r in runs) * args.tick_s * args.gpus / 3600
        decisions = sum(r["migrations"] + r["restarts"] for r in runs)
        out[name] = {
            "violations": sum(r["violations"] for r in runs),
            "goodput_gpu_h": round(useful_h, 1),
            "migrations": sum(r["migrations"] for r in runs),
            "decisions_per_day": round(decisions / days, 2),
        }
    out.update(
        feasible_region_monotone=trained.region_monotone,
        value_monotone=trained.value_monotone,
        region_sizes=trained.region_sizes,
        states=mdp.n_states,
        lagrangian_lambda=round(lam, 4),
        train_s=round(fpi_s, 3),
        lagrangian_train_s=round(lagrangian_s, 3),
        p=args.p, risk=args.risk, gpus=args.gpus, tick_s=args.tick_s, pool=args.pool,
        limits={"max_per_hour": limits.max_per_hour, "min_pool": limits.min_pool},
        seeds=f"{seeds.start}..{seeds.stop - 1}", days_per_seed=args.days,
    )  # fmt: skip
    out["env"], net_share = in_env(args, mdp, tables, limits, progress)
    if args.plot:
        plot(args.plot, trained.region_sizes, mdp.n_states, net_share)
    return out


def in_env(
    args: argparse.Namespace,
    mdp: fpi.MDP,
    tables: dict[str, npt.NDArray[np.int64]],
    limits: fpi.Limits,
    progress: Progress,
) -> tuple[dict[str, Any], list[float]]:
    """The tables, the two constant policies and the network variant in
    ``job_env``, on its held-out seeds; and the network's feasible share per epoch."""
    sm = fpi.sim_model(mix=args.mix, gpus=args.gpus, tick_s=args.tick_s, pool=args.pool,
                       refill_s=args.refill_s)  # fmt: skip
    policies = {name: job_env.table_policy(mdp, t, limits) for name, t in tables.items()}
    policies.update(noop=job_env.constant("noop"), always_migrate=job_env.constant("migrate_1"))
    net_s, updates, share = None, None, list[float]()
    if not args.no_net:
        from tmd.sim import fpi_net  # torch: only when asked for

        config = fpi_net.NetConfig()
        config = replace(config, updates=args.net_updates or config.updates)
        progress.say(f"training fpi_net ({config.updates} updates)")
        net = fpi_net.train(sm, limits, config)
        policies["fpi_net"] = net.policy()
        net_s, updates, share = round(net.train_s, 1), config.updates, net.feasible_share
    progress.say("rolling out in the environment")
    seeds = job_env.held_out(args.seeds)
    env: dict[str, Any] = job_env.evaluate(policies, sm, limits, days=args.days, seeds=seeds)
    train = job_env.TRAIN_SEEDS
    env.update(
        net_train_s=net_s, net_updates=updates,
        net_feasible_share=share, seeds=f"{seeds.start}..{seeds.stop - 1}",
        train_seeds=f"{train.start}..{train.stop - 1}", days_per_seed=args.days,
        actions=list(job_env.ACTIONS), features=list(job_env.FEATURES),
        limits={"max_per_hour": limits.max_per_hour, "min_pool": limits.min_pool,
                "downtime_per_day_s": limits.downtime_per_day_s},
        checkpoint_interval_s=round(sm.checkpoint_interval_s, 1),
    )  # fmt: skip
    return env, share


def plot(path: str, region_sizes: list[int], states: int, net_share: list[float]) -> None:
    """FPI's feasible region per iteration and, if trained, the network's feasible
    share of the states it was trained on, per epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2 if net_share else 1, figsize=(10 if net_share else 5, 3.5),
                             squeeze=False)  # fmt: skip
    ax = axes[0][0]
    ax.plot(range(len(region_sizes)), region_sizes, marker="o")
    ax.set(xlabel="iteration", ylabel=f"feasible states (of {states})",
           title="tabular FPI: feasible region")  # fmt: skip
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if net_share:
        ax = axes[0][1]
        ax.plot(range(1, len(net_share) + 1), net_share, marker="o")
        ax.set(xlabel="epoch", ylabel="share with G <= pf", ylim=(0, 1),
               title="fpi_net: feasible share of replayed states")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tmd bench policy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--gpus", type=int, default=16384)
    p.add_argument("--mix", default="llama3")
    p.add_argument("--tick-s", type=float, default=600.0, help="decision interval")
    p.add_argument("--pool", type=int, default=3, help="standby machines at most")
    p.add_argument("--refill-s", type=float, default=None,
                   help="a new standby's provisioning (default: the cost model's)")  # fmt: skip
    p.add_argument("--max-per-hour", type=int, default=2)
    p.add_argument("--min-pool", type=int, default=1)
    p.add_argument("--p", type=float, default=0.0, help="FPI's feasibility threshold")
    p.add_argument("--risk", type=float, default=0.01,
                   help="the Lagrangian's bound on discounted breaches")  # fmt: skip
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--days", type=float, default=54.0, help="per rollout seed")
    p.add_argument("--downtime-per-day-s", type=float, default=fpi.Limits.downtime_per_day_s,
                   help="the environment's downtime budget: a rolling day's")  # fmt: skip
    p.add_argument("--no-net", action="store_true", help="skip the network variant (torch)")
    p.add_argument("--net-updates", type=int, default=None,
                   help="fpi_net's training updates (default: its config's)")  # fmt: skip
    p.add_argument("--plot", default=None, help="write the feasible regions' PNG here")
    p.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    args = p.parse_args(argv)
    if args.gpus < 1 or args.tick_s <= 0 or args.pool < 1 or not 0 <= args.p < 1:
        p.error("--gpus >= 1, --tick-s > 0, --pool >= 1, --p in [0, 1)")
    bad_updates = args.net_updates is not None and args.net_updates < 1
    if args.seeds < 1 or bad_updates or args.downtime_per_day_s <= 0:
        p.error("--seeds >= 1, --net-updates >= 1, --downtime-per-day-s > 0")
    load = Load()
    out = run(args, Progress())
    out["host_load"] = load.as_dict()
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0
