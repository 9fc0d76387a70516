"""``tmd policy train``: train the learned safe policy (Feasible Policy Iteration,
``tmd.sim.fpi``) on the model of the migration decision built from ``tmd sim``'s data,
and write the table the ``fpi`` policy reads (``[policies.fpi] model = PATH``).
``--algorithm lagrangian`` trains the baseline it is measured against instead, in the
same form, so ``tmd sim --policy lagrangian`` runs it through the same policy."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from tmd.sim import fpi
from tmd.tools.bench import Progress

GAMMA = 0.99


def main(argv: list[str] | None = None, *, quiet: bool = False) -> int:
    p = argparse.ArgumentParser(prog="tmd policy train", description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="where to write the model (JSON)")
    p.add_argument("--gpus", type=int, default=16384, help="the jobs' size it is for")
    p.add_argument("--mix", default="llama3")
    p.add_argument("--tick-s", type=float, default=600.0, help="the policy's decision interval")
    p.add_argument("--pool", type=int, default=3, help="standby machines it tells apart")
    p.add_argument("--max-per-hour", type=int, default=2)
    p.add_argument("--min-pool", type=int, default=1)
    p.add_argument("--p", type=float, default=0.0, help="the feasibility threshold")
    p.add_argument("--algorithm", choices=sorted(fpi.ALGORITHMS), default="fpi",
                   help="fpi, or the lagrangian baseline (%(default)s)")  # fmt: skip
    p.add_argument("--risk", type=float, default=0.01,
                   help="lagrangian: its bound on discounted breaches (%(default)s)")  # fmt: skip
    p.add_argument("--seen-ranks", type=int, default=None,
                   help="the job size the daemon sees, where not --gpus (tmd sim shows it "
                   "a window of the job): what the policy takes for its own")  # fmt: skip
    args = p.parse_args(argv)
    if args.gpus < 1 or args.tick_s <= 0 or args.pool < 1 or not 0 <= args.p < 1:
        p.error("--gpus >= 1, --tick-s > 0, --pool >= 1, --p in [0, 1)")
    limits = fpi.Limits(max_per_hour=args.max_per_hour, min_pool=args.min_pool)
    progress = Progress()  # on a terminal only: piped, the JSON summary is all
    t0 = time.process_time()
    progress.say(f"estimating the model from the simulator: {args.mix}, {args.gpus} GPUs")
    mdp = fpi.from_sim(mix=args.mix, gpus=args.gpus, tick_s=args.tick_s, pool=args.pool,
                       limits=limits)  # fmt: skip
    progress.say(f"{mdp.n_states} states; solving with {args.algorithm}")
    if args.algorithm == "lagrangian":
        start = mdp.states.index((0, 0, args.pool, 0, 0))
        table, lam = fpi.lagrangian(mdp, start=start, risk=args.risk, gamma=GAMMA)
        run = fpi.as_run(mdp, table, p=args.p, gamma=GAMMA)
    else:
        always = np.full(mdp.n_states, fpi.ACTIONS.index("migrate"), dtype=np.int64)
        run = fpi.iterate(mdp, p=args.p, gamma=GAMMA, start=always)
    about: dict[str, object] = {
        "gpus": args.seen_ranks or args.gpus, "trained_gpus": args.gpus, "mix": args.mix,
        "tick_s": args.tick_s, "pool": args.pool,
        "limits": {"max_per_hour": limits.max_per_hour, "min_pool": limits.min_pool},
        "train_s": round(time.process_time() - t0, 3),
    }  # fmt: skip
    if args.algorithm == "lagrangian":
        about.update(risk=args.risk, lagrangian_lambda=round(lam, 6))
    model = fpi.export(mdp, run, p=args.p, gamma=GAMMA, about=about, algorithm=args.algorithm)
    args.out.write_text(json.dumps(model) + "\n")
    progress.say(f"{run.iterations} iterations; written to {args.out}")
    summary = {"out": str(args.out), "states": mdp.n_states, "iterations": run.iterations,
               "region_sizes": run.region_sizes, "region_monotone": run.region_monotone,
               "train_s": about["train_s"]}  # fmt: skip
    if not quiet:
        json.dump(summary, sys.stdout)
        sys.stdout.write("\n")
    return 0
