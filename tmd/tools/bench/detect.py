"""``tmd bench detect``: how well and how fast the detectors find what is wrong.

Replays seeded, labelled traces (``tmd.tools.traces``) through the real ``straggler`` and
``rank_stalled`` detectors on simulated time, matches their findings to the labels,
and prints one JSON object. The baseline, in the same run, is the rule most job
monitors start with: flag a rank whose step-time share of the job's total over a
window exceeds its fair share by the same margin (``naive_*`` fields) — it sees
through neither the all-reduce wait nor job-wide slowdowns.

GPU faults are measured end to end instead: a private mosquitto, the real daemon,
fatal XIDs published like an agent does; the latency is publish to ``GpuFault``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tmd import wire
from tmd.clock import SystemClock
from tmd.daemon import events
from tmd.daemon.plugins import Context, Plugin
from tmd.daemon.view import ClusterView
from tmd.detectors.rank_stalled import RankStalledConfig, RankStalledDetector
from tmd.detectors.straggler import StragglerConfig, StragglerDetector
from tmd.tools import traces

MIN_SLOWDOWN = 0.10  # the labels the targets are about: >= 10% ...
MIN_STEPS = 50  # ... lasting >= 50 steps


@dataclass
class Outcome:
    found: list[tuple[events.Event, int]] = field(default_factory=list)  # (finding, front step)


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
    out = Outcome()
    front = 0
    next_tick = trace.batches[0][0] + tick_s if trace.batches else 0.0

    def tick_until(t: float) -> None:
        nonlocal next_tick
        while next_tick <= t:
            for d in dets:
                out.found.extend((e, front) for e in d.tick(next_tick))
            next_tick += tick_s

    for t, batch in trace.batches:
        tick_until(t)
        front = max(front, batch.steps[-1].step)
        view.apply_iter(batch, t)
        for d in dets:
            if d.consumes:
                out.found.extend((e, front) for e in d.observe(batch, t))
    tick_until(next_tick + tail_s)
    return out


def _eligible(label: traces.Label, steps: int) -> bool:
    end = label.end_step if label.end_step is not None else steps + 1
    return (
        label.kind == "straggler"
        and label.slowdown >= MIN_SLOWDOWN
        and end - label.start_step >= MIN_STEPS
    )


def _matches(label: traces.Label, node: str, step: int, window: int) -> bool:
    if label.kind != "straggler" or label.node != node or step < label.start_step:
        return False
    return label.end_step is None or step <= label.end_step + 2 * window


def score_trace(trace: traces.Trace, outcome: Outcome, window: int) -> dict[str, Any]:
    found = [(e, s) for e, s in outcome.found if isinstance(e, events.StragglerFound)]
    tp = [(e, s) for e, s in found if any(_matches(lb, e.node, s, window) for lb in trace.labels)]
    latencies, detected, eligible = [], 0, 0
    for lb in trace.labels:
        if not _eligible(lb, trace.steps):
            continue
        eligible += 1
        hits = [s for e, s in tp if _matches(lb, e.node, s, window)]
        if hits:
            detected += 1
            latencies.append(min(hits) - lb.start_step)
    cleared = [
        any(
            isinstance(e, events.StragglerCleared) and e.node == lb.node and s >= lb.end_step
            for e, s in outcome.found
        )
        for lb in trace.labels
        if lb.kind == "straggler" and lb.end_step is not None
    ]
    stalls = [lb for lb in trace.labels if lb.kind == "stall"]
    stall_found = [
        any(isinstance(e, events.RankStalled) and e.rank == lb.ranks[0] for e, _ in outcome.found)
        for lb in stalls
    ]
    wrong_stalls = [
        e
        for e, _ in outcome.found
        if isinstance(e, events.RankStalled) and not any(e.rank == lb.ranks[0] for lb in stalls)
    ]
    return {
        "findings": len(found),
        "true_findings": len(tp),
        "eligible": eligible,
        "detected": detected,
        "latencies": latencies,
        "cleared": cleared,
        "stalls": len(stalls),
        "stalls_found": sum(stall_found),
        "wrong_stalls": len(wrong_stalls),
    }


class NaiveDetector(Plugin):
    """The baseline: a rank whose mean *step time* over the window exceeds the job's
    mean by ``min_slowdown`` (what a dashboard alert on step time does)."""

    name = "naive"
    consumes = (wire.IterBatch,)

    def __init__(self, window: int, min_slowdown: float) -> None:
        self.window, self.min = window, min_slowdown
        self.hist: dict[int, list[float]] = {}
        self.node: dict[int, str] = {}
        self.flagged: set[str] = set()

    def observe(self, event: Any, now: float) -> Iterable[events.Event]:
        h = self.hist.setdefault(event.rank, [])
        h.extend(s.step_s for s in event.steps)
        del h[: -self.window]
        self.node[event.rank] = event.node
        return ()

    def tick(self, now: float) -> Iterable[events.Event]:
        means = {r: sum(h) / len(h) for r, h in self.hist.items() if len(h) == self.window}
        if len(means) < 3:
            return
        job = statistics.median(means.values())
        for r, m in means.items():
            node = self.node[r]
            if m > job * (1 + self.min) and node not in self.flagged:
                self.flagged.add(node)
                yield events.StragglerFound(
                    ts=now, node=node, slowdown=m / job - 1, confidence=1.0, since_step=0
                )


def _summary(results: list[dict[str, Any]], clean: set[str]) -> dict[str, Any]:
    findings = sum(r["findings"] for r in results)
    lat = sorted(x for r in results for x in r["latencies"])
    eligible = sum(r["eligible"] for r in results)
    return {
        "precision": round(sum(r["true_findings"] for r in results) / findings, 4)
        if findings
        else None,
        "recall": round(sum(r["detected"] for r in results) / eligible, 4) if eligible else None,
        "false_findings_clean": sum(
            r["findings"] + r["wrong_stalls"] for r in results if r["scenario"] in clean
        ),
        "median_latency_steps": statistics.median(lat) if lat else None,
        "p95_latency_steps": lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else None,
    }


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
        default=0,
        help="seeds first..first+seeds-1 (another range is a hold-out set)",
    )
    p.add_argument("--xids", type=int, default=20, help="fatal XIDs sent through the daemon")
    p.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    args = p.parse_args(argv)
    scfg, rcfg = StragglerConfig(), RankStalledConfig()
    clean = {s for s in traces.SCENARIOS if s.startswith("clean")}
    ours, baseline, per_scenario = [], [], {}
    started = time.process_time()
    for scenario in traces.SCENARIOS:
        rows = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            trace = traces.build(scenario, seed)
            view = ClusterView()
            context = Context(view=view, clock=SystemClock())
            dets: list[Plugin] = [
                StragglerDetector(scfg, context=context),
                RankStalledDetector(rcfg, context=context),
            ]
            r = score_trace(trace, replay(trace, dets, view), scfg.window_steps)
            r["scenario"] = scenario
            rows.append(r)
            naive = [NaiveDetector(scfg.window_steps, 0.08)]
            b = score_trace(trace, replay(trace, naive, ClusterView()), scfg.window_steps)
            b["scenario"] = scenario
            baseline.append(b)
        ours.extend(rows)
        lat = [x for r in rows for x in r["latencies"]]
        per_scenario[scenario] = {
            "traces": len(rows),
            "findings": sum(r["findings"] for r in rows),
            "true_findings": sum(r["true_findings"] for r in rows),
            "eligible": sum(r["eligible"] for r in rows),
            "detected": sum(r["detected"] for r in rows),
            "median_latency_steps": statistics.median(lat) if lat else None,
            "cleared_after_recovery": sum(c for r in rows for c in r["cleared"]) or None,
            "stalls_found": (
                f"{sum(r['stalls_found'] for r in rows)}/{sum(r['stalls'] for r in rows)}"
                if any(r["stalls"] for r in rows)
                else None
            ),
            "wrong_stalls": sum(r["wrong_stalls"] for r in rows),
        }
    replay_cpu_s = time.process_time() - started
    out: dict[str, Any] = _summary(ours, clean)
    stalls = sum(r["stalls"] for r in ours)
    out["rank_stall_recall"] = (
        round(sum(r["stalls_found"] for r in ours) / stalls, 4) if stalls else None
    )
    base = _summary(baseline, clean)
    out.update({f"naive_{k}": v for k, v in base.items()})
    out["min_slowdown"], out["min_steps"] = MIN_SLOWDOWN, MIN_STEPS
    out["traces"] = len(ours)
    out["replay_cpu_s"] = round(replay_cpu_s, 2)
    out["gpu_fault_latency"] = asyncio.run(gpu_fault_latency(args.xids)) if args.xids else None
    out["scenarios"] = per_scenario
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0
