"""``tmd demo``: a slow machine found and live-migrated away, on a bare machine.

Everything is real except the slowness, which is injected: a broker (mosquitto when
installed, else the embedded one), the daemon (ingest, detectors, policies, actuator,
journal, HTTP API), and a 4-rank data-parallel training job on two machines of two
ranks (``worker0``, ``worker1``) with one standby machine of two slots
(``standby0``): ``tmd.tools.bench.downtime``'s GPT-style decoder, AdamW, gloo on CPU,
trained on the Python standard library's sources, its telemetry and control over
MQTT. From step ``SLOW_FROM`` GPU 1 of ``worker1`` (its rank of local rank 1) takes
``--slow-s`` longer per step. The straggler detector finds the machine, the
rebalance policy decides at its next tick, and the actuator migrates the whole
machine, both of its ranks, to the pre-warmed standby machine while the job trains
on. Then the same job is checkpoint-restarted, to compare the downtime of the two.

Prints the events as they happen, a summary (detection latency, downtime, the ratio
against checkpoint-restart) and writes a PNG timeline of every rank's step times.
Exit status 0 when the straggler was found and migrated away and the job finished.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tmd import config as config_mod
from tmd import log, wire
from tmd.daemon import events
from tmd.daemon.daemon import Daemon
from tmd.tools.bench import measure

JOB = "demo"
NPROC = 4
PER_NODE = 2
SLOW_NODE = "worker1"  # the machine ...
SLOW_GPU = f"{SLOW_NODE}/1"  # ... of which one GPU (local rank 1) is slow
SLOW_FROM = 12
AFTER_STEPS = 25  # steps the job runs on after the migration
STOP_KEY = "demo/last_step"
LAYERS = 2
DEADLINE_S = 150.0  # for the migration; the demo fails rather than hang


def run(
    *,
    png: str = "tmd-demo.png",
    slow_s: float = 0.5,
    keep: str | None = None,
    embedded_broker: bool = False,
) -> int:
    from tmd.tools.brokers import local_broker

    log.setup(level="warning", format="console")
    broker_cm = local_broker(embedded=embedded_broker)
    with broker_cm as broker, tempfile.TemporaryDirectory(prefix="tmd-demo-") as tmp:
        out = Path(keep) if keep else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        cfg = config_mod.from_dict(
            {
                "mqtt": {"host": broker.host, "port": broker.port},
                "api": {"port": 0},
                "journal": {"path": str(out / "journal.sqlite3")},
                # Rebalance every 6 s instead of every 10 minutes, so the demo is short.
                "policies": {
                    "rebalance": {"interval_min": 0.1, "persist_s": 0.0, "prior_downtime_s": 1.0}
                },
                "guardrails": {"min_standby_pool": 0},  # the demo has a single standby
                "actuator": {"settle_s": 0.2},
            }
        )
        kind = type(broker).__name__
        demo = _demo(
            cfg, broker_addr=(broker.host, broker.port), broker_kind=kind, out=out,
            png=Path(png).resolve(), slow_s=slow_s, kept=bool(keep),
        )  # fmt: skip
        return asyncio.run(demo)


def write_scrape_config(out: Path, port: int) -> Path:
    """``out/prometheus.yml``: a Prometheus scraping the demo's daemon every 5 s as the
    scrape job ``tmd`` (the one deploy/prometheus/tmd-rules.yml and the dashboard read),
    and loading those rules, copied beside it, where this is a checkout that has them."""
    rules = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "tmd-rules.yml"
    loaded = ""
    if rules.is_file():
        shutil.copyfile(rules, out / rules.name)
        loaded = f"rule_files:\n  - {rules.name}\n"
    path = out / "prometheus.yml"
    path.write_text(
        "# tmd demo: point a Prometheus here (prometheus --config.file=THIS), open the\n"
        "# dashboard deploy/grafana/tmd.json on it. The daemon lives as long as the demo.\n"
        "global:\n  scrape_interval: 5s\n  evaluation_interval: 5s\n"
        f"{loaded}"
        "scrape_configs:\n  - job_name: tmd\n    metrics_path: /metrics\n"
        f'    static_configs:\n      - targets: ["127.0.0.1:{port}"]\n'
    )
    return path


def _say(text: str) -> None:
    print(text, flush=True)


class _Progress:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def say(self, text: str) -> None:
        _say(f"  [{time.monotonic() - self.t0:5.1f}s] {text}")


async def _demo(
    cfg: config_mod.Config,
    *,
    broker_addr: tuple[str, int],
    broker_kind: str,
    out: Path,
    png: Path,
    slow_s: float,
    kept: bool = False,
) -> int:
    from tmd.runtime.launch import LocalJob

    host, port = broker_addr
    daemon = Daemon(cfg)
    task = asyncio.create_task(daemon.run())
    await asyncio.wait_for(daemon.ready.wait(), 30)
    sub = daemon.bus.subscribe("demo", (events.Event,))
    api = f"http://127.0.0.1:{daemon.api.port}"
    _say(f"tmd demo: broker {broker_kind} on {host}:{port}; daemon API {api}")
    _say(f"  (in another shell: tmd status --api {api}   tmd events --api {api})")
    if kept and daemon.api.port is not None:
        scrape = write_scrape_config(out, daemon.api.port)
        _say(f"  (Prometheus: prometheus --config.file={scrape}, then import "
             "deploy/grafana/tmd.json into Grafana)")  # fmt: skip
    _say(
        f"  starting a {NPROC}-rank training job on {NPROC // PER_NODE} machines of {PER_NODE} "
        f"ranks, and 1 standby machine of {PER_NODE} slots; from step {SLOW_FROM}, GPU 1 of "
        f"{SLOW_NODE} takes {slow_s:g} s longer per step (injected)"
    )
    p = _Progress()
    cmd = [
        sys.executable, "-m", "tmd.tools.bench.downtime", "worker", "--steps", "100000",
        "--out", str(out / "job"), "--layers", str(LAYERS), "--slow-node", SLOW_GPU,
        "--slow-s", str(slow_s), "--slow-from", str(SLOW_FROM), "--stop-key", STOP_KEY,
    ]  # fmt: skip
    (out / "job").mkdir(parents=True, exist_ok=True)
    job = LocalJob(cmd, nproc=NPROC, standby=1, nproc_per_node=PER_NODE, job=JOB,
                   broker=f"{host}:{port}")  # fmt: skip
    seen: dict[str, Any] = {}
    try:
        await _watch(daemon, sub, job, p, seen)
    finally:
        if STOP_KEY not in seen:
            # Stop soon, at a step no rank has reached yet: ranks that saw the key and
            # ranks that did not must stop at the same step, or the last all-reduce fails.
            job.store.set(STOP_KEY, str(_job_step(daemon) + 10))
        codes = await asyncio.to_thread(job.wait, None)
        job.terminate()
    rejected = await _publish_garbage_and_count(daemon, host, port)
    p.say(f"job finished: exit codes {codes}")
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task

    done = seen.get("finished")
    if done is None or done.outcome != "done":
        _say(f"\nFAILED: no migration finished within {DEADLINE_S:.0f} s ({done})")
        return 1
    p.say("measuring checkpoint-restart on the same job (save, exit, start, load, step) ...")
    restart = await asyncio.to_thread(_checkpoint_restart, out / "restart")
    records = _records(out / "job")
    summary = _summary(seen, records, restart, rejected)
    _print_summary(summary)
    try:
        _plot(records, summary, png)
        _say(f"\ntimeline: {png}")
    except ImportError:
        _say("\ntimeline: not drawn (pip install matplotlib, or the [demo] extra)")
    ok = (
        summary["straggler_node"] == SLOW_NODE
        and done.node == SLOW_NODE
        and all(codes[n] == 0 for n in codes)
    )
    _say(f"\n{'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


async def _watch(daemon: Daemon, sub: Any, job: Any, p: _Progress, seen: dict[str, Any]) -> None:
    """Print what happens until the job has trained AFTER_STEPS past the migration."""
    start = time.monotonic()
    phases: dict[str, str] = {}
    last_line = 0.0
    while True:
        for event in await sub.batch(0.5):
            _show(event, p, seen)
        for flight in list(daemon.actuator.flights.values()):
            if phases.get(flight.id) != flight.phase:
                phases[flight.id] = flight.phase
                p.say(f"migration {flight.id}: {flight.phase} ({flight.leaver} -> {flight.joiner})")
        step = _job_step(daemon)
        if "finished" in seen and STOP_KEY not in seen:
            seen[STOP_KEY] = step + AFTER_STEPS
            job.store.set(STOP_KEY, str(seen[STOP_KEY]))
            p.say(f"the job trains on to step {seen[STOP_KEY]}")
        if time.monotonic() - last_line > 5:
            last_line = time.monotonic()
            p.say(f"step {step}; standby: {_standby_state(daemon)}")
        if all(proc.poll() is not None for proc in job.procs.values()):
            return
        if "finished" not in seen and time.monotonic() - start > DEADLINE_S:
            p.say("no migration in time; stopping the job")
            return


def _show(event: Any, p: _Progress, seen: dict[str, Any]) -> None:
    if isinstance(event, events.StragglerFound) and "found" not in seen:
        seen["found"] = event
        p.say(
            f"StragglerFound: {event.node} is {event.slowdown:+.0%} slower than its peers "
            f"(confidence {event.confidence:.2f}, since step {event.since_step})"
        )
    elif isinstance(event, events.Migrate):
        seen.setdefault("decided", event)
        p.say(f"decision ({event.policy}): migrate {event.node} of {event.job}: {event.reason}")
    elif isinstance(event, events.Hold) and event.node:
        why = event.reason.split(":")[0]
        if seen.get("last_hold") != why:  # each tick holds again; say it once
            seen["last_hold"] = why
            p.say(f"hold ({event.policy}): {event.reason}")
    elif isinstance(event, events.MigrationFinished):
        seen["finished"] = event
        downtime = f"{event.downtime_s:.3f} s" if event.downtime_s is not None else "unknown"
        p.say(
            f"MigrationFinished: {event.node} -> {event.to}, {event.outcome}, downtime {downtime}"
        )


def _job_step(daemon: Daemon) -> int:
    job = daemon.view.jobs.get(JOB)
    if job is None or not job.ranks:
        return 0
    return max(r.last_step for r in job.ranks.values())


def _standby_state(daemon: Daemon) -> str:
    job = daemon.view.jobs.get(JOB)
    if job is None:
        return "starting"
    if not job.standbys:
        return "none (it joined the job)" if job.generation else "starting"
    return ", ".join(f"{s.node} {s.state}" for s in job.standbys.values())


async def _publish_garbage_and_count(daemon: Daemon, host: str, port: int) -> int:
    """A malformed message must be counted and dropped, never kill anything."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    before = sum(t.value for t in daemon.metrics.rejected_by.values())
    client = paho.Client(CallbackAPIVersion.VERSION2)
    client.connect(host, port)
    client.loop_start()
    info = client.publish(wire.iter_topic(JOB, 0), b'{"v": 1, "ts": "yesterday"}', qos=1)
    await asyncio.to_thread(info.wait_for_publish, 5)
    client.loop_stop()
    client.disconnect()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        now = sum(t.value for t in daemon.metrics.rejected_by.values())
        if now > before:
            return int(now - before)
        await asyncio.sleep(0.05)
    return 0


def _checkpoint_restart(out: Path) -> dict[str, Any]:
    from tmd.tools.bench import downtime

    args = argparse.Namespace(nproc=NPROC, steps=10, switch_at=6, layers=LAYERS, layout="")
    result = downtime._checkpoint_restart(out, args, per_node=PER_NODE)
    result.pop("loss", None)
    return result


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def _summary(
    seen: dict[str, Any], records: list[dict[str, Any]], restart: dict[str, Any], rejected: int
) -> dict[str, Any]:
    found: events.StragglerFound = seen["found"]
    done: events.MigrationFinished = seen["finished"]
    rows = [row for r in records for row in r["steps"]]  # [rank, step, loss, end, step_s, ...]
    slow_start = max((row[3] for row in rows if row[1] == SLOW_FROM - 1), default=found.ts)
    steps_by_then = max((row[1] for row in rows if row[3] <= found.ts), default=SLOW_FROM)
    joiner = next((r for r in records if r["node"] == done.to), None)
    switch_step = min(row[1] for row in joiner["steps"]) if joiner and joiner["steps"] else None
    healthy_rows = [row for row in rows if 2 < row[1] < SLOW_FROM - 1]
    healthy = [row[4] for row in healthy_rows]
    # As ``tmd bench downtime`` measures it (``tmd.tools.bench.measure``), from every
    # rank's step records: end of the last update before the switch to end of the
    # first step after it (latest rank at both), minus one median step of the job as
    # it runs after the migration. The switch runs inside that window. The ratio
    # divides by the larger of that downtime and the step noise before the slowdown,
    # so a switch cheaper than the noise cannot inflate it.
    downtime = gap = None
    if switch_step is not None:
        after = [row[4] for row in rows if switch_step + 1 < row[1]]
        t_before = max(row[3] for row in rows if row[1] == switch_step - 1)
        t_after = max(row[3] for row in rows if row[1] == switch_step)
        gap = t_after - t_before
        downtime = gap - (statistics.median(after) if after else 0.0)
    noise = measure.step_noise(healthy_rows, first=0)
    ratio = None
    if downtime is not None:
        ratio = measure.ratio(restart["downtime_s"], max(downtime, done.downtime_s or 0.0), noise)
    return {
        "straggler_node": found.node,
        "slowdown": found.slowdown,
        "detection_latency_s": found.ts - slow_start,
        "detection_latency_steps": steps_by_then - SLOW_FROM + 1,
        "migrated": f"{done.node} -> {done.to}",
        "switch_step": switch_step,
        "downtime_s": downtime,
        "runtime_downtime_s": done.downtime_s,
        "median_step_s": statistics.median(healthy) if healthy else None,
        "step_noise_s": noise,
        "checkpoint_restart_s": restart["downtime_s"],
        "checkpoint_restart_breakdown": restart["breakdown"],
        "gap_s": gap,
        "ratio_checkpoint_restart_vs_noise": ratio,
        "malformed_counted": rejected,
    }


def _print_summary(s: dict[str, Any]) -> None:
    ratio = s["ratio_checkpoint_restart_vs_noise"]
    median = s["median_step_s"]
    lines = [
        "",
        "SUMMARY",
        f"  straggler           {s['straggler_node']}, {s['slowdown']:+.0%} slower than its peers",
        f"  detection latency   {s['detection_latency_s']:.1f} s "
        f"({s['detection_latency_steps']} steps after the slowdown began)",
        f"  live migration      {s['migrated']} at step {s['switch_step']}",
        f"  downtime            {s['downtime_s']:.3f} s from the step records "
        f"(the runtime measured {s['runtime_downtime_s'] or 0:.3f} s; median step "
        + (f"{median:.3f} s before the slowdown)" if median else "unknown)"),
        f"  checkpoint-restart  {s['checkpoint_restart_s']:.2f} s on the same job "
        + "("
        + ", ".join(f"{k} {v:.2f}" for k, v in s["checkpoint_restart_breakdown"].items())
        + ")",
        f"  step gap            {s['gap_s']:.3f} s across the switch (end of the last update "
        f"before it to end of the first step after it)",
        f"  ratio               checkpoint-restart takes {ratio:.0f}x longer (over the larger "
        f"of the live downtime and the step noise, {s['step_noise_s']:.3f} s)"
        if ratio
        else "  ratio               n/a (too few steps to measure the noise)",
        f"  bad input           {s['malformed_counted']} malformed message counted and dropped",
    ]
    _say("\n".join(lines))


def _plot(records: list[dict[str, Any]], summary: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=110)
    for r in sorted(records, key=lambda r: (r["node"], r.get("local_rank", 0))):
        rows = [row for row in r["steps"]]
        if not rows:
            continue
        name = f"{r['node']}/{r.get('local_rank', 0)}"
        label = name + (" (slowed GPU)" if name == SLOW_GPU else "")
        if r["role"] == "standby":
            label += f" (joined as rank {rows[0][0]})"
        ax.plot([row[1] for row in rows], [row[4] for row in rows], marker=".", lw=1, label=label)
    ax.axvspan(SLOW_FROM, summary["switch_step"] or SLOW_FROM, color="tab:red", alpha=0.08)
    found = SLOW_FROM - 1 + summary["detection_latency_steps"]
    ax.axvline(found, color="tab:orange", ls="--", lw=1)
    ax.text(found, ax.get_ylim()[1] * 0.95, " straggler found", color="tab:orange", va="top")
    if summary["switch_step"] is not None:
        ax.axvline(summary["switch_step"], color="tab:green", ls="--", lw=1)
        ax.text(
            summary["switch_step"], ax.get_ylim()[1] * 0.85,
            f" live migration\n step gap {summary['gap_s']:.2f} s", color="tab:green",
            va="top",
        )  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("step time (s)")
    ratio = summary["ratio_checkpoint_restart_vs_noise"]
    ax.set_title(
        f"tmd demo: {summary['migrated']}; checkpoint-restart on the same job "
        f"{summary['checkpoint_restart_s']:.1f} s" + (f" ({ratio:.0f}x)" if ratio else "")
    )
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(run())
