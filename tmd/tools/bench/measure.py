"""What ``tmd bench downtime`` computes from the step records its runs leave.

Every process of a run writes one JSON record (``{node}-{local_rank}.json``: a
machine runs several); its ``steps`` rows are ``[rank, step, loss, end, step_s,
rss_bytes, compute_s, allreduce_s, optimizer_s]``, where ``end`` is the wall time at
which the step's optimizer update ended, before the step boundary (where a switch
runs). A process that kills itself leaves ``killed-{rank}.json`` instead. These
functions read those rows: downtimes, medians, step-time noise, ratios, slowdowns,
loss matches, and whether a machine's migration holds its targets.

Downtime, as a user would time it: from the end of the last update before the
replacement (latest rank) to the end of the first step after it (latest rank),
minus one median step. Whatever runs in between (the switch, a state transfer, a
restart) lies inside that window.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

TARGET_RATIO = 30.0
"""A machine's checkpoint-restart over its live migration (``ratio_*_vs_noise``), at least."""
TARGET_FAILOVER_S = 2.0
"""A lost machine's failover downtime, at most."""
TARGET_RSS_OVERHEAD = 0.02
"""The stayers' memory growth across a machine's migration, at most."""


def records(out: Path) -> list[dict[str, Any]]:
    """The record of every process of the run kept in ``out``."""
    return [
        json.loads(p.read_text())
        for p in sorted(out.glob("*.json"))
        if not p.stem.startswith("killed")
    ]


def killed_at(out: Path) -> float:
    """When the first process of the run kept in ``out`` killed itself (each writes
    ``killed-{rank}.json`` just before)."""
    return min(float(json.loads(p.read_text())["t_kill"]) for p in out.glob("killed*.json"))


def step_rows(records: list[dict[str, Any]]) -> list[list[Any]]:
    """Every step row of every process."""
    return [row for r in records for row in r["steps"]]


def median_step(rows: list[list[Any]], first: int, last: int) -> float:
    """The median step time of steps ``first`` to ``last - 1``."""
    return float(statistics.median(row[4] for row in rows if first <= row[1] < last))


def downtime(before: list[list[Any]], after: list[list[Any]], at: int, median: float) -> float:
    """End of step ``at - 1``'s update in ``before`` to end of step ``at`` in ``after``
    (latest rank at both), minus one median step. Unclamped: a replacement cheaper
    than the step noise can come out slightly below zero."""
    t_before = max(row[3] for row in before if row[1] == at - 1)
    t_after = max(row[3] for row in after if row[1] == at)
    return float(t_after - t_before - median)


def step_noise(rows: list[list[Any]], first: int = 3) -> float | None:
    """How far an ordinary step strays from the median, measured like a downtime (the
    gap between the latest rank's ends of two consecutive steps, minus the median
    gap): the 90th percentile of its size, over steps from ``first`` on (the first
    ones warm up). A downtime under it is not measurable. None when there are too
    few steps to tell."""
    ends: dict[int, float] = {}
    for row in rows:
        ends[row[1]] = max(ends.get(row[1], row[3]), row[3])
    gaps = [ends[s] - ends[s - 1] for s in sorted(ends) if s >= first and s - 1 in ends]
    if len(gaps) < 2:
        return None
    median = statistics.median(gaps)
    devs = sorted(abs(g - median) for g in gaps)
    return float(devs[int(0.9 * (len(devs) - 1))])


def ratio(numerator: float, denominator: float, noise: float | None) -> float | None:
    """``numerator`` over the larger of ``denominator`` and the step ``noise``: a
    denominator lost in the noise cannot make the ratio explode. None when the noise
    could not be measured (too few steps), or both are zero or below."""
    if noise is None:
        return None
    floor = max(denominator, noise)
    return numerator / floor if floor > 0 else None


def above_noise(numerator: float, denominator: float, noise: float | None) -> float | None:
    """The plain ratio, only where its denominator is measurable (above the noise)."""
    if noise is None or denominator <= max(noise, 0.0):
        return None
    return numerator / denominator


def parts_of(downtimes: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The breakdown of the member whose runtime-measured downtime was worst (the
    critical path), from each member's ``wire.Downtime`` as a dict: its parts add up
    to its total. Empty when no member measured one."""
    if not downtimes:
        return {}
    node, worst_one = max(downtimes.items(), key=lambda item: item[1]["total_s"])
    parts = {k: v for k, v in worst_one.items() if k != "total_s"}
    return {"member": node, "total_s": worst_one["total_s"], **parts,
            "parts_sum_s": sum(parts.values())}  # fmt: skip


def restart_parts(
    before: list[dict[str, Any]],
    after: list[dict[str, Any]],
    at: int,
    median: float,
    *,
    exited: float,
) -> dict[str, float]:
    """Where a checkpoint-restart's downtime went, as consecutive intervals of the
    latest process at each point (so they add up to ``downtime``): the job stopping
    after step ``at - 1`` (``before``'s records hold ``save``: [start, end]), saving,
    exiting (every old process gone at ``exited``), the new processes starting (``after``'s
    ``t_built``), forming their group (``t_entered``), loading (``t_loaded``), and the
    first step's excess over a median one."""
    t_stop = max(row[3] for r in before for row in r["steps"] if row[1] == at - 1)
    save_start = max(r["save"][0] for r in before)
    save_end = max(r["save"][1] for r in before)
    built = max(r["t_built"] for r in after)
    entered = max(r["t_entered"] for r in after)
    loaded = max(r["t_loaded"] for r in after)
    t_first = max(row[3] for r in after for row in r["steps"] if row[1] == at)
    return {
        "stop_s": save_start - t_stop,
        "save_s": save_end - save_start,
        "exit_s": exited - save_end,
        "start_s": built - exited,
        "init_group_s": entered - built,
        "load_s": loaded - entered,
        "first_step_s": t_first - loaded - median,
    }


def slowdown(
    before: list[list[Any]], during: list[list[Any]], reference: dict[Any, list[Any]]
) -> float:
    """How much slower the steps ``during`` were than those ``before``, relative to the
    same steps of the ``reference`` run (0.1: 10 % slower)."""
    mine = statistics.mean(r[4] for r in during) / statistics.mean(r[4] for r in before)
    ref_during = statistics.mean(reference[(r[0], r[1])][4] for r in during)
    ref_before = statistics.mean(reference[(r[0], r[1])][4] for r in before)
    return float(mine / (ref_during / ref_before) - 1)


def worst(method: Mapping[str, Any]) -> float:
    """The larger of a switch's two downtimes: from the step records, and the worst
    rank's as the runtime reports it (where it did)."""
    runtime = method.get("runtime_downtime_s")
    return float(method["downtime_s"] if runtime is None else max(method["downtime_s"], runtime))


def losses(out: Path) -> dict[tuple[int, int], float]:
    """Each (rank, step)'s loss in the run kept in ``out``."""
    return {(r[0], r[1]): r[2] for r in step_rows(records(out))}


def loss_match(
    got: dict[tuple[int, int], float], reference: dict[Any, list[Any]], *, complete: bool = True
) -> bool:
    """Same (rank, step) losses as the unmigrated run, within 1e-6. ``complete=False``
    after a failover: the killed ranks' losses died with them, so only those ``got``
    holds are compared (each must be one the reference has)."""
    if complete and set(got) != set(reference):
        return False
    return set(got) <= set(reference) and all(
        abs(v - reference[k][2]) <= 1e-6 for k, v in got.items()
    )


def machine_shortfalls(m: Mapping[str, Any]) -> list[str]:
    """Why a machine's result misses its targets (none: it holds): a live migration
    longer than one median step, checkpoint-restart less than ``TARGET_RATIO`` times
    as long (or not measurable), a failover over ``TARGET_FAILOVER_S``, any method
    that did not train exactly the reference job, or stayers whose memory grew by more
    than ``TARGET_RSS_OVERHEAD``. A downtime is the worse of the step records' and the
    runtime's measure (``worst``)."""
    out = []
    live, median = worst(m), m["median_step_s"]
    if live > median:
        out.append(f"live downtime {live:.3f} s > one median step {median:.3f} s")
    r = m["ratio_checkpoint_restart_vs_noise"]
    if r is None:
        out.append("checkpoint-restart ratio not measurable (step noise unknown)")
    elif r < TARGET_RATIO:
        out.append(f"checkpoint-restart ratio {r:.1f} < {TARGET_RATIO:g}")
    if m["failover"].get("replica") is False:
        pass  # no replica to fail over from: the target holds where a replica exists
    elif m["failover_downtime_s"] is None:
        out.append(f"failover not measured: {m['failover'].get('reason', 'no failover ran')}")
    else:
        failover = max(m["failover_downtime_s"], m["failover"].get("runtime_downtime_s") or 0.0)
        if failover > TARGET_FAILOVER_S:
            out.append(f"failover downtime {failover:.3f} s > {TARGET_FAILOVER_S:g} s")
    for key in ("loss_match", "loss_match_checkpoint_restart", "loss_match_failover"):
        if key in m and not m[key]:
            out.append(f"{key} false: not the reference job's training")
    net = m.get("stayer_rss_overhead_net")
    if net is not None:  # what the unmigrated run did not grow by over the same steps
        if net > TARGET_RSS_OVERHEAD:
            out.append(f"stayer RSS overhead {net:.3f} net of the reference run's growth "
                       f"> {TARGET_RSS_OVERHEAD:g}")  # fmt: skip
    elif m["stayer_rss_overhead"] > TARGET_RSS_OVERHEAD:
        rss = m["stayer_rss_overhead"]
        out.append(f"stayer RSS overhead {rss:.3f} > {TARGET_RSS_OVERHEAD:g}")
    return out


def rss_growth(before: Sequence[Sequence[Any]], after: Sequence[Sequence[Any]]) -> float:
    """How much the largest RSS (column 5 of a step row) of ``after`` exceeds that of
    ``before``, as a fraction of it."""
    peak = float(max(r[5] for r in before))
    return (float(max(r[5] for r in after)) - peak) / peak


class Load:
    """How loaded and how fast this machine was while a benchmark ran (``as_dict`` once
    it is over): its CPUs, the 1-minute load average at the start and at the end, the
    share of CPU time the hypervisor took (steal, where /proc/stat tells), and the
    speed of one core at the start, as the time of one iteration of a fixed Python
    loop: a shared VM runs the same code up to twice as fast on one day as on another,
    so numbers of different days compare only with this beside them."""

    def __init__(self) -> None:
        self.start = os.getloadavg()[0]
        self.loop_ns = python_loop_ns()
        self.cpu_start = _cpu_times()

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cpus": os.cpu_count(),
            "load_1m_start": round(self.start, 2),
            "load_1m_end": round(os.getloadavg()[0], 2),
            "python_loop_ns": round(self.loop_ns, 1),
            "steal_fraction": None,
        }
        end = _cpu_times()
        if self.cpu_start is not None and end is not None:
            total = sum(end) - sum(self.cpu_start)
            if total > 0:
                out["steal_fraction"] = round((end[7] - self.cpu_start[7]) / total, 4)
        return out


def python_loop_ns(n: int = 200_000) -> float:
    """Nanoseconds per iteration of ``for i in range(n): s += i``, the best of three
    runs (some 20 ms each): the speed of one core for the interpreter's kind of work."""
    best = float("inf")
    for _ in range(3):
        t0, total = time.perf_counter_ns(), 0
        for i in range(n):
            total += i
        best = min(best, time.perf_counter_ns() - t0)
    return best / n


def _cpu_times() -> list[int] | None:
    """The machine's CPU times from /proc/stat (user, nice, system, idle, iowait, irq,
    softirq, steal, ...), or None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    return [int(x) for x in fields[1:9]]
