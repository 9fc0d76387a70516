"""``tmd sim``: the daemon's detectors, policies and actuator against a simulated job
and a published failure mix; ETTR for tmd and, on the same failures, for the other
ways of recovering. Prints one JSON object (``--json``: on one line)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from tmd import log
from tmd.sim import mixes
from tmd.sim.engine import Settings, Simulation
from tmd.tools.bench import Progress


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tmd sim", description=__doc__.split("\n")[0])
    d = Settings()
    p.add_argument("--gpus", type=int, default=d.gpus, help="the job's GPUs (default %(default)s)")
    p.add_argument("--days", type=float, default=d.days, help="simulated days (%(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    mix_help = f"failure mix: {', '.join(mixes.MIXES)} or a TOML file (%(default)s)"
    p.add_argument("--mix", default=d.mix, help=mix_help)
    p.add_argument("--pool", type=int, default=d.pool, help="standby machines (%(default)s)")
    p.add_argument("--rebalance-min", type=float, default=d.rebalance_min,
                   help="the rebalance policy's interval (%(default)s)")  # fmt: skip
    p.add_argument("--window", type=int, default=d.window,
                   help="machines the daemon sees (module docstring; %(default)s)")  # fmt: skip
    p.add_argument("--step-s", type=float, default=None, help="step time (default: the model's)")
    p.add_argument("--downtime", type=Path, default=None,
                   help="a `tmd bench downtime --json` output to fit tmd's times to")  # fmt: skip
    p.add_argument("--no-failslow", action="store_true", help="leave fail-slow machines out")
    p.add_argument("--no-planned", action="store_true", help="leave planned maintenance out")
    p.add_argument("--slow-machines", action="store_true",
                   help="add machines slow for the whole run (MegaScale's 0.5%%)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="the JSON object on one line")
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    if args.gpus < 1 or args.days <= 0 or args.pool < 0 or args.window < 2:
        raise SystemExit("tmd sim: --gpus >= 1, --days > 0, --pool >= 0, --window >= 2")
    return Settings(
        gpus=args.gpus, days=args.days, seed=args.seed, mix=args.mix, pool=args.pool,
        rebalance_min=args.rebalance_min, window=args.window, step_s=args.step_s,
        downtime=args.downtime, failslow=not args.no_failslow, planned=not args.no_planned,
        slow_machines=args.slow_machines,
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


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    settings = settings_from(args)
    log.setup(level="warning")  # the daemon's parts log every decision at info
    try:
        result = run(settings, Progress())
    except (ValueError, OSError) as exc:
        raise SystemExit(f"tmd sim: {exc}") from exc
    print(json.dumps(result, indent=None if args.json else 2, default=str))
    return 0
