"""``tmd bench ingest``: how much rank telemetry one daemon takes in, and how fast.

Starts its own mosquitto (or uses ``--broker``), runs the real daemon (ingest, view,
bus, plug-ins, API) in this process, and a synthetic publisher in another: N ranks at
one step per second each, batched as the runtime sends them, plus one GPU sample per
second from each of N/8 nodes. Prints one JSON object.

``loss`` is the fraction of published rank-steps missing from the view at the end.
Latency is counted per rank-step, from the end of the step (its ``end_ts``) to the
moment the daemon applied it to the view, on the same host clock: what a user waits
before the daemon knows of a step, batching delay included (a ``--flush-s`` longer
than the step shows up in it). The target holds when nothing is lost, the p99 latency
is under a second, and the publisher kept its schedule: it must never fall behind by
more than half the shorter of the flush interval and the step, or its batches would
carry more steps in fewer messages than N ranks send, a lighter load than the one
claimed (``publisher_behind_limit_s``; ``shortfalls`` says what failed).
The baseline is aiomqtt's stock message iterator feeding the same handler, measured
in the same run at the same load for as long: ``cpu_ratio_vs_iterator`` is our CPU
per message over its CPU per message (lower is better).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from itertools import accumulate
from multiprocessing.process import BaseProcess
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from tmd import config as config_mod
from tmd import log, wire
from tmd.daemon import events
from tmd.daemon.daemon import Daemon
from tmd.daemon.ingest import Ingest
from tmd.tools import synth
from tmd.tools.bench import Progress, measure
from tmd.tools.mosquitto import Mosquitto

STEP_S = 1.0
"""Every synthetic rank's step time: one step per second."""
TARGET_P99_S = 1.0
"""The p99 latency, step end to applied, under which the target holds."""
TARGET_RSS_MB = 2048.0
"""The daemon's resident memory at the end of a run, under which the target holds."""
MAX_BEHIND_FRACTION = 0.5
"""How far the publisher may fall behind its schedule, as a fraction of the shorter
of the flush interval and the step. Behind by a whole one, it merges batches: fewer,
larger messages, a lighter load than N ranks offer. Half is the margin allowed."""


def step_latencies(ends: npt.ArrayLike, applied_at: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Seconds from the end of each step (``ends``, their ``end_ts``) to ``applied_at``
    (one time, or one per step), when the daemon applied it: a step that waited in the
    runtime's batch, or in its machine's agent, waited for the user."""
    out: npt.NDArray[np.float64] = np.asarray(applied_at, np.float64) - np.asarray(ends, np.float64)
    return out


def relayed_ends(relayed: wire.RelayedBatches, taken: Sequence[int]) -> Sequence[float]:
    """The ``end_ts`` of every step of the batches ``taken`` from ``relayed``."""
    if len(taken) == len(relayed.count):
        return relayed.end_ts  # the usual message: every batch taken
    starts = list(accumulate(relayed.count, initial=0))
    return [end for i in taken for end in relayed.end_ts[starts[i] : starts[i + 1]]]


def behind_limit_s(*, flush_s: float, step_s: float) -> float:
    """How far behind its schedule the publisher may fall before the load it offers is
    lighter than the one claimed (``MAX_BEHIND_FRACTION``)."""
    return MAX_BEHIND_FRACTION * min(flush_s, step_s)


@dataclass(frozen=True)
class Offered:
    """What a run offers the daemon, but its size: how the ranks publish, and how many
    shards take them in (``ingest.shards``)."""

    flush_s: float = 1.0
    via: str = "direct"
    relay_sample: bool = False
    full_sample_every_s: float = config_mod.AgentConfig.full_sample_every_s
    shards: int = 0
    jobs: int = 1  # the ranks split into as many jobs (``SynthSpec.jobs``)


class RecordingIngest(Ingest):
    """The daemon's ingest, measured: the latency of every rank-step applied (step end
    to applied, exact rather than histogram buckets). A shard's (``ingest.shards``)
    sends them to the head when asked (``dump``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # When each message's steps were applied, how many, and their ends, in flat
        # arrays (no object per message for the collector to walk): the latencies are
        # worked out after the run, so what the bench records costs the daemon little.
        self._at: array[float] = array("d")
        self._steps_of: array[int] = array("q")
        self._ends: array[float] = array("d")

    def dump(self) -> bytes:
        return self.latencies().tobytes()

    def latencies(self) -> npt.NDArray[np.float64]:
        """Every rank-step applied so far, its latency (``step_latencies``)."""
        at = np.repeat(np.asarray(self._at), np.asarray(self._steps_of, np.int64))
        return step_latencies(self._ends, at)

    def _record(self, ends: Sequence[float], now: float) -> None:
        self._at.append(now)
        self._steps_of.append(len(ends))
        self._ends.extend(ends)

    def _applied(self, sent: float, rows: Sequence[wire.Row], now: float) -> None:
        super()._applied(sent, rows, now)  # a rank's own batch
        self._record([row[1] for row in rows], now)

    def _relayed_applied(self, relayed: wire.RelayedBatches, taken: list[int], now: float) -> None:
        super()._relayed_applied(relayed, taken, now)  # batches relayed by their agent
        self._record(relayed_ends(relayed, taken), now)


class BenchIngest(RecordingIngest):
    """The daemon's ingest, measured; with ``stock_iterator`` the baseline: aiomqtt's
    stock iterator (a task per message) feeding the same handler."""

    def __init__(self, daemon: Daemon, *, stock_iterator: bool) -> None:
        super().__init__(
            mqtt=daemon.config.mqtt,
            config=daemon.config.ingest,
            view=daemon.view,
            bus=daemon.bus,
            metrics=daemon.metrics,
            clock=daemon.clock,
        )
        self._stock_iterator = stock_iterator

    def _reads_inline(self) -> bool:
        return not self._stock_iterator


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` by nearest rank (exact, not bucketed); None
    for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _rss_mb(pids: Sequence[int] = ()) -> float:
    """Resident memory now, this process's and those of ``pids`` (its shards): ru_maxrss
    would be the peak of every run in this process."""
    pages = 0
    for pid in ("self", *pids):
        with open(f"/proc/{pid}/statm") as f:
            pages += int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def _cpu_s(pids: Sequence[int] = ()) -> float:
    """CPU seconds this process and those of ``pids`` (its shards) used."""
    t = os.times()
    return t.user + t.system + sum(process_cpu_s(pid) or 0.0 for pid in pids)


def process_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user and system) process ``pid`` has used; None if unknown."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _config(host: str, port: int, ranks: int, state: str, shards: int) -> config_mod.Config:
    return config_mod.from_dict(
        {
            "mqtt": {"host": host, "port": port},
            "api": {"port": 0},
            "journal": {"path": f"{state}/journal.sqlite3"},
            "ingest": {
                "max_nodes": max(65536, ranks),
                "max_ranks": max(1 << 17, ranks),
                "max_ranks_per_job": max(1 << 17, ranks),
                "reject_log_interval_s": 5.0,
                "shards": shards,
            },
        }
    )


_DRAIN_S: Final = 20.0
_STILL_S: Final = 2.0


async def _publish(spec: synth.SynthSpec) -> tuple[synth.SynthResult, BaseProcess]:
    """Run the synthetic publisher to its end; its result and its process."""
    proc, results = synth.start(spec)
    result: synth.SynthResult | None = None
    while result is None:
        await asyncio.sleep(0.2)
        if not results.empty():
            result = results.get()
        elif not proc.is_alive() and results.empty():
            raise RuntimeError(f"publisher exited with {proc.exitcode}")
    return result, proc


async def _drain(daemon: Daemon, rank_steps: int) -> None:
    """Wait until the view holds every step published, or has stopped growing for
    ``_STILL_S`` (what the broker dropped never comes), for at most ``_DRAIN_S``.

    Not longer once it stops growing: the publisher has stopped, so every machine is
    silent from its last message on, and a wait past ``node_lost``'s heartbeat timeout
    (15 s) would count its findings of that silence as the run's decisions. (While the
    view grows the daemon is still reading what they sent: no silence yet.)"""
    view_steps, still = -1, 0
    for _ in range(int(_DRAIN_S / 0.2)):
        await asyncio.sleep(0.2)
        now_steps = daemon.view.total_steps()
        still = still + 1 if now_steps == view_steps else 0
        if (now_steps >= rank_steps and still) or still >= _STILL_S / 0.2:
            break
        view_steps = now_steps


async def _measure(
    *, host: str, port: int, ranks: int, seconds: float, load: Offered, stock_iterator: bool,
    broker_pid: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    flush_s, via = load.flush_s, load.via
    relay_sample, full_sample_every_s = load.relay_sample, load.full_sample_every_s
    with tempfile.TemporaryDirectory(prefix="tmd-bench-") as state:
        daemon = Daemon(_config(host, port, ranks, state, load.shards))
        ingest = daemon.ingest = BenchIngest(daemon, stock_iterator=stock_iterator)
        if daemon.shards is not None:  # the shards record what they apply
            ingest.shards = daemon.shards
            daemon.shards.ingest_class = f"{__name__}:RecordingIngest"
        task = asyncio.create_task(daemon.run())
        await asyncio.wait_for(daemon.ready.wait(), 30)
        decided = daemon.bus.subscribe("bench-decisions", (events.Finding, events.Decision))
        spec = synth.SynthSpec(
            host=host, port=port, job="bench", ranks=ranks, seconds=seconds, flush_s=flush_s,
            step_s=STEP_S, seed=1, via=via,  # type: ignore[arg-type]  # checked by main
            relay_sample=relay_sample, full_sample_every_s=full_sample_every_s, jobs=load.jobs,
        )  # fmt: skip
        pids = [link.process.pid for link in daemon.shards.links] if daemon.shards else []
        rss_before = _rss_mb(pids)
        cpu0, wall0, broker0 = _cpu_s(pids), time.monotonic(), process_cpu_s(broker_pid)
        head0 = _cpu_s()
        result, proc = await _publish(spec)
        await _drain(daemon, result.rank_steps)
        cpu_s = _cpu_s(pids) - cpu0
        head_s = _cpu_s() - head0
        wall_s = time.monotonic() - wall0
        broker1 = process_cpu_s(broker_pid)
        broker_cpu = None if broker0 is None or broker1 is None else broker1 - broker0
        proc.join(5)
        in_view = daemon.view.total_steps()
        rss_after = _rss_mb(pids)
        latencies = ingest.latencies().tolist()
        if daemon.shards is not None:
            for dumped in await daemon.shards.dump():
                latencies += np.frombuffer(dumped, np.float64).tolist()
        sample = daemon.metrics.registry.get_sample_value
        rejected = sum(
            sample("tmd_messages_rejected_total", {"reason": r}) or 0.0
            for r in daemon.metrics.rejected_by
        )
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        messages = result.messages
        return {
            "ranks": ranks,
            "via": via,
            "relay_sample": relay_sample if via == "agent" else None,
            "full_sample_every_s": full_sample_every_s,
            "shards": load.shards,
            "jobs": load.jobs,
            "nodes": len(daemon.view.nodes),
            "seconds": seconds,
            "flush_s": flush_s,
            "step_s": STEP_S,
            "published_rank_steps": result.rank_steps,
            "rank_steps_in_view": in_view,
            "rank_steps_per_s": round(result.rank_steps / result.elapsed_s, 1),
            "messages_per_s": round(messages / result.elapsed_s, 1),
            "loss": round(max(0, result.rank_steps - in_view) / max(1, result.rank_steps), 6),
            "rejected": rejected,
            # Telemetry the daemon knows it lost (gaps in their numbers): what the
            # broker dropped for it, which also held its findings of absence.
            "messages_lost": daemon.health()["messages_lost"],
            "p50_latency_s": _round(percentile(latencies, 0.50)),
            "p99_latency_s": _round(percentile(latencies, 0.99)),
            "max_latency_s": _round(max(latencies) if latencies else None),
            "publisher_max_behind_s": round(result.max_behind_s, 3),
            "publisher_behind_limit_s": behind_limit_s(flush_s=flush_s, step_s=STEP_S),
            "rss_mb": round(rss_after, 1),
            "rss_before_mb": round(rss_before, 1),
            "cpu_s": round(cpu_s, 2),
            "cpu_fraction": round(cpu_s / wall_s, 3),
            # Of which the daemon's own process (with shards: the rest is theirs).
            "head_cpu_fraction": round(head_s / wall_s, 3),
            # Where the rest of the machine went: the load generator over its own run,
            # the broker over the daemon's (None: a broker this bench did not start).
            "publisher_cpu_fraction": round(result.cpu_s / max(1e-9, result.elapsed_s), 3),
            "broker_cpu_fraction": None if broker_cpu is None else round(broker_cpu / wall_s, 3),
            "cpu_us_per_message": round(cpu_s / max(1, messages) * 1e6, 2),
            # The daemon's CPU (ingest and all) over the rank-steps it took in.
            "cpu_us_per_rank_step": round(cpu_s / max(1, in_view) * 1e6, 2),
            # Findings and decisions on this healthy synthetic cluster: each one wrong.
            "decisions": len(decided) + decided.dropped,
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def shortfalls(r: Mapping[str, Any]) -> list[str]:
    """Why a run's result misses the target (none: it holds): a rank-step lost, a p99
    latency of a second or more, the daemon's RSS at 2 GiB or more, or a publisher that
    fell behind its schedule and so offered a lighter load than the one claimed."""
    out = []
    if r["loss"] != 0:
        out.append(f"lost {r['loss']:.3%} of the rank-steps")
    p99 = r["p99_latency_s"]
    if p99 is None:
        out.append("no rank-step was applied")
    elif p99 >= TARGET_P99_S:
        out.append(f"p99 latency {p99} s >= {TARGET_P99_S} s")
    if r["rss_mb"] >= TARGET_RSS_MB:
        out.append(f"RSS {r['rss_mb']} MB >= {TARGET_RSS_MB:g} MB")
    if r["publisher_max_behind_s"] > r["publisher_behind_limit_s"]:
        out.append(
            f"the publisher fell {r['publisher_max_behind_s']} s behind its schedule "
            f"(limit {r['publisher_behind_limit_s']} s): the load was lighter than claimed"
        )
    return out


def holds(r: Mapping[str, Any]) -> bool:
    """The target: nothing lost, p99 under a second, RSS under 2 GiB, at the load
    claimed."""
    return not shortfalls(r)


def _search(
    host: str, port: int, start: int, start_holds: bool, seconds: float, load: Offered,
    broker_pid: int | None,
) -> dict[str, Any]:  # fmt: skip
    """Double N from ``start`` until the target fails (halve it while it fails), then
    bisect to within 1/8; each run ``seconds`` long, as the one at ``start`` (a shorter
    run holds more: the backlog of a daemon falling behind grows with the run)."""
    tried: list[dict[str, Any]] = []

    def holds_at(n: int) -> bool:
        r = asyncio.run(
            _measure(
                host=host,
                port=port,
                ranks=n,
                seconds=seconds,
                load=load,
                stock_iterator=False,
                broker_pid=broker_pid,
            )
        )
        keys = ("ranks", "loss", "p99_latency_s", "publisher_max_behind_s", "rss_mb",
                "messages_per_s", "cpu_fraction", "cpu_us_per_rank_step",
                "publisher_cpu_fraction", "broker_cpu_fraction")  # fmt: skip
        tried.append({k: r[k] for k in keys})
        return holds(r)

    lo, hi = search_max(start, start_holds, holds_at)
    return {"search": tried, "max_ranks_held": lo, "smallest_ranks_failing": hi}


def search_max(
    start: int, start_holds: bool, holds_at: Callable[[int], bool]
) -> tuple[int, int | None]:
    """``(largest N held, smallest N failing)``: N doubled from ``start`` until the
    target fails, or halved while it fails, then bisected to within 1/8. (0, 1): not
    even one rank; (N, None): held up to 2^20."""
    lo, hi = (start, None) if start_holds else (0, start)
    while not lo and hi is not None and hi > 1:  # halve until one holds
        if holds_at(hi // 2):
            lo = hi // 2
        else:
            hi //= 2
    while hi is None and lo < (1 << 20):
        if holds_at(lo * 2):
            lo *= 2
        else:
            hi = lo * 2
    while hi is not None and lo and hi - lo > lo // 8:
        mid = (lo + hi) // 2
        if holds_at(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="tmd bench ingest",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ranks", type=int, default=16384)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument(
        "--flush-s",
        type=float,
        default=1.0,
        help="seconds between a rank's telemetry batches (runtime default: 1)",
    )
    p.add_argument("--broker", default="", help="host:port of an existing broker")
    p.add_argument(
        "--via",
        choices=("direct", "agent"),
        default="direct",
        help="direct: every rank publishes its own batches; agent: each machine's agent "
        "(8 ranks) relays them, one message per machine per flush, its GPU sample apart",
    )
    p.add_argument(
        "--relay-sample",
        action="store_true",
        help="with --via agent: the sample inside the relayed message (agent.relay_sample)",
    )
    p.add_argument(
        "--full-sample-every-s",
        type=float,
        default=config_mod.AgentConfig.full_sample_every_s,
        metavar="S",
        help="each machine's GPU sample in full this often, brief in between, as the agent "
        "sends it (agent.full_sample_every_s, default %(default)s); 0: every one in full",
    )
    p.add_argument(
        "--shards",
        type=int,
        default=0,
        metavar="N",
        help="N ingest shard processes, each owning whole jobs (ingest.shards; default 0: "
        "the daemon's own process)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="J",
        help="the ranks split into J jobs of whole machines (default 1): shards own jobs",
    )
    p.add_argument(
        "--no-baseline", action="store_true", help="skip the stock-iterator baseline run"
    )
    p.add_argument(
        "--search-max",
        action="store_true",
        help="also double N from --ranks until the target fails (runs of --seconds)",
    )
    p.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    args = p.parse_args(argv)
    if not 0 <= args.full_sample_every_s <= 60:
        p.error("--full-sample-every-s must be in 0..60, as agent.full_sample_every_s")
    if not 0 <= args.shards <= 64:
        p.error("--shards must be in 0..64, as ingest.shards")
    if not 1 <= args.jobs <= max(1, args.ranks // 8):
        p.error("--jobs must be in 1..ranks/8 (a job is whole machines of 8 ranks)")
    offered = Offered(flush_s=args.flush_s, via=args.via, relay_sample=args.relay_sample,
                      full_sample_every_s=args.full_sample_every_s, shards=args.shards,
                      jobs=args.jobs)  # fmt: skip
    log.setup(level="warning")  # on stderr: stdout carries the JSON alone
    load, progress = measure.Load(), Progress()
    with ExitStack() as stack:
        broker_pid = None
        if args.broker:
            host, _, port_text = args.broker.rpartition(":")
            host, port = host or "127.0.0.1", int(port_text)
        else:
            broker = stack.enter_context(Mosquitto())
            host, port, broker_pid = broker.host, broker.port, broker.pid
        progress.say(f"tmd's ingest: {args.ranks} ranks via {args.via} for {args.seconds:g} s")
        out = asyncio.run(
            _measure(
                host=host,
                port=port,
                ranks=args.ranks,
                seconds=args.seconds,
                load=offered,
                stock_iterator=False,
                broker_pid=broker_pid,
            )
        )
        out["shortfalls"] = shortfalls(out)
        out["holds_target"] = not out["shortfalls"]
        if not args.no_baseline:
            progress.say(f"baseline (aiomqtt's stock iterator) for {args.seconds:g} s")
            base = asyncio.run(
                _measure(
                    host=host,
                    port=port,
                    ranks=args.ranks,
                    seconds=args.seconds,
                    load=offered,
                    stock_iterator=True,
                    broker_pid=broker_pid,
                )
            )
            out["baseline_stock_iterator"] = base
            ratio = measure.ratio(out["cpu_us_per_message"], base["cpu_us_per_message"], 0.0)
            out["cpu_ratio_vs_iterator"] = None if ratio is None else round(ratio, 3)
        if args.search_max:
            progress.say("searching for the largest N that holds the target")
            found = _search(host, port, args.ranks, out["holds_target"], args.seconds, offered,
                            broker_pid)  # fmt: skip
            out.update(found)
    out["host_load"] = load.as_dict()
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0
