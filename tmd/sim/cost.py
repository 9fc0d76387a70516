"""What a failure costs a training job, per recovery method, at one cluster size.

How to read it. ``Local`` holds what ``tmd bench downtime --json`` measured on one
small CPU job (machines of two gloo ranks); ``load()`` without a path gives the
figures the README recorded. ``at_scale`` turns it into ``Costs`` for a job of
``gpus`` GPUs: tmd's own switch times are the local measurement plus a stated
growth with N, every other term comes from a cited paper. ``recovery`` then prices
one event (a ``Signal``) for one ``Method`` as a ``Recovery``: time until the failure
is noticed, time the whole job then stands idle, training re-done, and (torchft)
time run at reduced throughput. Every field is seconds of wall-clock time. ``young``
and ``daly`` give the checkpoint interval, ``ettr`` the effective training time ratio.

Sources are cited next to each constant. Tags follow the research notes: [V] read in
the source's own text, [Q] a verbatim quote checked by others, [S] a secondary
summary. "(computed)" marks arithmetic of ours on cited figures. The models keep
the baselines' side favourable (MegaScale's optimised start-up, ByteRobust's fast
detection), so tmd's advantage is not inflated by weak baselines.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, get_args

from tmd.detectors.node_lost import NodeLostConfig

Method = Literal["tmd", "checkpoint_restart", "torchft_style", "warm_standby_restart", "no_standby"]
Signal = Literal["xid", "node_lost", "hang", "straggler", "crash", "planned"]
METHODS: Final[tuple[Method, ...]] = get_args(Method)
SIGNALS: Final[tuple[Signal, ...]] = get_args(Signal)

# -- measured here -------------------------------------------------------------------

# README.md, "tmd bench downtime --nproc 4 --nproc-per-node 2 --machine-only --json",
# measured 2026-12-01 on the code of 303161e..019678b, recorded at commit b730c00
# (2-core machine with a CI run beside it): median step 1.54 s; live move of worker1
# 0.207 s from the step records, 0.252 s runtime-measured; failover 1.58 s (runtime
# 1.38 s); checkpoint-restart 15.3 s. Kept in the shape the bench prints, so the
# defaults pass through the same ``fit`` as a fresh run.
README_SOURCE: Final = (
    "README.md: tmd bench downtime --nproc 4 --nproc-per-node 2 --machine-only, "
    "2026-12-01, recorded at commit b730c00"
)
README_MACHINE_RUN: Final[Mapping[str, Any]] = {
    "machine": {
        "median_step_s": 1.54,
        "downtime_s": 0.207,
        "runtime_downtime_s": 0.252,
        "failover": {"downtime_s": 1.58, "runtime_downtime_s": 1.38},
        "checkpoint_restart": {"downtime_s": 15.3},
    }
}
# README.md, "tmd bench detect --json" at d9b445f: fatal XID published as an agent
# does to the daemon's GpuFault, p50 1.4 ms, max 41 ms over 20 samples. The max is
# taken. Not measured: the driver's XID to NVML's event (no source found).
XID_TO_FINDING_S: Final = 0.041

# -- cited -----------------------------------------------------------------------------

# MegaScale (arXiv 2402.15627), Table 2 [V]: 175B model on 12,288 GPUs, 6.34 s per
# iteration. Held fixed over N (weak scaling: the global batch grows with the job).
MEGASCALE_STEP_S: Final = 6.34
# PyTorch ProcessGroupNCCL.hpp, kProcessGroupNCCLDefaultTimeout = 10 * 60 * 1000 ms,
# the `timeout=` default of init_process_group for NCCL: a hang surfaces then.
NCCL_WATCHDOG_S: Final = 600.0
# torch/distributed/run.py (torch 2.13), --monitor-interval default 0.1 s: how soon
# torchrun sees a worker process exit.
TORCHRUN_MONITOR_S: Final = 0.1
# ByteRobust (arXiv 2509.16293) [S]: detection in 10-30 s, against 10-30 min for
# timeout baselines. The fast end is given to every baseline (favourable to them).
BYTEROBUST_DETECT_S: Final = 10.0
# TrainMover (arXiv 2412.12636 v3, sec. 8.2, Fig. 8) [S]: going from 32 to 1,024 GPUs
# adds at most 10 s of downtime (expected and unexpected interruptions alike). Taken
# as 2 s per doubling past 32 GPUs (an upper bound, so pessimistic for tmd); flat
# below 32 (no data); beyond 1,024 an extrapolation.
TRAINMOVER_GROWTH_S: Final = 10.0
TRAINMOVER_FROM_GPUS: Final = 32
TRAINMOVER_TO_GPUS: Final = 1024
# ByteCheckpoint (arXiv 2407.20143 v4, Table 8) [Q]: 405B Megatron on 8,960 GPUs,
# blocking 0.59 s, save 51.06 s, load 129.49 s. Both held fixed over N: a fixed
# model's checkpoint is read once per data-parallel group and broadcast (MegaScale
# sec. 4.4 [V]), and the blocking copy is per GPU. The 7B ViT on 1,488 GPUs blocks
# 0.34 s (same table), so growth with N is weak at most.
BYTECHECKPOINT_BLOCK_S: Final = 0.59
BYTECHECKPOINT_LOAD_S: Final = 129.49
# MegaScale sec. 3.5 [V]: optimised initialisation "under 5 seconds on 2048 GPUs, and
# to under 30 seconds on more than 10,000 GPUs" (1,047 s unoptimised on 2,048). Fitted
# log-linear through (2,048, 5 s) and (10,000, 30 s); 0 below about 1,490 GPUs.
MEGASCALE_INIT: Final = ((2048, 5.0), (10_000, 30.0))
# TrainMover sec. 2.3 [S]: cold start of an 8,192-GPU production job 4.45 min, of which
# checkpoint loading 35.1 %, NCCL 24.5 %, cold warm-up 40.4 %. Warm-up (107.9 s,
# computed) is per process, so held fixed over N. Cross-check (computed): at 8,192
# GPUs our restart_init_s + checkpoint_load_s = 280 s against TrainMover's 267 s.
TRAINMOVER_COLD_START_S: Final = 4.45 * 60
TRAINMOVER_WARMUP_SHARE: Final = 0.404
# TrainMover (64K/128K projections) [S]: "a 2-min infrastructure scheduling cost added
# to every system": scheduler requeue and node allocation.
TRAINMOVER_REQUEUE_S: Final = 120.0
# Crusoe, "AutoClusters: Minimizing the impact of hardware failures in large GPU
# clusters" (vendor blog): "detects and replaces failed GPU nodes in under 5 minutes".
# A vendor's upper bound with a provider's spare capacity behind it; without one
# (a physical repair) it is hours, for which no source was found.
CRUSOE_REPLACE_S: Final = 300.0
# ByteRobust [S]: warm-standby recovery 10.87x faster than a requeue (hot update
# 11.04x). Its checkpoints are async every iteration with backups in CPU memory or
# local SSD [S], so a warm-standby restart loads from memory and loses about a step.
BYTEROBUST_WARM_SPEEDUP: Final = 10.87
# PyTorch blog "Fault Tolerant Llama" (torchft, 2025-06-20) [V]: "Gloo ... can
# reinitialize in <1s for our use case, and we were able to set the timeout on all
# operations at 5s"; 30 replica groups (30 hosts x 10 L40S).
TORCHFT_HEAL_S: Final = 1.0
TORCHFT_TIMEOUT_S: Final = 5.0
TORCHFT_REPLICA_GROUPS: Final = 30


@dataclass(frozen=True)
class Local:
    """One ``tmd bench downtime --json`` run (2 ranks a machine, CPU, gloo): seconds."""

    step_s: float  # the median step of the migrated run
    live_s: float  # live machine migration: worse of step records' and runtime's
    failover_s: float  # a machine's processes SIGKILLed, replaced from a replica
    checkpoint_restart_s: float  # save, all exit, all start, load, first step
    source: str


# Where each figure sits in the machine object (``machine`` of the bench's output,
# or that object alone) and in the output of machines of one process.
_MACHINE_FIELDS: Final = {
    "step": "median_step_s",
    "live": "downtime_s",
    "live_runtime": "runtime_downtime_s",
    "failover": "failover.downtime_s",
    "failover_runtime": "failover.runtime_downtime_s",
    "restart": "checkpoint_restart.downtime_s",
}
_PROCESS_FIELDS: Final = {
    **_MACHINE_FIELDS,
    "live": "live.downtime_s",
    "live_runtime": "live.runtime_downtime_s",
}
_OPTIONAL: Final = frozenset({"live_runtime", "failover_runtime"})


def fit(result: Mapping[str, Any], source: str = "tmd bench downtime --json") -> Local:
    """``Local`` from ``tmd bench downtime --json``'s object.

    Takes its ``machine`` part where there is one (tmd moves whole machines), else
    the runs on machines of one process (``live``, ``failover``,
    ``checkpoint_restart``); ``machine`` itself is accepted too. A switch's downtime
    is the worse of the step records' and the runtime's (as ``measure.worst``),
    floored at 0: a negative one is step noise. Raises ``ValueError`` naming the
    first missing or non-numeric field.
    """
    if result.get("machine") is not None:
        fields = {k: "machine." + v for k, v in _MACHINE_FIELDS.items()}
    elif "live" in result:
        fields = dict(_PROCESS_FIELDS)
    elif "downtime_s" in result:
        fields = dict(_MACHINE_FIELDS)
    else:
        raise ValueError(
            "downtime result: missing field 'live' (and no 'machine'): "
            "not the output of `tmd bench downtime --json`"
        )
    got = {k: _number(result, path, optional=k in _OPTIONAL) for k, path in fields.items()}
    step = got["step"]
    if step is None or step <= 0:
        raise ValueError(f"downtime result: field {fields['step']!r} must be > 0")

    def worst(a: str, b: str) -> float:
        return max(0.0, *(v for v in (got[a], got[b]) if v is not None))

    restart = got["restart"]
    assert restart is not None  # required
    return Local(
        step_s=step,
        live_s=worst("live", "live_runtime"),
        failover_s=worst("failover", "failover_runtime"),
        checkpoint_restart_s=max(0.0, restart),
        source=source,
    )


def _number(result: Mapping[str, Any], path: str, *, optional: bool) -> float | None:
    here: Any = result
    for key in path.split("."):
        if not isinstance(here, Mapping) or key not in here:
            if optional:
                return None
            raise ValueError(f"downtime result: missing field {path!r}")
        here = here[key]
    if here is None and optional:
        return None
    if isinstance(here, bool) or not isinstance(here, int | float) or not math.isfinite(here):
        raise ValueError(f"downtime result: field {path!r} must be a finite number, not {here!r}")
    return float(here)


def load(path: Path | None = None) -> Local:
    """``fit`` of a saved ``tmd bench downtime --json`` output; without a path, the
    figures the README recorded (``README_MACHINE_RUN``)."""
    if path is None:
        return fit(README_MACHINE_RUN, source=README_SOURCE)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return fit(data, source=str(path))


@dataclass(frozen=True)
class Costs:
    """Every cost of one job of ``gpus`` GPUs, in seconds; sources at the constants."""

    gpus: int
    step_s: float  # one training step (MEGASCALE_STEP_S unless given)
    detect_xid_s: float  # tmd: fatal XID to the daemon's finding (XID_TO_FINDING_S)
    detect_lost_s: float  # tmd: node_lost's heartbeat timeout (its config default)
    detect_hang_s: float  # everyone: NCCL watchdog default (NCCL_WATCHDOG_S)
    detect_crash_s: float  # everyone: torchrun sees the exit (TORCHRUN_MONITOR_S)
    detect_other_s: float  # baselines' XID / lost node (BYTEROBUST_DETECT_S)
    live_migration_s: float  # local live_s + TrainMover growth with N
    machine_failover_s: float  # local failover_s + TrainMover growth with N
    checkpoint_blocking_s: float  # GPU pause per checkpoint (BYTECHECKPOINT_BLOCK_S)
    checkpoint_load_s: float  # BYTECHECKPOINT_LOAD_S, fixed over N
    restart_init_s: float  # local restart + MegaScale group init(N) + TrainMover warm-up
    requeue_s: float  # scheduler requeue and allocation (TRAINMOVER_REQUEUE_S)
    cold_standby_s: float  # provisioning a machine, no spare ready (CRUSOE_REPLACE_S)
    warm_standby_restart_s: float  # a requeue's restart / BYTEROBUST_WARM_SPEEDUP
    torchft_heal_s: float  # drop a replica group and re-form (TORCHFT_HEAL_S)
    torchft_timeout_s: float  # torchft's op timeout: how it notices (TORCHFT_TIMEOUT_S)


def trainmover_growth_s(gpus: int) -> float:
    """Downtime added to a switch between 32 GPUs and ``gpus`` (TRAINMOVER_GROWTH_S)."""
    per_doubling = TRAINMOVER_GROWTH_S / math.log2(TRAINMOVER_TO_GPUS / TRAINMOVER_FROM_GPUS)
    return per_doubling * max(0.0, math.log2(gpus / TRAINMOVER_FROM_GPUS))


def group_init_s(gpus: int) -> float:
    """Process-group initialisation at ``gpus`` GPUs, log-linear through MegaScale's
    optimised points (MEGASCALE_INIT), floored at 0."""
    (n0, t0), (n1, t1) = MEGASCALE_INIT
    return max(0.0, t0 + (t1 - t0) * math.log(gpus / n0) / math.log(n1 / n0))


def at_scale(local: Local, gpus: int, *, step_s: float | None = None) -> Costs:
    """``Costs`` of a job of ``gpus`` GPUs from the local measurement and the sources.

    tmd's switch (live or failover) is the local time plus ``trainmover_growth_s``:
    at 1,024 GPUs 0.25 + 10 s live and 1.58 + 10 s failover against TrainMover's
    "under 10 s with a standby" [S]. The local failover includes re-running the
    interrupted step (1.5 s steps), which ``recovery`` also counts as lost work at
    scale: under a second counted twice. A restart is the local restart (process
    start, import, a 25M-parameter save and load) plus ``group_init_s`` plus
    TrainMover's warm-up; the warm standby restart is that restart, the requeue and
    the checkpoint load divided by ByteRobust's 10.87.
    """
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, not {gpus}")
    step = MEGASCALE_STEP_S if step_s is None else step_s
    if not step > 0:
        raise ValueError(f"step_s must be > 0, not {step}")
    growth = trainmover_growth_s(gpus)
    warm_up = TRAINMOVER_COLD_START_S * TRAINMOVER_WARMUP_SHARE
    restart_init = local.checkpoint_restart_s + group_init_s(gpus) + warm_up
    requeue_restart = TRAINMOVER_REQUEUE_S + restart_init + BYTECHECKPOINT_LOAD_S
    return Costs(
        gpus=gpus,
        step_s=step,
        detect_xid_s=XID_TO_FINDING_S,
        detect_lost_s=NodeLostConfig().heartbeat_timeout_s,
        detect_hang_s=NCCL_WATCHDOG_S,
        detect_crash_s=TORCHRUN_MONITOR_S,
        detect_other_s=BYTEROBUST_DETECT_S,
        live_migration_s=local.live_s + growth,
        machine_failover_s=local.failover_s + growth,
        checkpoint_blocking_s=BYTECHECKPOINT_BLOCK_S,
        checkpoint_load_s=BYTECHECKPOINT_LOAD_S,
        restart_init_s=restart_init,
        requeue_s=TRAINMOVER_REQUEUE_S,
        cold_standby_s=CRUSOE_REPLACE_S,
        warm_standby_restart_s=requeue_restart / BYTEROBUST_WARM_SPEEDUP,
        torchft_heal_s=TORCHFT_HEAL_S,
        torchft_timeout_s=TORCHFT_TIMEOUT_S,
    )


# -- recovery --------------------------------------------------------------------------


@dataclass(frozen=True)
class Recovery:
    """One event's cost, seconds: noticed after ``detect_s``; then the whole job idle
    ``downtime_s``; ``lost_work_s`` of training re-done; then ``degraded_s`` run with
    ``degraded_fraction`` of its throughput lost (torchft only)."""

    detect_s: float
    downtime_s: float
    lost_work_s: float
    uses_standby: bool  # a standby machine is consumed
    degraded_s: float = 0.0
    degraded_fraction: float = 0.0


_MACHINE_LEAVES: Final = frozenset({"xid", "node_lost", "planned", "straggler"})
_JOB_RUNNING: Final = frozenset({"planned", "straggler"})  # can checkpoint or drain first


def recovery(
    method: Method,
    signal: Signal,
    costs: Costs,
    *,
    since_checkpoint_s: float,
    standby_ready: bool,
    replicas: bool = True,
    replica_groups: int = TORCHFT_REPLICA_GROUPS,
) -> Recovery:
    """What ``method`` pays for ``signal``.

    Signals: ``xid`` (fatal GPU error) and ``node_lost`` take a machine out;
    ``planned`` (maintenance) and ``straggler`` (a slow machine) move one out while
    the job still runs, so a checkpoint can be taken just before (lost work 0);
    ``hang`` (a collective stuck) and ``crash`` (the job's software failed, which a
    machine swap does not fix) restart the job where it is. Detection: 0 for planned
    and straggler (the straggler detector is modelled elsewhere); NCCL's watchdog for
    a hang and torchrun's monitor for a crash, for everyone; for xid and node_lost
    tmd's own agent and heartbeat, torchft's op timeout, ByteRobust's 10 s for the rest.

    - ``checkpoint_restart``: requeue, restart_init, checkpoint load (plus the
      blocking checkpoint just before, when the job still runs); lost work
      ``since_checkpoint_s`` (0 when it still runs). The scheduler finds the
      replacement machine within ``requeue_s``.
    - ``no_standby``: the same, but no machine is free: one is provisioned
      (``cold_standby_s``) whenever a machine leaves.
    - ``warm_standby_restart`` (ByteRobust): the whole job restarts onto a warm
      standby and loads from in-memory backups (checkpoints every step): downtime
      ``warm_standby_restart_s``, lost the step in flight (half a step on average; 0
      when it still runs). In place for
      hang and crash; a checkpoint restart when a machine leaves and none is ready.
    - ``torchft_style``: the failed replica group is dropped, the rest re-form in
      ``torchft_heal_s`` and lose the step in flight (half a step on average, 0 when it
      still runs); the
      group's replacement starts (``restart_init_s``, plus ``requeue_s`` without a
      ready standby) and heals from a peer meanwhile: ``degraded_s`` at
      ``1 / replica_groups`` of the throughput lost (30 groups: the torchft blog's).
      Hang, crash, or no replicas: a checkpoint restart.
    - ``tmd``: planned and straggler move the machine live (``live_migration_s``, no
      work lost); xid and node_lost fail over from a data-parallel replica onto the
      ready standby (``machine_failover_s``, half a step lost on average: the step in
      flight). Without a ready standby (or, to fail over, without replicas), hang and
      crash: a checkpoint restart, noticed as tmd notices it.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: one of {', '.join(METHODS)}")
    if signal not in SIGNALS:
        raise ValueError(f"unknown signal {signal!r}: one of {', '.join(SIGNALS)}")
    if since_checkpoint_s < 0:
        raise ValueError(f"since_checkpoint_s must be >= 0, not {since_checkpoint_s}")
    if replica_groups < 2:
        raise ValueError(f"replica_groups must be >= 2, not {replica_groups}")
    detect = _detect(method, signal, costs)
    running = signal in _JOB_RUNNING
    leaves = signal in _MACHINE_LEAVES
    restart = _restart(costs, detect, since_checkpoint_s, running=running, provision=False)
    # The step in flight when a machine fails is lost, half a step on average, for
    # every method that keeps going from the step (tmd's failover, torchft's discarded
    # step, ByteRobust's per-step checkpoint).
    step_lost = 0.0 if running else 0.5 * costs.step_s
    if method == "checkpoint_restart":
        return restart
    if method == "no_standby":
        return _restart(costs, detect, since_checkpoint_s, running=running, provision=leaves)
    if method == "warm_standby_restart":
        if leaves and not standby_ready:
            return restart
        return Recovery(detect, costs.warm_standby_restart_s, step_lost, uses_standby=leaves)
    if method == "torchft_style":
        if not leaves or not replicas:
            return restart
        regrow = costs.restart_init_s + (0.0 if standby_ready else costs.requeue_s)
        return Recovery(detect, costs.torchft_heal_s, step_lost, uses_standby=standby_ready,
                        degraded_s=regrow, degraded_fraction=1 / replica_groups)  # fmt: skip
    # tmd
    if not leaves or not standby_ready:
        return restart
    if running:
        return Recovery(detect, costs.live_migration_s, 0.0, uses_standby=True)
    if not replicas:
        return restart
    return Recovery(detect, costs.machine_failover_s, 0.5 * costs.step_s, uses_standby=True)


def _detect(method: Method, signal: Signal, costs: Costs) -> float:
    if signal in _JOB_RUNNING:
        return 0.0
    if signal == "hang":
        return costs.detect_hang_s
    if signal == "crash":
        return costs.detect_crash_s
    if method == "tmd":
        return costs.detect_xid_s if signal == "xid" else costs.detect_lost_s
    if method == "torchft_style":
        return costs.torchft_timeout_s
    return costs.detect_other_s


def _restart(
    costs: Costs, detect: float, since_checkpoint_s: float, *, running: bool, provision: bool
) -> Recovery:
    downtime = costs.requeue_s + costs.restart_init_s + costs.checkpoint_load_s
    downtime += costs.checkpoint_blocking_s if running else 0.0
    downtime += costs.cold_standby_s if provision else 0.0
    lost = 0.0 if running else float(since_checkpoint_s)
    return Recovery(detect, downtime, lost, uses_standby=False)


# -- checkpoint interval and ETTR ------------------------------------------------------


def young(delta_s: float, mtbf_s: float) -> float:
    """Young (1974, CACM 17(9)) [V]: checkpoint interval sqrt(2 delta M) for a save
    taking ``delta_s`` and a mean time between failures ``mtbf_s``."""
    _positive(delta_s=delta_s, mtbf_s=mtbf_s)
    return math.sqrt(2.0 * delta_s * mtbf_s)


def daly(delta_s: float, mtbf_s: float) -> float:
    """Daly (2006, FGCS 22(3):303-312) eq. 37 [V]: sqrt(2 delta M) * (1 + (1/3)
    sqrt(delta / 2M) + (1/9) (delta / 2M)) - delta for delta < 2M, else M. The
    restart time does not enter it. Daly's own points: M = 24 h, delta = 5 min gives
    117 min; M = 6 h 57 min; M = 15 min 9.1 min."""
    _positive(delta_s=delta_s, mtbf_s=mtbf_s)
    if delta_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = delta_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * delta_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - delta_s


def ettr(useful_s: float, wall_s: float) -> float:
    """Effective training time ratio: useful training over wall-clock time, in [0, 1]
    (Llama 3 sec. 3.3.4 [V]; Kokolis et al. [S])."""
    if not wall_s > 0:
        raise ValueError(f"wall_s must be > 0, not {wall_s}")
    return min(1.0, max(0.0, useful_s / wall_s))


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, not {value}")
