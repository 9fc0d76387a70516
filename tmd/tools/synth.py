"""Synthetic telemetry: many simulated ranks and nodes publishing real v1 messages.

Used by ``tmd bench ingest`` (load) and the demo (a job with a slow rank). It runs in
its own process with a plain paho-mqtt client, so the publisher's CPU never counts
against the daemon it measures. Rank ``r`` of ``N`` publishes at phase ``r/N`` of
each flush interval, so the load is spread evenly over time as real ranks' are.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from tmd import wire


@dataclass(frozen=True, kw_only=True)
class SynthSpec:
    host: str = "127.0.0.1"
    port: int = 1883
    job: str = "synth"
    ranks: int = 8
    ranks_per_node: int = 8
    step_s: float = 1.0
    flush_s: float = 1.0  # the runtime's telemetry flush interval
    seconds: float = 10.0
    gpu_health: bool = True  # one NodeGpu sample per node per second
    # "agent": each node's agent relays its ranks' batches with its GPU sample, one
    # NodeIter per node per flush (issue 16); "direct": one IterBatch per rank.
    via: Literal["direct", "agent"] = "direct"
    relay_sample: bool = False  # via agent: the sample inside the NodeIter (agent.relay_sample)
    slow: dict[int, float] = field(default_factory=dict)  # rank -> compute slowdown (1.3 = +30%)
    seed: int = 0


@dataclass
class SynthResult:
    messages: int = 0
    rank_steps: int = 0
    gpu_messages: int = 0
    max_behind_s: float = 0.0  # how far the publisher fell behind its schedule
    elapsed_s: float = 0.0
    cpu_s: float = 0.0  # the publisher's own CPU (its process, paho's thread included)


def node_of(rank: int, ranks_per_node: int) -> str:
    return f"node-{rank // ranks_per_node:05d}"


def step_timing(
    step: int, end: float, step_s: float, slowdown: float, rng: random.Random
) -> wire.StepTiming:
    """One plausible data-parallel step: the slow rank computes longer, the others wait
    longer in the all-reduce, so every rank's step time is alike."""
    compute = step_s * 0.6 * slowdown * rng.uniform(0.97, 1.03)
    optimizer = step_s * 0.05
    data = step_s * 0.02
    allreduce = max(0.0, step_s - compute - optimizer - data)
    return wire.StepTiming(step, end, step_s, compute, allreduce, optimizer, data)


def publish(spec: SynthSpec, results: Any = None) -> SynthResult:
    """Publish for ``spec.seconds``; put the SynthResult on ``results`` if given."""
    client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    client.max_queued_messages_set(0)
    client.connect(spec.host, spec.port, keepalive=60)
    client.loop_start()
    rng = random.Random(spec.seed)
    members = [wire.Member(r, node_of(r, spec.ranks_per_node)) for r in range(spec.ranks)]
    t0 = time.time()
    status = wire.JobStatus(
        ts=t0, job=spec.job, generation=0, world_size=spec.ranks, members=members
    )
    client.publish(wire.job_topic(spec.job, "status"), wire.encode(status), qos=1, retain=True)
    sender = _Sender(spec, client, rng, members, t0)
    start, cpu0 = time.monotonic(), time.process_time()
    while True:
        now_m = time.monotonic() - start
        if now_m >= spec.seconds:
            break
        if spec.via == "agent":
            sender.send_nodes(now_m)
        else:
            sender.send_ranks(now_m)
            if spec.gpu_health:
                sender.send_gpus(now_m)
        time.sleep(0.002)
    out = sender.out
    out.elapsed_s = time.monotonic() - start
    out.cpu_s = time.process_time() - cpu0
    # Wait until paho has handed everything to the socket.
    deadline = time.monotonic() + 30
    while client.want_write() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    client.loop_stop()
    client.disconnect()
    if results is not None:
        results.put(out)
    return out


class _Sender:
    """``publish``'s schedule: ranks due by phase within each flush period, nodes' GPU
    samples by phase within each second, and what has been sent so far."""

    def __init__(
        self,
        spec: SynthSpec,
        client: paho.Client,
        rng: random.Random,
        members: list[wire.Member],
        t0: float,
    ) -> None:
        self.spec = spec
        self.client = client
        self.rng = rng
        self.members = members
        self.t0 = t0
        self.out = SynthResult()
        n = spec.ranks
        self.nodes = (n + spec.ranks_per_node - 1) // spec.ranks_per_node
        self.iter_topics = [wire.iter_topic(spec.job, r) for r in range(n)]
        self.gpu_topics = [
            wire.node_topic(node_of(i * spec.ranks_per_node, spec.ranks_per_node), "gpu")
            for i in range(self.nodes)
        ]
        self.node_iter_topics = [t.rsplit("/", 1)[0] + "/iter" for t in self.gpu_topics]
        self.next_step = [1] * n
        self.sent_ranks = 0  # ranks published in the current flush period
        self.sent_nodes = 0
        self.period = 0
        self.gpu_period = 0

    def send_ranks(self, now_m: float) -> None:
        """Every rank due by ``now_m`` (seconds since the start) in this flush period."""
        spec, n, out = self.spec, self.spec.ranks, self.out
        due = min(n, int((now_m - self.period * spec.flush_s) / spec.flush_s * n) + 1)
        while self.sent_ranks < due:
            r = self.sent_ranks
            behind = now_m - (self.period * spec.flush_s + r / n * spec.flush_s)
            out.max_behind_s = max(out.max_behind_s, behind)
            now = time.time()
            steps = self._steps_done(r, now)
            if steps:
                batch = wire.IterBatch(
                    ts=now, job=spec.job, rank=r, node=self.members[r].node, steps=steps
                )
                self.client.publish(self.iter_topics[r], wire.encode(batch), qos=0)
                out.messages += 1
                out.rank_steps += len(steps)
            self.sent_ranks += 1
        if self.sent_ranks >= n:
            self.sent_ranks = 0
            self.period += 1

    def send_nodes(self, now_m: float) -> None:
        """As each node's agent relays (``via="agent"``): every node due by ``now_m`` in
        this flush period, each just after its last rank's step ended (as the
        direct path publishes each rank's batch at its step's end: neither models a
        wait for the next flush), publishes its ranks' batches in one ``NodeIter``,
        and its GPU sample on its own topic, as ``tmd agent`` does."""
        spec, nodes, n, out = self.spec, self.nodes, self.spec.ranks, self.out
        k = spec.ranks_per_node
        frac = (now_m - self.period * spec.flush_s) / spec.flush_s
        due = min(nodes, int(frac * n / k))
        while self.sent_nodes < due:
            i = self.sent_nodes
            slot = self.period * spec.flush_s + min(n, (i + 1) * k) / n * spec.flush_s
            out.max_behind_s = max(out.max_behind_s, now_m - slot)
            now = time.time()
            node = node_of(i * k, k)
            ranks: list[int] = []
            counts: list[int] = []
            rows: list[tuple[Any, ...]] = []
            for r in range(i * k, min(n, (i + 1) * k)):
                steps = self._steps_done(r, now)
                if steps:
                    ranks.append(r)
                    counts.append(len(steps))
                    rows.extend(msgspec.structs.astuple(s) for s in steps)
                    out.rank_steps += len(steps)
            sample = self._sample(i, now) if spec.gpu_health else None
            if ranks:
                # As the agent relays them (wire.RelayedBatches.of), made in place.
                step, end_ts, step_s, compute_s, allreduce_s, optimizer_s, data_s = (
                    list(c) for c in zip(*rows, strict=True)
                )
                relayed = wire.RelayedBatches(
                    job=spec.job, rank=ranks, ts=[now] * len(ranks), generation=[0] * len(ranks),
                    run=[None] * len(ranks), count=counts, step=step, end_ts=end_ts,
                    step_s=step_s, compute_s=compute_s, allreduce_s=allreduce_s,
                    optimizer_s=optimizer_s, data_s=data_s,
                )  # fmt: skip
                inside = sample if spec.relay_sample else None
                message = wire.NodeIter(ts=now, node=node, jobs=[relayed], gpu=inside)
                self.client.publish(self.node_iter_topics[i], wire.encode(message), qos=1)
                out.messages += 1
                if inside is not None:
                    sample = None
            if sample is not None:
                self.client.publish(self.gpu_topics[i], wire.encode(sample), qos=0)
                out.messages += 1
                out.gpu_messages += 1
            self.sent_nodes += 1
        if self.sent_nodes >= nodes:
            self.sent_nodes = 0
            self.period += 1

    def _sample(self, i: int, now: float) -> wire.NodeGpu:
        spec = self.spec
        return wire.NodeGpu(
            ts=now,
            node=node_of(i * spec.ranks_per_node, spec.ranks_per_node),
            gpus=[
                wire.GpuSample(index=g, temp_c=55.0 + self.rng.random() * 10, power_w=400.0,
                               util_pct=97.0, clock_event_reasons=0)
                for g in range(min(8, spec.ranks_per_node))
            ],
        )  # fmt: skip

    def _steps_done(self, r: int, now: float) -> list[wire.StepTiming]:
        """Rank ``r``'s steps ended by ``now`` and not yet sent (at most one batch)."""
        spec, n = self.spec, self.spec.ranks
        steps: list[wire.StepTiming] = []
        while True:
            k = self.next_step[r]
            end = self.t0 + (k + r / n) * spec.step_s
            if end > now or len(steps) >= wire.MAX_STEPS_PER_BATCH:
                break
            steps.append(step_timing(k, end, spec.step_s, spec.slow.get(r, 1.0), self.rng))
            self.next_step[r] = k + 1
        return steps

    def send_gpus(self, now_m: float) -> None:
        """Every node's GPU sample due by ``now_m`` in this second."""
        nodes = self.nodes
        due_nodes = min(nodes, int((now_m - self.gpu_period) * nodes) + 1)
        while self.sent_nodes < due_nodes:
            i = self.sent_nodes
            sample = self._sample(i, time.time())
            self.client.publish(self.gpu_topics[i], wire.encode(sample), qos=0)
            self.out.messages += 1
            self.out.gpu_messages += 1
            self.sent_nodes += 1
        if self.sent_nodes >= nodes:
            self.sent_nodes = 0
            self.gpu_period += 1


def heartbeat_agent(
    host: str,
    port: int,
    node: str,
    role: Literal["worker", "standby"] = "standby",
    *,
    interval_s: float = 1.0,
) -> None:
    """A stand-in node agent: retained ``online`` status with an ``offline`` Last Will,
    then one GPU-less sample per ``interval_s`` as heartbeat, until killed. Run it in a
    process and SIGKILL it to make the broker deliver the Last Will."""
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"agent-{node}")
    offline = wire.NodeStatus(ts=time.time(), node=node, state="offline", role=role)
    client.will_set(wire.node_topic(node, "status"), wire.encode(offline), qos=1, retain=True)
    client.connect(host, port, keepalive=5)
    client.loop_start()
    online = wire.NodeStatus(ts=time.time(), node=node, state="online", role=role)
    client.publish(wire.node_topic(node, "status"), wire.encode(online), qos=1, retain=True)
    while True:
        beat = wire.NodeGpu(ts=time.time(), node=node)
        client.publish(wire.node_topic(node, "gpu"), wire.encode(beat), qos=0)
        time.sleep(interval_s)


def start(spec: SynthSpec) -> tuple[mp.process.BaseProcess, Any]:
    """Run ``publish`` in a new process; returns (process, queue for the result)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=publish, args=(spec, results), name="tmd-synth", daemon=True)
    proc.start()
    return proc, results
