"""``tmd sim``: the daemon's detectors, policies and actuator against a simulated job
and a published failure mix; ETTR for tmd and, on the same failures, for the other
ways of recovering. Prints one JSON object (``--json``: on one line)."""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tmd import log
from tmd.sim import live, mixes
from tmd.sim.engine import BASELINES, Settings, Simulation
from tmd.sim.live import LiveSettings
from tmd.tools.bench import Progress


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tmd sim", description=__doc__.split("\n")[0])
    d = Settings()
    p.add_argument("--gpus", type=int, default=d.gpus, help="the job's GPUs (default %(default)s)")
    p.add_argument("--days", type=float, default=d.days, help="simulated days (%(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    mix_help = f"failure mix: {', '.join(mixes.MIXES)} or a TOML file (%(default)s)"
    p.add_argument("--mix", default=d.mix, help=mix_help)
    pools = f"standby machines ({d.pool}; --live: {LiveSettings.standbys})"
    p.add_argument("--pool", type=int, default=None, help=pools)
    p.add_argument("--rebalance-min", type=float, default=d.rebalance_min,
                   help="the rebalance policy's interval (%(default)s)")  # fmt: skip
    p.add_argument("--policy", choices=("rebalance", "fpi", "lagrangian"), default=d.policy,
                   help="what decides about stragglers: the rebalance policy, the "
                   "learned one (FPI, trained for this run first), or the Lagrangian "
                   "baseline (a table trained the same way, run by the same policy) "
                   "(%(default)s)")  # fmt: skip
    p.add_argument("--window", type=int, default=d.window,
                   help="machines the daemon sees (module docstring; %(default)s)")  # fmt: skip
    p.add_argument("--step-s", type=float, default=None, help="step time (default: the model's)")
    p.add_argument("--downtime", type=Path, default=None,
                   help="a `tmd bench downtime --json` output to fit tmd's times to")  # fmt: skip
    p.add_argument("--no-failslow", action="store_true", help="leave fail-slow machines out")
    p.add_argument("--no-planned", action="store_true", help="leave planned maintenance out")
    p.add_argument("--slow-machines", action="store_true",
                   help="add machines slow for the whole run (MegaScale's 0.5%%)")  # fmt: skip
    p.add_argument("--signals", default="",
                   help="only failures of these kinds, comma-separated: "
                   f"{', '.join(sorted(mixes.SIGNALS))}")  # fmt: skip
    p.add_argument("--json", action="store_true", help="the JSON object on one line")
    p.add_argument("--sweep", type=Path, default=None, metavar="PNG",
                   help="ETTR of every method against cluster size (--sizes) and standby "
                   "pool (--pools, at --gpus): runs each, draws both into PNG")  # fmt: skip
    p.add_argument("--sizes", default="1024,4096,16384,65536,131072")
    p.add_argument("--pools", default="0,1,2,4,8,16,32")
    live = p.add_argument_group(
        "--live", "the daemon itself (`tmd run`) in real time against simulated machines "
        "over a real broker (tmd.sim.live); --seed, --mix, --pool, --signals and --step-s "
        "apply (--step-s default 0.1)",
    )  # fmt: skip
    ld = LiveSettings()
    live.add_argument("--live", action="store_true")
    live.add_argument("--seconds", type=float, default=ld.seconds, help="(%(default)s)")
    live.add_argument("--machines", type=int, default=ld.machines, help="(%(default)s)")
    live.add_argument("--per-node", type=int, default=ld.per_node, help="ranks (%(default)s)")
    live.add_argument("--failures", type=int, default=ld.failures, help="(%(default)s)")
    live.add_argument("--slowdown", type=float, default=ld.slowdown,
                      help="a straggler's (%(default)s)")  # fmt: skip
    live.add_argument("--embedded-broker", action="store_true",
                      help="the embedded broker even where mosquitto is installed")  # fmt: skip
    return p


def live_settings_from(args: argparse.Namespace) -> LiveSettings:
    d = LiveSettings()
    signals = tuple(x for x in args.signals.split(",") if x) or d.signals
    return LiveSettings(
        machines=args.machines, per_node=args.per_node,
        standbys=d.standbys if args.pool is None else args.pool,
        step_s=args.step_s or d.step_s, seconds=args.seconds, failures=args.failures,
        signals=signals, slowdown=args.slowdown, seed=args.seed, mix=args.mix,
        embedded_broker=args.embedded_broker,
    )  # fmt: skip


def settings_from(args: argparse.Namespace) -> Settings:
    pool = Settings().pool if args.pool is None else args.pool
    if args.gpus < 1 or args.days <= 0 or pool < 0 or args.window < 2:
        raise SystemExit("tmd sim: --gpus >= 1, --days > 0, --pool >= 0, --window >= 2")
    return Settings(
        gpus=args.gpus, days=args.days, seed=args.seed, mix=args.mix, pool=pool,
        rebalance_min=args.rebalance_min, window=args.window, step_s=args.step_s,
        downtime=args.downtime, failslow=not args.no_failslow, planned=not args.no_planned,
        slow_machines=args.slow_machines, policy=args.policy,
        signals=tuple(x for x in args.signals.split(",") if x),
    )  # fmt: skip


def run(settings: Settings, progress: Progress | None = None) -> dict[str, Any]:
    t0 = time.monotonic()
    sim = Simulation(settings)
    if progress is not None:
        progress.say(f"{settings.gpus} GPUs, {settings.days:g} days, {len(sim.failures)} events")
    days = settings.days
    result = sim.run(
        (lambda day: progress.say(f"day {day:.0f} of {days:g}")) if progress else lambda day: None
    )
    result["wall_s"] = round(time.monotonic() - t0, 2)
    result["load"] = os.getloadavg()[0]
    return result


def sweep(settings: Settings, sizes: list[int], pools: list[int], png: Path,
          progress: Progress) -> dict[str, Any]:  # fmt: skip
    """Every method's ETTR against cluster size, then against the standby pool."""
    out: dict[str, Any] = {"days": settings.days, "seed": settings.seed, "mix": settings.mix,
                           "sizes": [], "pools": [], "png": str(png)}  # fmt: skip
    t0 = time.monotonic()
    for gpus in sizes:
        progress.say(f"size {gpus} GPUs")
        r = Simulation(replace(settings, gpus=gpus)).run()
        out["sizes"].append({"gpus": gpus, **{k: v for k, v in r.items() if k.startswith("ettr")}})
    for pool in pools:
        progress.say(f"pool {pool} at {settings.gpus} GPUs")
        r = Simulation(replace(settings, pool=pool)).run()
        out["pools"].append({"pool": pool, "pool_exhausted": r["pool_exhausted"],
                             **{k: v for k, v in r.items() if k.startswith("ettr")}})  # fmt: skip
    out["wall_s"] = round(time.monotonic() - t0, 1)
    out["load"] = os.getloadavg()[0]
    draw(out, settings, png)
    return out


def draw(out: dict[str, Any], settings: Settings, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["ettr", *[f"ettr_{m}" for m in BASELINES]]
    names = {"ettr": "tmd (live migration, failover, rebalance)"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key in keys:
        label = names.get(key, key.removeprefix("ettr_").replace("_", " "))
        a.plot([r["gpus"] for r in out["sizes"]], [r[key] for r in out["sizes"]], "o-",
               label=label)  # fmt: skip
        b.plot([r["pool"] for r in out["pools"]], [r[key] for r in out["pools"]], "o-",
               label=label)  # fmt: skip
    a.set_xscale("log", base=2)
    a.set_xlabel("GPUs in the job")
    b.set_xlabel(f"standby machines ({settings.gpus} GPUs)")
    for ax in (a, b):
        ax.set_ylabel("ETTR")
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.suptitle(f"tmd sim: {settings.mix} failures, {settings.days:g} days, seed {settings.seed}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.live:
        log.setup(level="error")
        progress = Progress()
        try:
            result = live.run(live_settings_from(args), progress.say)
        except (ValueError, OSError) as exc:
            raise SystemExit(f"tmd sim --live: {exc}") from exc
        print(json.dumps(result, indent=None if args.json else 2))
        return 1 if result["errors"] else 0
    settings = settings_from(args)
    if args.sweep is not None:
        log.setup(level="error")
        sizes = [int(x) for x in args.sizes.split(",") if x]
        pools = [int(x) for x in args.pools.split(",") if x]
        result = sweep(settings, sizes, pools, args.sweep, Progress())
        print(json.dumps(result, indent=None if args.json else 2))
        return 0
    # The daemon's parts log every decision at info, an aborted migration at warning:
    # the JSON tells what happened; errors still show.
    log.setup(level="error")
    try:
        result = run(settings, Progress())
    except (ValueError, OSError) as exc:
        raise SystemExit(f"tmd sim: {exc}") from exc
    print(json.dumps(result, indent=None if args.json else 2, default=str))
    return 0
