"""``tmd bench detect``: how well and how fast the detectors find what is wrong.

Replays seeded, labelled traces (``tmd.tools.traces``: 16 machines of 8 ranks, ranks
that drift slowly, a job that drifts, jittery all-reduce timings, slowdowns that
switch on, ramp up or come and go, two at once) through the real ``straggler`` and
``rank_stalled`` detectors on simulated time, matches their findings to the labels,
and prints one JSON object. ``--rho`` and ``--sigma`` set the ranks' drift.

What the targets are about. A label counts for recall when it is a slowdown of at
least ``MIN_SLOWDOWN`` lasting at least ``MIN_STEPS`` steps that is *separable*: its
``z`` (``tmd.tools.traces.separability``) is at least ``MIN_Z``, i.e. at full strength
it stands out from the ranks' slow drift and static spread (sigma and hw_spread
together) by ``MIN_Z`` standard deviations, either on its slowest rank alone
(``ln(1 + s) / noise``) or on its machine's mean over n ranks when k of them are slow
(``k/n * ln(1 + s) * sqrt(n) / noise``). With the default drift (sigma 5%, rho 0.98)
a whole machine 10% slow is separable (z 5.2) and one GPU 25% slow is not (z 4.3):
a rank drifting by 5% for ~50 steps at a time shows as large and as lasting an
excursion a few times in every job of 128 ranks, so a detector that found such a GPU
would also raise false alarms on clean jobs. Labels in scope but not separable are
reported apart (``inseparable_*``), not held against recall; a finding on any truly
slowed machine is a true finding; every finding on a clean trace is a false one.

Two baselines run in the same replay, the rules most job monitors start with: flag a
rank whose mean over a window exceeds the median rank's by 8%, of its *step time*
(``naive_*``: blind, since every rank waits for the slowest and step times are alike)
and of its *busy time* (``naive_busy_*``: the same signal as the detector, without
peer-relative noise, robust statistics or persistence).

GPU faults are measured end to end instead: a private mosquitto, the real daemon,
fatal XIDs published like an agent does; the latency is publish to ``GpuFault``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tmd import log, wire
from tmd.clock import SystemClock
from tmd.daemon import events
from tmd.daemon.plugins import Context, Plugin
from tmd.daemon.view import ClusterView
from tmd.detectors.rank_stalled import RankStalledConfig, RankStalledDetector
from tmd.detectors.straggler import StragglerConfig, StragglerDetector
from tmd.tools import traces
from tmd.tools.bench import Progress
from tmd.tools.bench.measure import Load

MIN_SLOWDOWN = 0.10  # the labels the targets are about: >= 10% ...
MIN_STEPS = 50  # ... lasting >= 50 steps ...
MIN_Z = 5.0  # ... standing out from the ranks' drift by >= 5 sigmas (module docstring)
HELD_OUT = 100  # the default seeds start here; the detector was tuned on lower ones
NAIVE_SLOWDOWN = 0.08  # the baselines' threshold: the detector's min_slowdown

Found = list[tuple[events.Event, int]]  # (finding, the job's front step then)


@dataclass
class Outcome:
    found: Found = field(default_factory=list)  # every detector's, in order
    by: dict[str, Found] = field(default_factory=dict)  # by detector name


def replay(
    trace: traces.Trace,
    detectors: Iterable[Plugin],
    view: ClusterView,
    *,
    tick_s: float = 1.0,
    tail_s: float = 120.0,
) -> Outcome:
    """Feed the trace in time order to the view (as ingest does) and to the detectors
    that consume messages, ticking every ``tick_s``; the detectors' context must hold
    the same ``view``."""
    dets = list(detectors)
    out = Outcome(by={d.name: [] for d in dets})
    observers = [d for d in dets if d.consumes]
    front = 0
    next_tick = trace.batches[0][0] + tick_s if trace.batches else 0.0

    def record(d: Plugin, found: Iterable[events.Event]) -> None:
        for e in found:
            out.found.append((e, front))
            out.by[d.name].append((e, front))

    def tick_until(t: float) -> None:
        nonlocal next_tick
        while next_tick <= t:
            for d in dets:
                record(d, d.tick(next_tick))
            next_tick += tick_s

    for t, batch in trace.batches:
        tick_until(t)
        front = max(front, batch.steps[-1].step)
        view.apply_iter(batch, t)
        for d in observers:
            record(d, d.observe(batch, t))
    tick_until(next_tick + tail_s)
    return out


def in_scope(label: traces.Label, steps: int) -> bool:
    """A straggler label of the size and duration the targets are about."""
    end = label.end_step if label.end_step is not None else steps + 1
    return (
        label.kind == "straggler"
        and label.slowdown >= MIN_SLOWDOWN
        and end - label.start_step >= MIN_STEPS
    )


def onset(label: traces.Label, *, separable_from: bool = True) -> int:
    """Where the latency of finding ``label`` counts from: its first step of at least
    ``MIN_SLOWDOWN`` that, at the strength it has then, stands out from the ranks'
    drift by ``MIN_Z`` (``separable``, applied to the slowdown so far). A ramp's extra
    grows by ``slowdown / ramp_steps`` a step; no detector can find a 10% slowdown
    before it is one, nor one GPU 10% slow in ranks that drift by 5% before it has
    grown to ~30%. ``separable_from=False``: from the first step of 10% alone."""
    if not label.ramp_steps or label.slowdown <= 0:
        return label.start_step
    need = MIN_SLOWDOWN
    if separable_from and 0 < label.z < math.inf:
        # z grows with log(1 + strength): the strength at which it reaches MIN_Z.
        need = max(need, math.expm1(MIN_Z / label.z * math.log1p(label.slowdown)))
    steps = math.ceil(label.ramp_steps * min(1.0, need / label.slowdown))
    return label.start_step + steps - 1


def separable(label: traces.Label) -> bool:
    return label.z >= MIN_Z


def matches(label: traces.Label, node: str, step: int, window: int) -> bool:
    """Whether a finding on ``node`` at ``step`` is about ``label``: the same machine,
    at or after the onset, and not long after the end."""
    if label.kind != "straggler" or label.node != node or step < label.start_step:
        return False
    return label.end_step is None or step <= label.end_step + 2 * window


@dataclass
class TraceScore:
    """One detector on one trace."""

    scenario: str
    findings: int = 0  # StragglerFound, all
    true_findings: int = 0  # ... that match a straggler label
    eligible: int = 0  # labels in scope and separable: what recall is about
    detected: int = 0
    inseparable: int = 0  # labels in scope, not separable: reported, not held to
    inseparable_detected: int = 0
    latencies: list[int] = field(default_factory=list)  # steps from onset, eligible only
    latencies_10pct: list[int] = field(default_factory=list)  # ... from the first 10% step
    cleared: list[bool] = field(default_factory=list)  # per label that ends
    flapped: int = 0  # labels whose machine was cleared while they lasted, once found
    stalls: int = 0
    stalls_found: int = 0
    wrong_stalls: int = 0

    @property
    def clean(self) -> bool:
        return self.scenario.startswith("clean")


def score_trace(trace: traces.Trace, found: Found, window: int) -> TraceScore:
    """Match one detector's findings (``Outcome.by[name]``) to the trace's labels."""
    out = TraceScore(trace.scenario)
    hits = [(e.node, s) for e, s in found if isinstance(e, events.StragglerFound)]
    out.findings = len(hits)
    out.true_findings = sum(any(matches(lb, n, s, window) for lb in trace.labels) for n, s in hits)
    for lb in trace.labels:
        if not in_scope(lb, trace.steps):
            continue
        steps = [s for n, s in hits if matches(lb, n, s, window)]
        if not separable(lb):
            out.inseparable += 1
            out.inseparable_detected += bool(steps)
            continue
        out.eligible += 1
        if steps:
            out.detected += 1
            # Found before the onset (a ramp that stood out early): no latency, not less.
            out.latencies.append(max(0, min(steps) - onset(lb)))
            out.latencies_10pct.append(max(0, min(steps) - onset(lb, separable_from=False)))
            end = lb.end_step if lb.end_step is not None else trace.steps + 1
            out.flapped += any(
                isinstance(e, events.StragglerCleared) and e.node == lb.node
                and min(steps) <= s < end
                for e, s in found
            )  # fmt: skip
    out.cleared = [
        any(
            isinstance(e, events.StragglerCleared) and e.node == lb.node and s >= lb.end_step
            for e, s in found
        )
        for lb in trace.labels
        if lb.kind == "straggler" and lb.end_step is not None
    ]
    stalled = {lb.ranks[0] for lb in trace.labels if lb.kind == "stall"}
    reported = {e.rank for e, _ in found if isinstance(e, events.RankStalled)}
    out.stalls, out.stalls_found = len(stalled), len(stalled & reported)
    out.wrong_stalls = sum(
        1 for e, _ in found if isinstance(e, events.RankStalled) and e.rank not in stalled
    )
    return out


class NaiveDetector(Plugin):
    """The baseline: a node with a rank whose mean *step time* over the window exceeds
    the median rank's by ``min_slowdown`` (what a dashboard alert on step time does)."""

    name = "naive"
    consumes = (wire.IterBatch,)

    def __init__(self, window: int, min_slowdown: float) -> None:
        self.window, self.min = window, min_slowdown
        self.hist: dict[int, deque[float]] = {}
        self.sums: dict[int, float] = {}  # of each rank's window, kept as it slides
        self.node: dict[int, str] = {}
        self.flagged: set[str] = set()

    def value(self, s: wire.StepTiming) -> float:
        return s.step_s

    def observe(self, event: Any, now: float) -> Iterable[events.Event]:
        r = event.rank
        h = self.hist.get(r)
        if h is None:
            h = self.hist[r] = deque()
            self.sums[r] = 0.0
        total = self.sums[r]
        for s in event.steps:
            v = self.value(s)
            h.append(v)
            total += v
            if len(h) > self.window:
                total -= h.popleft()
        self.sums[r] = total
        self.node[r] = event.node
        return ()

    def tick(self, now: float) -> Iterable[events.Event]:
        """Flag a node when one of its ranks is above, re-arm it when none is (so a
        baseline that fired early still gets to find a later straggler)."""
        full = self.window
        means = {r: self.sums[r] / full for r, h in self.hist.items() if len(h) == full}
        if len(means) < 3:
            return
        job = statistics.median(means.values())
        above: dict[str, float] = {}
        for r, m in means.items():
            if m > job * (1 + self.min):
                node = self.node[r]
                above[node] = max(above.get(node, 0.0), m / job - 1)
        for node in sorted(self.flagged - above.keys()):
            self.flagged.discard(node)
            yield events.StragglerCleared(ts=now, node=node)
        for node, slowdown in above.items():
            if node not in self.flagged:
                self.flagged.add(node)
                yield events.StragglerFound(
                    ts=now, node=node, slowdown=slowdown, confidence=1.0, since_step=0
                )


class NaiveBusyDetector(NaiveDetector):
    """The fair baseline: the same rule on *busy time* (step minus all-reduce wait), the
    detector's own signal, without its peer-relative noise level or persistence."""

    name = "naive_busy"

    def value(self, s: wire.StepTiming) -> float:
        return s.step_s - s.allreduce_s


def run_trace(
    trace: traces.Trace, scfg: StragglerConfig, rcfg: RankStalledConfig
) -> dict[str, TraceScore]:
    """One replay of ``trace`` through the detectors and both baselines, scored each:
    ``ours`` (straggler and rank_stalled together), ``naive``, ``naive_busy``."""
    view = ClusterView()
    context = Context(view=view, clock=SystemClock())
    dets: list[Plugin] = [
        StragglerDetector(scfg, context=context),
        RankStalledDetector(rcfg, context=context),
        NaiveDetector(scfg.window_steps, NAIVE_SLOWDOWN),
        NaiveBusyDetector(scfg.window_steps, NAIVE_SLOWDOWN),
    ]
    out = replay(trace, dets, view)
    w = scfg.window_steps
    return {
        "ours": score_trace(trace, out.by["straggler"] + out.by["rank_stalled"], w),
        "naive": score_trace(trace, out.by["naive"], w),
        "naive_busy": score_trace(trace, out.by["naive_busy"], w),
    }


def _ratio(num: int, den: int) -> float | None:
    return round(num / den, 4) if den else None


def _p95(ordered: list[int]) -> int | None:
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] if ordered else None


def summary(scores: list[TraceScore]) -> dict[str, Any]:
    """Precision, recall (of separable labels), false findings on clean traces, latency."""
    lat = sorted(x for r in scores for x in r.latencies)
    lat10 = sorted(x for r in scores for x in r.latencies_10pct)
    return {
        "precision": _ratio(sum(r.true_findings for r in scores), sum(r.findings for r in scores)),
        "recall": _ratio(sum(r.detected for r in scores), sum(r.eligible for r in scores)),
        "false_findings_clean": sum(r.findings + r.wrong_stalls for r in scores if r.clean),
        "median_latency_steps": statistics.median(lat) if lat else None,
        "p95_latency_steps": _p95(lat),
        # The same, counted from a ramp's first step of 10% even where it cannot yet
        # be told from drift (one GPU ramping): what the onset above leaves out.
        "p95_latency_from_10pct_steps": _p95(lat10),
        "inseparable_labels": sum(r.inseparable for r in scores),
        "inseparable_recall": _ratio(
            sum(r.inseparable_detected for r in scores), sum(r.inseparable for r in scores)
        ),
        # Eligible labels whose machine was cleared while the slowdown lasted, after it
        # was found (an intermittent straggler must be one finding, kept).
        "flapping_labels": sum(r.flapped for r in scores),
        # Over every label of >= MIN_SLOWDOWN lasting >= MIN_STEPS, separable or not.
        "recall_all_labels": _ratio(
            sum(r.detected + r.inseparable_detected for r in scores),
            sum(r.eligible + r.inseparable for r in scores),
        ),
    }


_COUNTS = ("findings", "true_findings", "eligible", "detected", "inseparable")


def _per_scenario(rows: list[TraceScore]) -> dict[str, Any]:
    lat = [x for r in rows for x in r.latencies]
    stalls = sum(r.stalls for r in rows)
    out: dict[str, Any] = {"traces": len(rows)}
    out.update({k: sum(getattr(r, k) for r in rows) for k in _COUNTS})
    out.update(
        inseparable_detected=sum(r.inseparable_detected for r in rows),
        median_latency_steps=statistics.median(lat) if lat else None,
        cleared_after_recovery=sum(c for r in rows for c in r.cleared) or None,
        stalls_found=f"{sum(r.stalls_found for r in rows)}/{stalls}" if stalls else None,
        wrong_stalls=sum(r.wrong_stalls for r in rows),
        flapping_labels=sum(r.flapped for r in rows),
    )
    return out


Work = tuple[str, int, traces.JobShape, StragglerConfig]


def _score_one(work: Work) -> tuple[str, dict[str, TraceScore], float]:
    """Build and replay one trace (in a worker process when ``jobs`` > 1)."""
    scenario, seed, shape, scfg = work
    started = time.process_time()
    scored = run_trace(traces.build(scenario, seed, shape), scfg, RankStalledConfig())
    return scenario, scored, time.process_time() - started


def evaluate(
    seeds: Iterable[int],
    shape: traces.JobShape | None = None,
    scenarios: Iterable[str] | None = None,
    scfg: StragglerConfig | None = None,
    *,
    jobs: int = 1,
) -> dict[str, Any]:
    """The replay half of the bench: every scenario at every seed, through the
    detectors and the baselines, on ``jobs`` processes (traces are independent and
    seeded, so the result does not depend on it); what ``main`` prints, less the GPU
    fault latency."""
    shape = shape or traces.JobShape()
    scfg = scfg or StragglerConfig()
    work = [(sc, seed, shape, scfg) for sc in scenarios or traces.SCENARIOS for seed in seeds]
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            results = list(pool.map(_score_one, work))
    else:
        results = [_score_one(w) for w in work]
    rows: dict[str, list[TraceScore]] = {"ours": [], "naive": [], "naive_busy": []}
    by_scenario: dict[str, list[TraceScore]] = {}
    for scenario, scored, _ in results:
        for key, score in scored.items():
            rows[key].append(score)
        by_scenario.setdefault(scenario, []).append(scored["ours"])
    ours = rows["ours"]
    out = summary(ours)
    stalls = sum(r.stalls for r in ours)
    out["rank_stall_recall"] = _ratio(sum(r.stalls_found for r in ours), stalls)
    for key in ("naive", "naive_busy"):
        out.update({f"{key}_{k}": v for k, v in summary(rows[key]).items()})
    cpu_s = round(sum(c for _, _, c in results), 2)
    out.update(
        min_slowdown=MIN_SLOWDOWN, min_steps=MIN_STEPS, min_z=MIN_Z, rho=shape.rho,
        sigma=shape.sigma, machines=shape.nodes, ranks_per_machine=shape.ranks_per_node,
        steps=shape.steps, traces=len(ours), replay_cpu_s=cpu_s,
    )  # fmt: skip
    out["scenarios"] = {sc: _per_scenario(rows) for sc, rows in by_scenario.items()}
    return out


async def gpu_fault_latency(samples: int) -> dict[str, Any]:
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    from tmd import config as config_mod
    from tmd.daemon.daemon import Daemon
    from tmd.tools.mosquitto import Mosquitto

    with Mosquitto() as broker, tempfile.TemporaryDirectory() as state:
        daemon = Daemon(
            config_mod.from_dict(
                {
                    "mqtt": {"host": broker.host, "port": broker.port},
                    "api": {"port": 0},
                    "journal": {"path": f"{state}/j.sqlite3"},
                    "log": {"level": "warning"},
                }
            )
        )
        task = asyncio.create_task(daemon.run())
        await asyncio.wait_for(daemon.ready.wait(), 30)
        faults = daemon.bus.subscribe("bench", (events.GpuFault,))
        client = paho.Client(CallbackAPIVersion.VERSION2)
        client.connect(broker.host, broker.port)
        client.loop_start()
        latencies = []
        for i in range(samples):
            node = f"xid-node-{i}"
            sent = time.time()
            xid = wire.XidEvent(ts=sent, node=node, gpu=i % 8, xid=79)
            client.publish(wire.node_topic(node, "xid"), wire.encode(xid), qos=1)
            got = await faults.batch(5.0)
            assert got and got[0].node == node, f"no GpuFault for {node}"  # type: ignore[attr-defined]
            latencies.append(time.time() - sent)
            await asyncio.sleep(0.05)
        client.loop_stop()
        client.disconnect()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    latencies.sort()
    return {
        "samples": samples,
        "p50_s": round(statistics.median(latencies), 5),
        "max_s": round(latencies[-1], 5),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="tmd bench detect",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seeds", type=int, default=8, help="traces per scenario")
    p.add_argument(
        "--first-seed",
        type=int,
        default=HELD_OUT,
        help="seeds first..first+seeds-1 (default: a set the tuning never saw; "
        f"the detector was tuned on 0..{HELD_OUT - 1})",
    )
    shape = traces.JobShape()
    p.add_argument("--rho", type=float, default=shape.rho, help="ranks' drift: lag-one correlation")
    p.add_argument(
        "--sigma", type=float, default=shape.sigma, help="ranks' drift: standard deviation"
    )
    p.add_argument(
        "--jobs", type=int, default=min(8, os.cpu_count() or 1), help="processes replaying"
    )
    p.add_argument("--xids", type=int, default=20, help="fatal XIDs sent through the daemon")
    p.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    args = p.parse_args(argv)
    log.setup(level="warning")  # on stderr: stdout carries the JSON alone
    if not (0 <= args.rho < 1 and 0 <= args.sigma <= 1):
        p.error("--rho must be in [0, 1) and --sigma in [0, 1]")
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    shape, load, progress = traces.JobShape(rho=args.rho, sigma=args.sigma), Load(), Progress()
    progress.say(f"replaying the traces of {args.seeds} seeds")
    out = evaluate(seeds, shape, jobs=max(1, args.jobs))
    scenarios = out.pop("scenarios")
    out["gpu_fault_latency"] = asyncio.run(gpu_fault_latency(args.xids)) if args.xids else None
    out["scenarios"] = scenarios
    out["host_load"] = load.as_dict()
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0
