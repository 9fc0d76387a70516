"""The simulation: the daemon's own parts on simulated time against a simulated job.

What is real. The daemon's ``ClusterView``, ``Ingest.handle`` (every message the
simulated cluster sends is encoded and decoded on the wire path, as from the broker),
the configured detectors and policies (built by ``tmd.daemon.daemon.plugin_specs``
from a ``tmd.config.Config``, as ``tmd run`` builds them), the ``Actuator`` with its
guardrails and a real SQLite journal. Events pass between them as on the daemon's
bus: each plug-in gets the types it consumes, the actuator the decisions, acks and
statuses; its commands go to the simulated job, which answers them.

What is simulated. One training job of ``gpus`` GPUs on machines of
``gpus_per_node`` (the mix's), a pool of standby machines, and the failures of a
mix (``tmd.sim.mixes``) striking it. The job's answers (acks, statuses, step
timings) follow the runtime's protocol; the time each takes is the cost model's at
full scale (``tmd.sim.cost``), not the daemon's business.

The daemon sees the job through a window. A status of 16,384 ranks per change and
an ack per rank per phase would make the simulation, not the daemon, the cost of a
run, so the job the daemon sees is ``window`` machines (by default 8) of the real size,
and every failure of the whole job is shown to it on one of them (the failure's
machine index modulo the window, or another when that one is shown slow). A machine
that leaves is replaced by the standby that took its place, so what the guardrails
count per machine is kept. Slow machines are shown at most ``window // 4`` at a time,
each on a window machine of its own, so their peers' median stays healthy; the others
wait for a free one, and slow the job meanwhile all the same. Step timings of every
window rank are sent while any shown machine is slow, in chunks of ``CHUNK_STEPS``
steps once they have run (the straggler detector compares a machine with its peers; a
clean job sends none, and ``tmd bench detect`` measures that the detector is silent
on one). No heartbeats are sent: machines are lost by their agent's Last Will.

How each failure ends, for tmd (``Signal``):

- ``xid``, ``node_lost``: the machine's processes die; its agent's XID or Last Will
  reaches the daemon after the detection latency. The runtime replaces the machine
  from data-parallel replicas with a ready standby (``machine_failover_s``), or,
  with none, the job restarts from its checkpoint with a machine the scheduler
  provides. What the daemon decided meanwhile (a ``Migrate`` that the failover ends,
  a ``CheckpointRestart``) is journaled and counted.
- ``planned``: an operator drains the machine ahead of maintenance
  (``DrainRequested``, as ``POST /api/v1/drain``); the drain policy's ``Migrate``
  runs live through the actuator. Held (no standby, guardrails), the maintenance
  takes the machine at ``maintenance_grace_s`` and the job restarts.
- ``straggler``: the job runs at ``1 / (1 + slowdown)`` until the straggler detector
  finds the machine and the rebalance policy moves it, or the slowdown ends.
- ``hang``, ``crash``: no machine to replace; the job restarts from its checkpoint
  (NCCL's watchdog or torchrun notices).

The other methods are priced by ``tmd.sim.cost.recovery`` on the same failures, with
the same draws of time since the last checkpoint and the same standby pool model.
"""

from __future__ import annotations

import heapq
import math
import random
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tmd import config as config_mod
from tmd import wire
from tmd.daemon import events
from tmd.daemon.actuator import Actuator
from tmd.daemon.bus import Bus
from tmd.daemon.daemon import note_finding, plugin_specs
from tmd.daemon.freshness import Freshness
from tmd.daemon.ingest import Ingest
from tmd.daemon.journal import Journal
from tmd.daemon.metrics import Metrics
from tmd.daemon.plugins import Context, Plugin
from tmd.daemon.view import ClusterView
from tmd.detectors import straggler
from tmd.sim import cost, mixes, protocol
from tmd.tools import traces

JOB = "train"
EPOCH = 1_900_000_000.0  # simulated time 0, as wall-clock seconds
CHUNK_STEPS = 40  # steps of timings per delivery while a machine is slow
PREPARE_S = 10.0  # Prepare to every member prepared: group build with the standby warm
MAINTENANCE_GRACE_S = 3600.0  # a held drain: maintenance takes the machine after this
# How soon the job's own processes notice a dead machine and fail over: a killed
# process (a fatal XID) breaks its peers' connections at once (torchrun's monitor
# interval, ``cost.TORCHRUN_MONITOR_S``); a host that drops off the network sends no
# reset, and its peers' collective fails at the runtime's ``group_timeout``
# (``tmd.runtime.session_config.SessionConfig``, 60 s by default).
RUNTIME_DETECT_S = {"xid": cost.TORCHRUN_MONITOR_S, "node_lost": 60.0}
# ByteRobust saves every step asynchronously; its save blocks training for 0.04 s
# (Wan et al., "Robust LLM Training Infrastructure at ByteDance", arXiv 2509.16293,
# Table 8, 70B on 2,048 GPUs; a verbatim quote checked by others, [Q] in
# tmd/sim/data/README.md's terms). ``warm_standby_restart`` pays it every step.
BYTEROBUST_BLOCK_S = 0.04
BASELINES: tuple[cost.Method, ...] = tuple(m for m in cost.METHODS if m != "tmd")
# The failures that roll a job back to its checkpoint, per method (for Young/Daly).
ROLLBACK: dict[cost.Method, frozenset[str]] = {
    "tmd": frozenset({"hang", "crash"}),
    "torchft_style": frozenset({"hang", "crash"}),
    "checkpoint_restart": frozenset({"xid", "node_lost", "hang", "crash"}),
    "no_standby": frozenset({"xid", "node_lost", "hang", "crash"}),
    "warm_standby_restart": frozenset(),  # checkpoints every step
}


@dataclass(frozen=True)
class Settings:
    gpus: int = 16384
    days: float = 54.0
    seed: int = 0
    mix: str = "llama3"
    pool: int = 16  # standby machines
    rebalance_min: float = 10.0  # the rebalance policy's interval (the fpi policy's tick)
    policy: str = "rebalance"  # "fpi": the learned policy decides; "lagrangian": its baseline
    failslow: bool = True
    planned: bool = True
    window: int = 8  # machines the daemon sees
    # MegaScale's 0.5% of machines slow for good: found by pre-flight checks that any
    # method can run before a job starts, so left out unless asked for.
    slow_machines: bool = False
    signals: tuple[str, ...] = ()  # only failures of these signals (empty: all)
    step_s: float | None = None  # None: the cost model's
    downtime: Path | None = None  # a `tmd bench downtime --json` output to fit


class SimClock:
    """The daemon's ``Clock`` on simulated time, moved by the simulation only."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return EPOCH + self.t

    def monotonic(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:  # pragma: no cover - never awaited
        raise RuntimeError("the simulation drives time; nothing may sleep on it")


class _Inbox(Bus):
    """What ``Ingest.handle`` puts on the bus, kept for the simulation to dispatch."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[object] = []

    def publish(self, event: object) -> None:
        self.items.append(event)


@dataclass
class Standby:
    node: str
    ready_at: float  # simulated time it is warm and ready


@dataclass
class Slow:
    """A slow machine: shown on window machine ``slot`` (its own index in the job until
    it is shown), as ``node``, from ``start`` to ``end``."""

    slot: int
    node: str
    slowdown: float
    start: float
    end: float
    found_at: float | None = None


@dataclass
class Tally:
    """What tmd lost, and why."""

    lost_s: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    outcomes: Counter[str] = field(default_factory=Counter)
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    pool_exhausted: int = 0
    stragglers: Counter[str] = field(default_factory=Counter)
    restarts: int = 0
    failovers: int = 0
    live: int = 0


class Simulation:
    def __init__(self, settings: Settings, *, journal_dir: Path | None = None) -> None:
        self.s = settings
        self.mix = mixes.load(settings.mix)
        self.k = self.mix.gpus_per_node
        self.machines = mixes.machines_for(self.mix, settings.gpus)
        self.window = max(1, min(settings.window, self.machines))
        local = cost.load(settings.downtime)
        self.costs = cost.at_scale(local, settings.gpus, step_s=settings.step_s)
        failslow = mixes.load_failslow() if settings.failslow else None
        self.failures = mixes.sample(self.mix, gpus=settings.gpus, days=settings.days,
                                     seed=settings.seed, failslow=failslow,
                                     planned=settings.planned)  # fmt: skip
        if not settings.slow_machines:
            self.failures = [f for f in self.failures if f.cause != mixes.SLOW_MACHINE_CAUSE]
        if settings.signals:
            unknown = set(settings.signals) - mixes.SIGNALS
            if unknown:
                raise ValueError(f"unknown signals {sorted(unknown)}: of {sorted(mixes.SIGNALS)}")
            self.failures = [f for f in self.failures if f.signal in settings.signals]
        self.end = settings.days * mixes.SECONDS_PER_DAY
        self.checkpoint_s = self.checkpoint_interval("tmd")
        # Common random numbers: where each failure falls in its checkpoint interval
        # is drawn once, for every method.
        draws = random.Random(f"tmd.sim/{settings.seed}/checkpoint")
        self.phase = [draws.random() for _ in self.failures]
        self.since_checkpoint = [u * self.checkpoint_s for u in self.phase]
        self._build_daemon(journal_dir)
        # The job, as the runtime holds it.
        self.nodes = [f"node-{i:05d}" for i in range(self.window)]
        self.pool = [Standby(f"standby-{i:04d}", 0.0) for i in range(settings.pool)]
        self._next_name = settings.pool
        self.generation, self.job_run = 0, 0
        self.dead: set[str] = set()
        self.slow: dict[int, Slow] = {}  # by window machine
        self.hidden: list[Slow] = []  # slow, waiting for a window machine
        self._slow_mark = 0.0
        self._telemetry_on = False
        self._timing_model: Any = None
        self._next_tick = 0.0  # the actuator's next timeout check, while flights last
        self._down_until = 0.0  # a restart's end: no step timings until then
        self._front = 0  # the last step sent
        self.tally = Tally()
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._flights: dict[str, wire.Prepare] = {}

    # -- the daemon's parts ------------------------------------------------------------

    def _build_daemon(self, journal_dir: Path | None) -> None:
        self._tmp = None
        if journal_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tmd-sim-")
            journal_dir = Path(self._tmp.name)
        self.config = config_mod.from_dict({
            "journal": {"path": str(journal_dir / "journal.sqlite3")},
            "ingest": {"max_ranks_per_job": max(1024, self.window * self.k)},
            "policies": self._straggler_policy(journal_dir),
            # The simulated slowdowns are whole machines (every rank of one): the rank
            # change path, for one slow GPU, has nothing to find here, and off it
            # halves what the detector costs the simulation.
            "detectors": {"straggler": {"rank_change_zscore": straggler.CHANGE_OFF}},
        })  # fmt: skip
        c = self.config
        self.clock = SimClock()
        self.metrics = Metrics()
        ing = c.ingest
        self.view = ClusterView.of(c)
        self.inbox = _Inbox()
        self.ingest = Ingest(mqtt=c.mqtt, config=ing, view=self.view, bus=self.inbox,
                             metrics=self.metrics, clock=self.clock)  # fmt: skip
        self.view.freshness = Freshness.always()  # fed directly: no broker to lag behind
        context = Context(view=self.view, clock=self.clock)
        self.plugins: list[Plugin] = [spec.build(context) for spec in plugin_specs(c)]
        self.journal = Journal(c.journal.resolved_path())
        self.actuator = Actuator(config=c.actuator, guard=c.guardrails, view=self.view,
                                 journal=self.journal, emit=self._emit,
                                 metrics=self.metrics)  # fmt: skip
        self._pending: list[object] = []
        self._last_tick: dict[str, float] = {}
        self.decisions: Counter[str] = Counter()
        self.held: Counter[str] = Counter()
        self.findings: Counter[str] = Counter()

    def _straggler_policy(self, folder: Path) -> dict[str, dict[str, Any]]:
        """The policy that decides about stragglers: ``rebalance``, or ``fpi`` with a
        table trained for this job's size, pool and tick (``tmd policy train``'s);
        ``lagrangian``: the ``fpi`` policy running the Lagrangian baseline's table."""
        if self.s.policy == "rebalance":
            return {"rebalance": {"interval_min": self.s.rebalance_min}}
        if self.s.policy not in ("fpi", "lagrangian"):
            raise ValueError(f"unknown policy {self.s.policy!r}: rebalance, fpi or lagrangian")
        from tmd.sim import train

        model = folder / "fpi.json"
        # Trained on the whole job's failures, for the window of it the daemon sees,
        # within the guardrails' limits (what rebalance runs behind).
        guard = config_mod.GuardrailsConfig()
        train.main(["--out", str(model), "--gpus", str(self.s.gpus), "--mix", self.s.mix,
                    "--tick-s", str(self.s.rebalance_min * 60),
                    "--max-per-hour", str(guard.max_per_hour),
                    "--min-pool", str(guard.min_standby_pool),
                    "--seen-ranks", str(self.window * self.k),
                    "--algorithm", self.s.policy], quiet=True)  # fmt: skip
        return {"rebalance": {"enabled": False}, "fpi": {"enabled": True, "model": str(model)}}

    def _emit(self, event: events.Event, source: str) -> None:
        now = self.clock.now()
        note_finding(self.view, event, now)
        self.journal.record(event, source=source)
        self._pending.append(event)

    def _dispatch(self) -> None:
        """Everything waiting, to whoever consumes it, until nothing new comes out."""
        now = self.clock.now()
        while self._pending or self.inbox.items:
            items = self.inbox.items + self._pending
            self.inbox.items, self._pending = [], []
            for item in items:
                self._note(item)
                for plugin in self.plugins:
                    if isinstance(item, plugin.consumes):
                        for out in plugin.observe(item, now):
                            self._emit(out, plugin.name)
                for command in self.actuator.on_event(item, now):
                    self._command(command)

    def _tick(self, *, force: Iterable[str] = ()) -> None:
        now = self.clock.now()
        for plugin in self.plugins:
            interval = plugin.tick_interval
            if interval is None:
                continue
            last = self._last_tick.get(plugin.name, -math.inf)
            if plugin.name in force or now - last >= interval.total_seconds():
                self._last_tick[plugin.name] = now
                for out in plugin.tick(now):
                    self._emit(out, plugin.name)
        for command in self.actuator.on_tick(now):
            self._command(command)
        self._dispatch()

    def _send(self, topic: str, message: wire.Message) -> None:
        self.ingest.handle(topic, wire.encode(message))
        self._dispatch()

    def _note(self, item: object) -> None:
        """What the tallies need from the daemon's own events."""
        t = self.clock.t
        if isinstance(item, events.Decision):
            self.decisions[f"{type(item).__name__}:{item.policy}"] += 1
            if isinstance(item, events.Hold) and item.held:
                self.held[item.held] += 1  # a policy's move the guardrails (or else) held
        elif isinstance(item, events.StragglerFound):
            self.findings["StragglerFound"] += 1
            for slow in self.slow.values():
                if slow.node == item.node and slow.found_at is None:
                    slow.found_at = t
                    self.tally.stragglers["found"] += 1
                    self.tally.latencies["straggler"].append(t - slow.start)
        elif isinstance(item, events.Finding):
            self.findings[type(item).__name__] += 1
        elif isinstance(item, events.MigrationFinished):
            self.tally.outcomes[item.outcome] += 1

    # -- the simulated job -------------------------------------------------------------

    def _at(self, t: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (t, self._seq, action))

    def _ready(self) -> list[Standby]:
        """Ready standbys that no migration in flight has named as its joiner."""
        taken = {p.joiner for p in self._flights.values()}
        return [s for s in self.pool if s.ready_at <= self.clock.t and s.node not in taken]

    def _status(self, state: Literal["running", "restarting"] = "running") -> None:
        members = protocol.members(self.nodes, self.k)
        standbys = [
            wire.StandbyInfo(node=s.node, state="ready" if s.ready_at <= self.clock.t
                             else "warming", slots=self.k)
            for s in self.pool
        ]  # fmt: skip
        status = wire.JobStatus(
            ts=self.clock.now(), job=JOB, generation=self.generation,
            world_size=self.window * self.k, members=members, standbys=standbys,
            state=state, step=int(self.clock.t / self.costs.step_s), run=self.job_run,
        )  # fmt: skip
        self._send(wire.job_topic(JOB, "status"), status)

    def _refill(self) -> None:
        """A machine the scheduler provides for the pool: provisioned, then warmed."""
        self._next_name += 1
        ready = self.clock.t + self.costs.cold_standby_s
        self.pool.append(Standby(f"standby-{self._next_name:04d}", ready))
        self._at(ready, self._status)

    def _replace(self, slot: int, node: str) -> None:
        self.nodes[slot] = node
        self.generation += 1

    def _restart(self, cause: str, index: int, *, running: bool, without: int | None) -> None:
        """The job restarts from its checkpoint (``without``: a machine the scheduler
        replaces)."""
        c = self.costs
        lost = c.requeue_s + c.restart_init_s + c.checkpoint_load_s
        lost += c.checkpoint_blocking_s if running else self.since_checkpoint[index]
        self.tally.lost_s[cause] += lost
        self.tally.restarts += 1
        self._flights.clear()  # a new run: what was being prepared is gone with the old
        self._status("restarting")
        if without is not None:
            self._next_name += 1
            self.nodes[without] = f"node-r{self._next_name:05d}"
        self.job_run += 1
        self.generation = 0
        self._down_until = self.clock.t + lost
        self._at(self._down_until, self._status)

    def _command(self, command: wire.Message) -> None:
        t = self.clock.t
        if isinstance(command, wire.Prepare):
            if command.leaver in self.dead:
                return  # its processes are gone: the runtime's own failover answers
            if command.migration_id in self._flights:
                return  # a resend: the first is being answered
            joiner_free = any(s.node == command.joiner for s in self._ready())
            if command.leaver not in self.nodes or not joiner_free:
                # The runtime refuses at once what names no member or no ready standby.
                self._at(t, lambda: self._refuse(command))
                return
            self._flights[command.migration_id] = command
            self._at(t + PREPARE_S, lambda: self._acks(command, "prepared"))
        elif isinstance(command, wire.Switch):
            switching = self._flights.get(command.migration_id)
            if switching is not None:
                done = self._switch
                self._at(t + self.costs.live_migration_s, lambda: done(switching))
        elif isinstance(command, wire.Abort):
            aborting = self._flights.pop(command.migration_id, None)
            if aborting is not None:
                self._at(t, lambda: self._acks(aborting, "aborted"))
        elif isinstance(command, wire.Restart):
            ack = wire.Ack(ts=self.clock.now(), job=JOB, migration_id=command.migration_id,
                           kind="restarting", node=self.nodes[0], rank=0, local_rank=0)  # fmt: skip
            self._at(t, lambda: self._send(wire.job_topic(JOB, "ack"), ack))

    def _survivors(self) -> list[str]:
        return [n for n in self.nodes if n not in self.dead]

    def _failover_answer(
        self, generation: int, swaps: dict[str, str], survivors: list[str]
    ) -> None:
        for ack in protocol.failover_answer(job=JOB, generation=generation, swaps=swaps,
                                            survivors=survivors, per_node=self.k,
                                            ts=self.clock.now(),
                                            downtime_s=self.costs.machine_failover_s):  # fmt: skip
            self.ingest.handle(wire.job_topic(JOB, "ack"), wire.encode(ack))
        self._dispatch()

    def _refuse(self, prepare: wire.Prepare) -> None:
        ack = wire.Ack(ts=self.clock.now(), job=JOB, migration_id=prepare.migration_id,
                       kind="failed", node=self.nodes[0], rank=0, local_rank=0,
                       detail=f"cannot move {prepare.leaver} to {prepare.joiner}")  # fmt: skip
        self._send(wire.job_topic(JOB, "ack"), ack)

    def _acks(self, prepare: wire.Prepare, kind: str) -> None:
        if prepare.migration_id not in self._flights and kind != "aborted":
            return
        t = self.clock.t
        joiner_ready = any(s.node == prepare.joiner and s.ready_at <= t for s in self.pool)
        if kind == "prepared" and (prepare.leaver not in self.nodes or not joiner_ready):
            kind = "failed"
        # The dead machine's processes are gone: they answer nothing. A failure is
        # answered by the first process that finds it.
        alive = [n for n in [*self.nodes, prepare.joiner] if n not in self.dead]
        for ack in protocol.acks(job=JOB, migration_id=prepare.migration_id, kind=kind,
                                 nodes=alive[:1] if kind == "failed" else alive,
                                 per_node=self.k, generation=self.generation,
                                 ts=self.clock.now(),
                                 detail="gone" if kind == "failed" else ""):  # fmt: skip
            self.ingest.handle(wire.job_topic(JOB, "ack"), wire.encode(ack))
        self._dispatch()

    def _switch(self, prepare: wire.Prepare) -> None:
        if self._flights.pop(prepare.migration_id, None) is None:
            return
        if prepare.leaver not in self.nodes:
            return
        slot = self.nodes.index(prepare.leaver)
        self.pool = [s for s in self.pool if s.node != prepare.joiner]
        self._replace(slot, prepare.joiner)
        self.tally.live += 1
        self.tally.lost_s["live_migration"] += self.costs.live_migration_s
        self._refill()
        self._status()
        for ack in protocol.acks(job=JOB, migration_id=prepare.migration_id, kind="switched",
                                 nodes=[*self.nodes, prepare.leaver], per_node=self.k,
                                 generation=self.generation, ts=self.clock.now(),
                                 downtime=wire.Downtime(total_s=self.costs.live_migration_s),
                                 leaver=prepare.leaver):  # fmt: skip
            self.ingest.handle(wire.job_topic(JOB, "ack"), wire.encode(ack))
        self._dispatch()
        # A slow machine moved away: its slowdown no longer holds the job back.
        for slow in list(self.slow.values()):
            if slow.node == prepare.leaver:
                self._end_slow(slow)

    # -- failures ----------------------------------------------------------------------

    def _slot_for(self, f: mixes.Failure) -> int:
        """The window machine that shows ``f``: its own index modulo the window, or,
        when that one is shown slow (an unrelated machine's failure must not end its
        slowdown), the first that is neither slow nor dead."""
        slot = f.machine % self.window
        if slot not in self.slow:
            return slot
        calm = [i for i in range(self.window) if i not in self.slow
                and self.nodes[i] not in self.dead]  # fmt: skip
        return calm[0] if calm else slot

    def _failure(self, index: int, f: mixes.Failure) -> None:
        slot = self._slot_for(f)
        node = self.nodes[slot]
        t = self.clock.t
        if f.signal in ("xid", "node_lost"):
            self.dead.add(node)
            if f.signal == "xid":
                xid = wire.XidEvent(ts=self.clock.now(), node=node, gpu=0, xid=f.xid or 79)
                detect = self.costs.detect_xid_s
                self._at(t + detect, lambda: self._send(wire.node_topic(node, "xid"), xid))
            else:
                will = wire.NodeStatus(ts=self.clock.now(), node=node, state="offline")
                detect = self.costs.detect_lost_s
                self._at(t + detect, lambda: self._send(wire.node_topic(node, "status"), will))
            noticed = RUNTIME_DETECT_S[f.signal]
            ready = self._ready()
            if ready:
                joiner = ready[0]
                self.pool.remove(joiner)
                c = self.costs
                self.tally.lost_s[f.cause] += noticed + c.machine_failover_s + 0.5 * c.step_s
                self.tally.failovers += 1

                def failover() -> None:
                    # The runtime's failover ends any migration being prepared (its
                    # joiner leaves it when the job's generation reports the failure).
                    self._flights.clear()
                    generation, survivors = self.generation, self._survivors()
                    self._replace(slot, joiner.node)
                    self.dead.discard(node)
                    self._status()
                    self._failover_answer(generation, {node: joiner.node}, survivors)
                    self._refill()

                self._at(t + noticed + self.costs.machine_failover_s, failover)
            else:
                self.tally.pool_exhausted += 1
                self.tally.lost_s[f.cause] += noticed

                def restart() -> None:
                    self._failover_answer(self.generation, {}, self._survivors())
                    self.dead.discard(node)
                    self._restart(f.cause, index, running=False, without=slot)

                self._at(t + noticed, restart)
        elif f.signal == "planned":
            now = self.clock.now()
            drain = events.DrainRequested(ts=now, node=node, requested_by="maintenance")
            self._pending.append(drain)
            self._dispatch()
            self._tick(force=("drain",))

            def maintenance() -> None:
                if node in self.nodes:  # not moved in time: the job restarts without it
                    self._restart(f.cause, index, running=True, without=self.nodes.index(node))

            self._at(t + MAINTENANCE_GRACE_S, maintenance)
        elif f.signal == "straggler":
            self._start_slow(Slow(f.machine, "", f.slowdown, t, t + f.duration_s))
        else:  # hang, crash: no machine to blame
            detect = self.costs.detect_hang_s if f.signal == "hang" else self.costs.detect_crash_s
            self.tally.lost_s[f.cause] += detect
            self._at(t + detect, lambda: self._restart(f.cause, index, running=False, without=None))

    def _slowdown(self) -> float:
        """The job's slowdown now: its slowest machine's (every rank waits for it)."""
        slow = [*self.slow.values(), *self.hidden]
        return max((x.slowdown for x in slow), default=0.0)

    def _account_slow(self) -> None:
        """Charge the time since the last change of the slow set at its slowdown."""
        t = self.clock.t
        s = self._slowdown()
        self.tally.lost_s["fail_slow"] += (t - self._slow_mark) * s / (1 + s)
        self._slow_mark = t

    def _start_slow(self, slow: Slow) -> None:
        """A machine turns slow. The daemon sees it on a window machine of its own, at
        most ``window // 4`` at once so that its peers' median stays healthy, as among
        a real job's thousands of machines; the rest wait for a free one (and slow the
        job meanwhile all the same)."""
        self._account_slow()
        self._at(slow.end, lambda: self._end_slow(slow))  # charged to its end, not beyond
        busy = set(self.slow) | {i for i, n in enumerate(self.nodes) if n in self.dead}
        free = [i for i in range(self.window) if i not in busy]
        if len(self.slow) >= max(1, self.window // 4) or not free:
            self.hidden.append(slow)
            return
        slot = slow.slot % self.window
        slow.slot = slot if slot in free else free[0]
        slow.node = self.nodes[slow.slot]
        self.slow[slow.slot] = slow
        self.tally.stragglers["shown"] += 1
        if not self._telemetry_on:
            # At once: the steps before the onset, which the detector saw in a real job
            # (they are not slow); the next chunk, once its steps have run, is.
            self._telemetry_on = True
            self._timings()

    def _end_slow(self, slow: Slow) -> None:
        if self.slow.get(slow.slot) is slow:
            self._account_slow()
            del self.slow[slow.slot]
            t = self.clock.t
            while self.hidden:  # the next one waiting, if it still is slow
                waiting = self.hidden.pop(0)
                if waiting.end > t:
                    self._start_slow(waiting)
                    break
        elif slow in self.hidden:
            self._account_slow()
            self.hidden.remove(slow)

    def _timings(self) -> None:
        """The next chunk of every window rank's step timings, while any machine is
        slow: the slow ones and their peers, all at the job's step, so that no rank
        looks silent while others report (a clean job sends nothing here at all)."""
        t = self.clock.t
        for slow in [x for x in self.hidden if t >= x.end]:
            self._end_slow(slow)
        for slow in list(self.slow.values()):
            if self.nodes[slow.slot] != slow.node or t >= slow.end:
                self._end_slow(slow)  # moved away, or no longer slow
        if not self.slow:
            self._telemetry_on = False
            return
        if t < self._down_until:  # the job is restarting: no steps to report
            self._at(self._down_until, self._timings)
            return
        n = self.window * self.k
        if self._timing_model is None:
            from tmd.sim.timings import Timings  # numpy: the `sim` extra

            shape = traces.JobShape(ranks=n, ranks_per_node=self.k, step_s=self.costs.step_s)
            self._timing_model = Timings(shape, f"tmd.sim/{self.s.seed}/timings")
        step_s = self.costs.step_s * (1 + self._slowdown())
        first = max(self._front + 1, int(t / self.costs.step_s))
        self._front = first + CHUNK_STEPS - 1
        # The steps that just ended: a batch reports what happened, and a machine is
        # slow only in the steps after its slowdown began.
        t0 = self.clock.now() - CHUNK_STEPS * step_s
        slowed = {rank: (x.slowdown, math.ceil((x.start - (t - CHUNK_STEPS * step_s)) / step_s))
                  for x in self.slow.values()
                  for rank in range(x.slot * self.k, (x.slot + 1) * self.k)}  # fmt: skip
        per_rank = self._timing_model.chunk(CHUNK_STEPS, first=first, t0=t0, slow=slowed)
        now = self.clock.now()
        for rank in range(n):
            batch = wire.IterBatch(ts=now, job=JOB, rank=rank, run=self.job_run,
                                   node=self.nodes[rank // self.k],
                                   generation=self.generation, steps=per_rank[rank])  # fmt: skip
            self.ingest.handle(wire.iter_topic(JOB, rank), wire.encode(batch))
        self._dispatch()
        self._tick(force=("straggler",))
        self._at(t + CHUNK_STEPS * step_s, self._timings)

    # -- the run -----------------------------------------------------------------------

    def checkpoint_interval(self, method: cost.Method) -> float:
        """Young/Daly (Daly's eq. 37) for the failures that roll ``method`` back to its
        checkpoint, at the mix's rate for this job (for tmd: hangs and crashes; a
        machine lost with the pool empty adds to them, not counted here)."""
        if method == "warm_standby_restart":
            return self.costs.step_s
        weight = sum(c.weight for c in self.mix.causes if c.signal in ROLLBACK[method])
        rate = weight * self.mix.failures_per_node_day * self.machines / mixes.SECONDS_PER_DAY
        mtbf = 1 / rate if rate > 0 else self.end
        return cost.daly(self.costs.checkpoint_blocking_s, mtbf)

    def blocking_s(self, method: cost.Method) -> float:
        """Checkpoint pauses over the run."""
        block = BYTEROBUST_BLOCK_S if method == "warm_standby_restart" else None
        interval = self.checkpoint_interval(method)
        return self.end / interval * (block or self.costs.checkpoint_blocking_s)

    def baseline(self, method: cost.Method) -> dict[str, float]:
        """What ``method`` loses on the same failures, by cause (seconds): priced by
        ``tmd.sim.cost.recovery``, a standby pool of the same size refilled after
        ``cold_standby_s``, and fail-slow machines left in place (none of these
        methods moves one), costing the job its slowest machine's slowdown."""
        c = self.costs
        interval = self.checkpoint_interval(method)
        ready_at = [0.0] * self.s.pool
        lost: defaultdict[str, float] = defaultdict(float)
        for i, f in enumerate(self.failures):
            if f.signal == "straggler":
                continue
            free = [j for j, t in enumerate(ready_at) if t <= f.t_s]
            r = cost.recovery(method, f.signal, c, since_checkpoint_s=self.phase[i] * interval,
                              standby_ready=bool(free))  # fmt: skip
            if r.uses_standby and free:
                ready_at[free[0]] = f.t_s + c.cold_standby_s
            lost[f.cause] += r.detect_s + r.downtime_s + r.lost_work_s
            lost[f.cause] += r.degraded_s * r.degraded_fraction
        lost["fail_slow"] = unmitigated_slowdown_s(self.failures, self.end)
        lost["checkpoint_blocking"] = self.blocking_s(method)
        return dict(lost)

    def run(self, progress: Callable[[float], None] = lambda day: None) -> dict[str, Any]:
        self._status()
        for i, f in enumerate(self.failures):
            self._at(f.t_s, lambda i=i, f=f: self._failure(i, f))  # type: ignore[misc]
        interval = self.s.rebalance_min * 60
        t, day = interval, 0
        while t < self.end:
            self._at(t, lambda: self._tick(force=("rebalance",)))
            t += interval
        while self._queue:
            t, _, action = heapq.heappop(self._queue)
            if t > self.end:
                break
            self.clock.t = t
            action()
            if self.actuator.flights and self._next_tick <= t:
                self._next_tick = t + self.config.actuator.resend_s
                self._at(self._next_tick, self._tick)
            if int(t // mixes.SECONDS_PER_DAY) > day:
                day = int(t // mixes.SECONDS_PER_DAY)
                progress(day)
        self.clock.t = self.end
        for slow in [*self.slow.values(), *self.hidden]:
            self._end_slow(slow)
        return self._result()

    def _result(self) -> dict[str, Any]:
        wall = self.end
        lost = dict(self.tally.lost_s)
        lost["checkpoint_blocking"] = self.blocking_s("tmd")
        methods = {"tmd": lost, **{m: self.baseline(m) for m in BASELINES}}
        gpu_h = self.s.gpus / 3600
        return {
            "ettr": cost.ettr(wall - sum(lost.values()), wall),
            **{f"ettr_{m}": cost.ettr(wall - sum(methods[m].values()), wall) for m in BASELINES},
            "gpus": self.s.gpus,
            "machines": self.machines,
            "days": self.s.days,
            "seed": self.s.seed,
            "mix": self.mix.name,
            "standby_pool": self.s.pool,
            "policy": self.s.policy,
            "failures": dict(Counter(f.signal for f in self.failures)),
            "by_cause": {
                m: {k: round(v * gpu_h, 1) for k, v in sorted(x.items()) if v}
                for m, x in methods.items()
            },
            "lost_s": {k: round(v, 1) for k, v in sorted(lost.items())},
            "checkpoint_interval_s": {
                m: round(self.checkpoint_interval(m), 1) for m in cost.METHODS
            },
            "live_migrations": self.tally.live,
            "failovers": self.tally.failovers,
            "restarts": self.tally.restarts,
            "pool_exhausted": self.tally.pool_exhausted,
            "stragglers": dict(self.tally.stragglers),
            "migration_outcomes": dict(self.tally.outcomes),
            "decisions": dict(self.decisions),
            # Per policy, its migrations the actuator did not run: the guardrails'
            # limits (per hour, the pool's minimum, cool-downs) or no standby. Where a
            # policy keeps the limits itself this stays near 0.
            "held_by_actuator": dict(self.held),
            "findings": dict(self.findings),
            "detection_latency_s": {
                k: {"n": len(v), "median": sorted(v)[len(v) // 2]}
                for k, v in self.tally.latencies.items()
                if v
            },
            "plugins": sorted(f"{type(p).__module__}.{type(p).__qualname__}" for p in self.plugins),
            "actuator": f"{type(self.actuator).__module__}.{type(self.actuator).__qualname__}",
        }


def unmitigated_slowdown_s(failures: Iterable[mixes.Failure], end: float) -> float:
    """Wall time a job loses to fail-slow machines left in place: at every moment it
    runs at its slowest machine's pace, ``1 / (1 + s)``, so it loses ``s / (1 + s)``
    of the time, for the largest ``s`` of the episodes then under way."""
    marks: list[tuple[float, int, float]] = []
    for f in failures:
        if f.signal == "straggler" and f.t_s < end:
            marks += [(f.t_s, 1, f.slowdown), (min(end, f.t_s + f.duration_s), -1, f.slowdown)]
    marks.sort()
    live: Counter[float] = Counter()
    lost, last = 0.0, 0.0
    for t, sign, s in marks:
        worst = max(live) if live else 0.0
        lost += (t - last) * worst / (1 + worst)
        last = t
        live[s] += sign
        if live[s] == 0:
            del live[s]
    return lost
