"""``tmd sim --live``: the daemon itself (``tmd run``, in its own process) in real time
against a simulated cluster over a real broker. The wire-level check of ``tmd sim``.

What is real. The broker (mosquitto where it is installed, else the embedded one), the
daemon's process with its config, MQTT connections, HTTP API and SQLite journal, and
every message on the wire: each simulated machine's agent has a connection of its own
with its Last Will, so a lost machine is a dropped connection that the broker answers
with the Will.

What is simulated. A job of ``machines`` machines of ``per_node`` ranks and a pool of
``standbys`` standby machines. The job steps in real time (``step_s`` a step, its
slowest machine's pace), reports every rank's step timings (``tmd.sim.timings``: the
model ``tmd bench detect`` holds the detector to) in batches of ``BATCH_STEPS``,
publishes its retained status on every change, and answers the control protocol as the
runtime does (``tmd.sim.protocol``): a ``Prepare`` with every process's ``prepared``
after ``PREPARE_S``, a ``Switch`` at the next batch boundary, an ``Abort``, a
``Restart`` (the job comes back without the machine after ``RESTART_S``), and its own
failovers (``failover-g{gen}``); a repeated command gets where it stands. Every agent
publishes its retained status when it connects and a GPU sample every ``BEAT_S``. The
daemon's detection and policy timings are scaled to a run of seconds
(``daemon_sections``); its actuator's timeouts are its defaults.

Failures, one every ``seconds / (failures + 1)`` or so, on a machine drawn from the
job's, each kind with a cause drawn from the mix by weight, kinds taken in turn from
``signals`` in an order the seed shuffles:

- ``straggler``: the machine's ranks turn ``slowdown`` slower until it leaves the job;
  found by the straggler detector, moved by the rebalance policy (its interval is
  ``REBALANCE_S`` here).
- ``xid``: the agent publishes a fatal XID and the machine's processes die; the job
  stalls, and the runtime replaces the machine from replicas with a ready standby
  machine after ``NOTICED_S["xid"]`` (torchrun's monitor notices the dead processes)
  plus ``FAILOVER_S``, or restarts without it when none is ready.
- ``node_lost``: the agent's connection is cut (its Will says ``offline``) and the
  processes die with the machine; the job's collectives fail after
  ``NOTICED_S["node_lost"]`` (the runtime's group timeout, scaled down as every
  timeout here), then as for ``xid``.
- ``planned``: an operator drains the machine (``POST /api/v1/drain``); the drain
  policy's migration runs live.

Prints one JSON object: each failure with when the daemon's journal first named the
machine (``found_s``), what it decided, how the episode ended (``outcome``:
``live_migrated``, ``failed_over``, ``restarted`` or ``unresolved``) and by whom
(``ended_by``: ``daemon``, a migration it drove; ``runtime``, what the job did by
itself, whose ``ended_s`` is the simulation's own constants); ``found``, ``decided``,
``ended``; whether the daemon's view of the job (generation, who holds each rank, the
ready standbys) agrees with the job's last status (``view_agrees``); messages sent and
what the daemon counted received and rejected; whether every journaled migration ended
and was reported finished exactly once (``exactly_once``); the job's effective
training time ratio over the run (``ettr``); and ``errors`` in the simulation's own
tasks (then ``tmd sim --live`` exits 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import sqlite3
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiomqtt

from tmd import config as config_mod
from tmd import wire
from tmd.connection import ClientFactory
from tmd.errors import ProtocolError
from tmd.sim import mixes, protocol
from tmd.tools import traces
from tmd.tools.bench.faults import Daemon
from tmd.tools.brokers import local_broker

JOB = "train"
SIGNALS = ("straggler", "xid", "node_lost", "planned")
BATCH_STEPS = 4  # steps per telemetry batch; a switch happens between batches
BEAT_S = 0.5  # each agent's status and GPU sample
HEARTBEAT_TIMEOUT_S = 3.0  # the daemon's node_lost detector
PREPARE_S = 1.0  # Prepare to every process prepared
FAILOVER_S = 0.5  # the runtime's replacement from replicas, once it noticed
NOTICED_S = {"xid": 0.5, "node_lost": 3.0}
RESTART_S = 3.0  # a restart from the checkpoint, without the machine
WARM_S = 3.0  # a new standby machine, provisioned and warmed
REBALANCE_S = 3.0
SETTLE_S = 2.0  # at the end, how long the daemon's view may take to catch up
GPU_MODEL = "NVIDIA H100 80GB HBM3"
OUTCOMES = ("live_migrated", "failed_over", "restarted")
FINDINGS = ("StragglerFound", "GpuFault", "NodeLost", "DrainRequested")
DECISIONS = ("Migrate", "Hold", "CheckpointRestart")


@dataclass(frozen=True)
class LiveSettings:
    machines: int = 4
    per_node: int = 2
    standbys: int = 2
    step_s: float = 0.1
    seconds: float = 40.0
    failures: int = 4
    signals: tuple[str, ...] = SIGNALS
    slowdown: float = 0.3
    seed: int = 0
    mix: str = "llama3"
    embedded_broker: bool = False


@dataclass
class Episode:
    """One injected failure and what became of it."""

    t_s: float  # seconds after the job started
    signal: str
    cause: str
    node: str
    ts: float = 0.0  # wall clock when injected
    outcome: str = "unresolved"
    ended_by: str = ""  # "daemon": its command ended it; "runtime": the job did by itself
    ended_s: float | None = None  # seconds after injection


@dataclass
class Flight:
    prepare: wire.Prepare
    prepared: bool = False
    switching: bool = False


@dataclass
class Job:
    """The simulated job, as its runtime holds it."""

    nodes: list[str]
    standbys: dict[str, float]  # standby machine -> wall clock it is (or was) ready at
    generation: int = 0
    run: int = 0
    step: int = 0
    state: str = "running"
    excluded: list[str] = field(default_factory=list)
    dead: set[str] = field(default_factory=set)
    slow: dict[str, float] = field(default_factory=dict)  # machine -> slowdown
    flights: dict[str, Flight] = field(default_factory=dict)
    down_until: float = 0.0  # restarting until then


def plan(s: LiveSettings) -> list[Episode]:
    """The failures of a run: ``s.failures`` of them, spaced evenly after a warm-up,
    kinds in turn from ``s.signals`` (shuffled by the seed), causes from the mix."""
    unknown = set(s.signals) - set(SIGNALS)
    if unknown or not s.signals:
        raise ValueError(f"live signals must be among {', '.join(SIGNALS)}: got {s.signals}")
    rng = random.Random(f"tmd.sim.live/{s.seed}")
    mix = mixes.load(s.mix)
    slow_causes = mixes.load_failslow().causes
    kinds = list(s.signals)
    rng.shuffle(kinds)
    warmup = 4.0
    spacing = (s.seconds - warmup) / (s.failures + 1)
    out = []
    for i in range(s.failures):
        signal = kinds[i % len(kinds)]
        if signal == "planned":
            cause = mixes.PLANNED_CAUSE
        else:
            pool = slow_causes if signal == "straggler" else mix.causes
            causes = [c for c in pool if c.signal == signal]
            cause = rng.choices(causes, weights=[c.weight for c in causes])[0].name
        out.append(Episode(round(warmup + i * spacing, 3), signal, cause, node=""))
    return out


class Cluster:
    """The simulated machines and job on the broker at ``host:port``."""

    def __init__(self, s: LiveSettings, host: str, port: int, daemon: Daemon) -> None:
        self.s = s
        self.k = s.per_node
        self.daemon = daemon
        mqtt = config_mod.from_dict({"mqtt": {"host": host, "port": port}}).mqtt
        self.client = ClientFactory(mqtt)
        self.job = Job(
            nodes=[f"node-{i:03d}" for i in range(s.machines)],
            standbys={f"standby-{i:03d}": 0.0 for i in range(s.standbys)},
        )
        self._names = s.standbys
        self.episodes = plan(s)
        self.rng = random.Random(f"tmd.sim.live/{s.seed}/machines")
        self.sent: Counter[str] = Counter()
        self.useful_s = 0.0
        self._agents: dict[str, asyncio.Task[None]] = {}
        self._connections: dict[str, aiomqtt.Client] = {}
        self._pub: aiomqtt.Client | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._over: dict[str, str] = {}  # migration id -> how it ended, for repeats
        self._stuck: list[wire.Prepare] = []  # Prepares of a dead leaver, not read yet
        self.errors: list[str] = []  # what went wrong in the simulation's own tasks
        self._cut: set[str] = set()
        self.published: wire.JobStatus | None = None
        self._timings: Any = None

    # -- the wire ----------------------------------------------------------------------

    async def _publish(
        self,
        topic: str,
        message: wire.Message,
        *,
        qos: int = 1,
        retain: bool = False,
        via: aiomqtt.Client | None = None,
    ) -> None:
        client = via or self._pub
        assert client is not None
        await client.publish(topic, wire.encode(message), qos=qos, retain=retain)
        self.sent[type(message).__name__] += 1

    def _later(self, delay: float, action: Callable[[], Any]) -> None:
        async def run() -> None:
            await asyncio.sleep(delay)
            try:
                result = action()
                if asyncio.iscoroutine(result):
                    await result
            except Exception as exc:  # kept for the result: the run must not hide it
                self._failed(getattr(action, "__name__", "a scheduled action"), exc)

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _failed(self, where: str, exc: BaseException) -> None:
        self.errors.append(f"{where}: {type(exc).__name__}: {exc}")

    async def _status(self) -> None:
        j, now = self.job, time.time()
        standbys = [
            wire.StandbyInfo(node=n, state="ready" if at <= now else "warming", slots=self.k)
            for n, at in sorted(j.standbys.items())
        ]
        status = wire.JobStatus(
            ts=now, job=JOB, generation=j.generation, world_size=len(j.nodes) * self.k,
            members=protocol.members(j.nodes, self.k), standbys=standbys,
            state=j.state, step=j.step, run=j.run, excluded=j.excluded,  # type: ignore[arg-type]
        )  # fmt: skip
        await self._publish(wire.job_topic(JOB, "status"), status, retain=True)
        self.published = status

    async def _acks(self, prepare: wire.Prepare, kind: str, nodes: list[str], **kw: Any) -> None:
        for ack in protocol.acks(job=JOB, migration_id=prepare.migration_id, kind=kind,
                                 nodes=nodes, per_node=self.k, generation=self.job.generation,
                                 ts=time.time(), **kw):  # fmt: skip
            await self._publish(wire.job_topic(JOB, "ack"), ack)

    # -- the agents --------------------------------------------------------------------

    def start_agent(self, node: str, role: str) -> None:
        self._agents[node] = asyncio.create_task(self._agent(node, role))

    def _node_status(self, node: str, state: str, role: str) -> wire.NodeStatus:
        gpus = [wire.GpuInfo(index=i, name=GPU_MODEL) for i in range(self.k)]
        return wire.NodeStatus(ts=time.time(), node=node, state=state, role=role,  # type: ignore[arg-type]
                               gpus=gpus, hostname=node, agent="tmd-sim")  # fmt: skip

    async def _agent(self, node: str, role: str) -> None:
        topic = wire.node_topic(node, "status")
        offline = self._node_status(node, "offline", role)
        will = aiomqtt.Will(topic, wire.encode(offline), qos=1, retain=True)
        try:
            async with self.client(will=will, identifier=f"tmd-sim-{node}") as c:
                self._connections[node] = c
                online = self._node_status(node, "online", role)
                await self._publish(topic, online, retain=True, via=c)
                while node in self._connections:
                    sample = wire.NodeGpu(ts=time.time(), node=node, gpus=[
                        wire.GpuSample(index=i, temp_c=55.0, power_w=400.0, util_pct=97.0)
                        for i in range(self.k)])  # fmt: skip
                    await self._publish(wire.node_topic(node, "gpu"), sample, qos=0, via=c)
                    await asyncio.sleep(BEAT_S)
        except aiomqtt.MqttError as exc:
            if node not in self._cut:
                self._failed(f"agent {node}", exc)

    async def cut(self, node: str) -> None:
        """The machine drops off the network: its agent's connection ends without a
        DISCONNECT, so the broker publishes its Will."""
        self._cut.add(node)
        conn = self._connections.pop(node, None)
        task = self._agents.pop(node, None)
        if conn is not None:
            sock = conn._client.socket()  # paho's; aiomqtt has no way to drop a link
            if isinstance(sock, socket.socket):
                sock.shutdown(socket.SHUT_RDWR)
            # Until the client has seen its link go, so that it does not try to say
            # goodbye on a dead socket.
            with contextlib.suppress(Exception):  # it ends in an error, as it should
                await asyncio.wait_for(asyncio.shield(conn._disconnected), 5.0)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def stop_agents(self) -> None:
        for task in self._agents.values():
            task.cancel()
        await asyncio.gather(*self._agents.values(), return_exceptions=True)

    # -- the job -----------------------------------------------------------------------

    def _ready(self) -> list[str]:
        """Ready standby machines that no migration in flight names as its joiner."""
        taken = {f.prepare.joiner for f in self.job.flights.values()}
        now = time.time()
        return sorted(n for n, at in self.job.standbys.items() if at <= now and n not in taken)

    def _provision(self) -> None:
        """A machine the scheduler provides for the pool: warm after ``WARM_S``."""
        name = f"standby-{self._names:03d}"
        self._names += 1
        self.job.standbys[name] = time.time() + WARM_S
        self.start_agent(name, "standby")
        self._later(WARM_S, self._status)

    def _replace(self, slot: int, joiner: str) -> None:
        j = self.job
        del j.standbys[joiner]
        j.nodes[slot] = joiner
        j.generation += 1
        self._provision()

    def _end(self, node: str, outcome: str, *, by: str) -> None:
        for e in self.episodes:
            if e.node == node and e.ts and e.outcome == "unresolved":
                e.outcome, e.ended_by = outcome, by
                e.ended_s = round(time.time() - e.ts, 3)

    async def train(self, stop: asyncio.Event) -> None:
        """Step in real time; report every rank's timings a batch at a time."""
        from tmd.sim.timings import Timings  # numpy: the `sim` extra

        j = self.job
        n = len(j.nodes) * self.k
        shape = traces.JobShape(ranks=n, ranks_per_node=self.k, step_s=self.s.step_s)
        self._timings = Timings(shape, f"tmd.sim.live/{self.s.seed}/timings")
        while not stop.is_set():
            if j.dead & set(j.nodes) or j.state != "running":
                await asyncio.sleep(self.s.step_s)  # stalled: nothing steps
                continue
            slowdown = max((j.slow.get(x, 0.0) for x in j.nodes), default=0.0)
            t0 = time.time()
            generation, run = j.generation, j.run
            await asyncio.sleep(BATCH_STEPS * self.s.step_s * (1 + slowdown))
            if j.dead & set(j.nodes) or (j.generation, j.run) != (generation, run):
                continue  # the batch never finished: a machine died, or the job restarted
            slow = {slot * self.k + r: (j.slow[x], 0)
                    for slot, x in enumerate(j.nodes) if x in j.slow
                    for r in range(self.k)}  # fmt: skip
            per_rank = self._timings.chunk(BATCH_STEPS, first=j.step + 1, t0=t0, slow=slow)
            for rank, steps in enumerate(per_rank):
                batch = wire.IterBatch(ts=time.time(), job=JOB, rank=rank, run=j.run,
                                       node=j.nodes[rank // self.k], generation=j.generation,
                                       steps=steps)  # fmt: skip
                await self._publish(wire.iter_topic(JOB, rank), batch, qos=0)
            j.step += BATCH_STEPS
            self.useful_s += BATCH_STEPS * self.s.step_s
            await self._boundary()

    async def _boundary(self) -> None:
        """Switches asked for happen here, between steps."""
        j = self.job
        for mid, flight in list(j.flights.items()):
            if not flight.switching:
                continue
            del j.flights[mid]
            p = flight.prepare
            if p.leaver not in j.nodes or p.joiner not in j.standbys:
                continue
            self._replace(j.nodes.index(p.leaver), p.joiner)
            await self._status()
            downtime = wire.Downtime(total_s=self.s.step_s)
            self._over[mid] = "switched"
            await self._acks(p, "switched", [*j.nodes, p.leaver], downtime=downtime,
                             leaver=p.leaver)  # fmt: skip
            self._end(p.leaver, "live_migrated", by="daemon")

    async def control(self) -> None:
        """Answer the daemon's commands as the runtime does."""
        assert self._pub is not None
        async for message in self._pub.messages:
            try:
                command = wire.decode(bytes(message.payload), wire.Control)
            except ProtocolError:
                continue
            await self._command(command)

    async def _command(self, command: wire.Control) -> None:
        j = self.job
        mid = command.migration_id
        if isinstance(command, wire.Prepare):
            if mid in self._over:  # a repeat of one that is over: where it stands
                await self._acks(command, self._over[mid], j.nodes[:1], detail="already")
            elif mid in j.flights:  # a repeat: prepared again, once it is
                if j.flights[mid].prepared:
                    await self._prepared(command)
            elif command.leaver in j.dead:
                # Its peers are stuck in a collective: read at the first boundary after
                # the runtime's own failover, which answers it (``_machine_died``).
                self._stuck.append(command)
            elif command.leaver not in j.nodes or command.joiner not in self._ready():
                await self._refuse(command)
            else:
                j.flights[mid] = Flight(command)
                self._later(PREPARE_S, lambda: self._prepared(command))
        elif isinstance(command, wire.Switch):
            flight = j.flights.get(mid)
            if flight is not None:
                flight.switching = True
        elif isinstance(command, wire.Abort):
            aborted = j.flights.pop(mid, None)
            if aborted is not None:
                self._over[mid] = "aborted"
                alive = [x for x in [*j.nodes, aborted.prepare.joiner] if x not in j.dead]
                await self._acks(aborted.prepare, "aborted", alive)
        elif isinstance(command, wire.Restart):
            if command.run not in (None, j.run) or j.state != "running":
                return
            if j.dead & set(j.nodes):
                return  # stalled in a collective: no boundary to act at; its failover will
            ok = command.node in j.nodes
            await self._publish(wire.job_topic(JOB, "ack"), wire.Ack(
                ts=time.time(), job=JOB, migration_id=mid,
                kind="restarting" if ok else "failed", node=j.nodes[0], rank=0, local_rank=0,
                detail="" if ok else f"{command.node} is not a member"))  # fmt: skip
            if ok:
                await self._restart([command.node])

    async def _refuse(self, prepare: wire.Prepare) -> None:
        self._over[prepare.migration_id] = "failed"
        detail = f"leaver or joiner not valid: cannot move {prepare.leaver} to {prepare.joiner}"
        await self._acks(prepare, "failed", self.job.nodes[:1], detail=detail)

    async def _prepared(self, prepare: wire.Prepare) -> None:
        j = self.job
        flight = j.flights.get(prepare.migration_id)
        if flight is None:
            return
        alive = [x for x in [*j.nodes, prepare.joiner] if x not in j.dead]
        if prepare.leaver not in j.nodes or prepare.joiner not in j.standbys:
            j.flights.pop(prepare.migration_id)
            await self._refuse(prepare)
            return
        flight.prepared = True
        await self._acks(prepare, "prepared", alive)

    async def _restart(self, nodes: list[str]) -> None:
        """The job restarts from its checkpoint, the scheduler giving it a fresh
        machine in the place of each of ``nodes``."""
        j = self.job
        j.flights.clear()
        j.state, j.excluded = "restarting", list(nodes)
        await self._status()

        async def again() -> None:
            for node in nodes:
                fresh = f"node-r{self._names:03d}"
                self._names += 1
                self.start_agent(fresh, "worker")
                j.nodes[j.nodes.index(node)] = fresh
                j.dead.discard(node)
            j.run += 1
            j.generation, j.state, j.excluded = 0, "running", []
            await self._status()
            for node in nodes:
                self._end(node, "restarted", by="runtime")

        self._later(RESTART_S, again)

    async def _machine_died(self, signal: str) -> None:
        """The runtime notices, then replaces every dead machine from replicas with a
        ready standby machine each, in one generation, or, short of standbys, restarts
        without them all (``runtime/failover.py``)."""
        j = self.job

        async def failover() -> None:
            dead = [x for x in j.nodes if x in j.dead]
            if not dead or j.state != "running":
                return  # done by an earlier notice, or restarting already
            ready, generation = self._ready(), j.generation
            survivors = [x for x in j.nodes if x not in j.dead]
            swaps = dict(zip(dead, ready, strict=False)) if len(ready) >= len(dead) else {}
            if swaps:
                j.flights.clear()  # the failover ends what was being prepared
                for lost, new in swaps.items():
                    self._replace(j.nodes.index(lost), new)
                await self._status()
            for ack in protocol.failover_answer(job=JOB, generation=generation, swaps=swaps,
                                                survivors=survivors, per_node=self.k,
                                                ts=time.time(), downtime_s=FAILOVER_S):  # fmt: skip
                await self._publish(wire.job_topic(JOB, "ack"), ack)
            if not swaps:
                await self._restart(dead)
                return
            for lost in swaps:
                self._end(lost, "failed_over", by="runtime")
            # The commands that waited at the stuck boundary are read now.
            stuck, self._stuck = self._stuck, []
            for prepare in stuck:
                await self._refuse(prepare)

        self._later(NOTICED_S[signal] + FAILOVER_S, failover)

    # -- the run -----------------------------------------------------------------------

    async def inject(self, e: Episode) -> None:
        j = self.job
        struck = {o.node for o in self.episodes if o.outcome == "unresolved"}
        calm = [x for x in j.nodes if x not in j.dead and x not in j.slow and x not in struck]
        if not calm or j.state != "running":
            e.outcome = "skipped"
            return
        e.node = self.rng.choice(calm)
        e.ts = time.time()
        if e.signal == "straggler":
            j.slow[e.node] = self.s.slowdown
        elif e.signal == "xid":
            j.dead.add(e.node)
            xid = wire.XidEvent(ts=e.ts, node=e.node, gpu=self.rng.randrange(self.k), xid=79,
                                detail=f"sim: {e.cause}")  # fmt: skip
            conn = self._connections.get(e.node)
            await self._publish(wire.node_topic(e.node, "xid"), xid, via=conn)
            await self._machine_died("xid")
        elif e.signal == "node_lost":
            j.dead.add(e.node)
            await self.cut(e.node)
            await self._machine_died("node_lost")
        else:  # planned
            await asyncio.to_thread(self.daemon.post, "/api/v1/drain",
                                    {"node": e.node, "requested_by": "maintenance"})  # fmt: skip

    async def main(self, progress: Callable[[str], None]) -> float:
        """The run; returns its length in seconds."""
        async with self.client(identifier="tmd-sim-job") as pub:
            self._pub = pub
            await pub.subscribe(wire.job_topic(JOB, "ctl"), qos=1)
            for node in self.job.nodes:
                self.start_agent(node, "worker")
            for node in self.job.standbys:
                self.start_agent(node, "standby")
            await self._status()
            stop = asyncio.Event()
            workers = [asyncio.create_task(self.train(stop)),
                       asyncio.create_task(self.control())]  # fmt: skip
            t0 = time.monotonic()
            for e in self.episodes:
                await asyncio.sleep(max(0.0, t0 + e.t_s - time.monotonic()))
                await self.inject(e)
                progress(f"{e.t_s:5.1f} s  {e.signal} on {e.node or '-'} ({e.cause})")
            await asyncio.sleep(max(0.0, t0 + self.s.seconds - time.monotonic()))
            stop.set()
            elapsed = time.monotonic() - t0
            for w in workers:
                w.cancel()
            ended = await asyncio.gather(*workers, *self._tasks, return_exceptions=True)
            for what, outcome in zip(["training", "control"], ended, strict=False):
                if isinstance(outcome, Exception):
                    self._failed(what, outcome)
            await self.stop_agents()
            return elapsed


def run(s: LiveSettings, progress: Callable[[str], None] = lambda text: None) -> dict[str, Any]:
    if s.machines < 3 or s.per_node < 1 or s.standbys < 0 or s.step_s <= 0:
        raise ValueError("live: machines >= 3 (the straggler detector compares peers), "
                         "per node >= 1, standbys >= 0, step > 0")  # fmt: skip
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tmd-sim-live-") as tmp, \
            local_broker(embedded=s.embedded_broker) as broker:  # fmt: skip
        root = Path(tmp)
        daemon = Daemon(root, {"host": broker.host, "port": broker.port}, **daemon_sections())
        progress(f"daemon ready ({type(broker).__name__} on port {broker.port})")
        try:
            cluster = Cluster(s, broker.host, broker.port, daemon)
            elapsed = asyncio.run(cluster.main(progress))
            # The daemon's view, once it has what the job last said (or a second on).
            ours = _view_of_status(cluster.published)
            deadline = time.monotonic() + SETTLE_S
            while True:
                theirs = _daemon_view(daemon.get(f"/api/v1/status?job={JOB}"))
                if theirs == ours or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            metrics = daemon.get_text("/metrics")
        finally:
            daemon.stop()
        result = _result(s, cluster, elapsed, (ours, theirs), metrics, daemon.journal)
    result["broker"] = type(broker).__name__
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    result["load"] = os.getloadavg()[0]
    return result


def daemon_sections() -> dict[str, dict[str, Any]]:
    """``tmd run``'s config here: every timeout scaled to a run of seconds."""
    return {
        "detectors": {"straggler": {"enabled": True},
                      "node_lost": {"heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S}},
        "policies": {"rebalance": {"enabled": True, "interval_min": REBALANCE_S / 60,
                                   "persist_s": 1.0},
                     "drain": {"retry_s": 1.0, "retry_max_s": 4.0}},
        "guardrails": {"min_standby_pool": 0, "node_cooldown_s": 1.0, "max_per_hour": 1000},
    }  # fmt: skip


def _result(s: LiveSettings, cluster: Cluster, elapsed: float,
            view: tuple[dict[str, Any], dict[str, Any]], metrics: str,
            journal: Path) -> dict[str, Any]:  # fmt: skip
    j = cluster.job
    rows = _journal(journal)
    failures: list[dict[str, Any]] = []
    for e in cluster.episodes:
        found = [r for r in rows["events"] if r[1] in FINDINGS and r[2] == e.node and r[0] >= e.ts]
        decided = [r for r in rows["events"]
                   if r[1] in DECISIONS and r[2] == e.node and r[0] >= e.ts]  # fmt: skip
        failures.append({
            "t_s": e.t_s, "signal": e.signal, "cause": e.cause, "node": e.node,
            "found_s": round(found[0][0] - e.ts, 3) if found and e.ts else None,
            "found_by": found[0][1] if found else None,
            "decision": f"{decided[0][1]}:{decided[0][3]}" if decided else None,
            "outcome": e.outcome, "ended_by": e.ended_by or None, "ended_s": e.ended_s,
        })  # fmt: skip
    ours, theirs = view
    received = _counters(metrics, "tmd_messages_received_total", "kind")
    rejected = _counters(metrics, "tmd_messages_rejected_total", "reason")
    latencies: dict[str, list[float]] = {}
    for f in failures:
        if isinstance(f["found_s"], float):
            latencies.setdefault(str(f["signal"]), []).append(f["found_s"])
    return {
        "live": True,
        "machines": s.machines, "per_node": s.per_node, "ranks": s.machines * s.per_node,
        "standbys": s.standbys, "step_s": s.step_s, "seconds": s.seconds, "seed": s.seed,
        "mix": s.mix,
        "failures": failures,
        "injected": sum(1 for e in cluster.episodes if e.ts),
        "found": sum(1 for f in failures if f["found_by"] is not None),
        "decided": sum(1 for f in failures if f["decision"] is not None),
        "ended": sum(1 for e in cluster.episodes if e.outcome in OUTCOMES),
        "ended_by": dict(Counter(e.ended_by for e in cluster.episodes if e.ended_by)),
        "detection_latency_s": {k: sorted(v)[len(v) // 2] for k, v in sorted(latencies.items())},
        "decisions": dict(Counter(f"{r[1]}:{r[3]}" for r in rows["events"] if r[1] in DECISIONS)),
        "migrations": dict(Counter(state for _, state in rows["migrations"])),
        # Every journaled migration ended, and was reported finished exactly once.
        "exactly_once": all(state in ("done", "aborted", "failed")
                            and rows["finished"].count(mid) == 1
                            for mid, state in rows["migrations"]),
        "view_agrees": ours == theirs,
        "view": {"job": ours, "daemon": theirs},
        "sent": dict(cluster.sent),
        "received": received,
        "rejected": {k: v for k, v in rejected.items() if v},
        "ettr": round(cluster.useful_s / elapsed, 4),
        "errors": cluster.errors,
        "generation": j.generation, "run": j.run,
    }  # fmt: skip


def _journal(path: Path) -> dict[str, list[Any]]:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        events = [(ts, kind, node, json.loads(body).get("policy"))
                  for ts, kind, node, body in db.execute(
                      "SELECT ts, kind, node, body FROM events ORDER BY id")]  # fmt: skip
        migrations = db.execute("SELECT id, state FROM migrations").fetchall()
        finished = [json.loads(body).get("migration_id") for (body,) in db.execute(
            "SELECT body FROM events WHERE kind = 'MigrationFinished'")]  # fmt: skip
    finally:
        db.close()
    return {"events": events, "migrations": migrations, "finished": finished}


def _view_of_status(status: wire.JobStatus | None) -> dict[str, Any]:
    """What the job last said of itself: what the daemon's view should hold."""
    if status is None:
        return {}
    return {
        "generation": status.generation,
        "nodes": {str(m.rank): m.node for m in status.members},
        "ready_standbys": sorted(x.node for x in status.standbys if x.state == "ready"),
    }


def _daemon_view(status: dict[str, Any]) -> dict[str, Any]:
    [job] = status["jobs"] or [{}]
    return {
        "generation": job.get("generation"),
        "nodes": {str(r["rank"]): r["node"] for r in job.get("ranks", [])},
        "ready_standbys": sorted(x["node"] for x in job.get("standbys", [])
                                 if x["state"] == "ready"),
    }  # fmt: skip


def _counters(text: str, name: str, label: str) -> dict[str, int]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[sample.labels[label]] = int(sample.value)
    return out
