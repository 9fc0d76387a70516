"""Synthetic telemetry: many simulated ranks and nodes publishing real v1 messages.

Used by ``tmd bench ingest`` (load) and the tests (a job with a slow rank). It runs
in its own process, so the publisher's CPU never counts against the daemon it
measures; but it shares the machine, so it writes its MQTT packets itself
(``RawPublisher``): through paho it cost more per message than the daemon reading
them. Rank ``r`` of ``N`` publishes at phase ``r/N`` of each flush interval, so the
load is spread evenly over time as real ranks' are.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from tmd import wire
from tmd.config import AgentConfig
from tmd.mqtt_codec import encode_length, packet_bounds, publish_packet, topic_field


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
    # As agent.full_sample_every_s: the GPU sample in full this often (and first), brief
    # in between (the healthy GPUs' counters never change); 0: every one in full.
    full_sample_every_s: float = AgentConfig.full_sample_every_s
    slow: dict[int, float] = field(default_factory=dict)  # rank -> compute slowdown (1.3 = +30%)
    seed: int = 0
    # The ranks split into this many jobs of whole machines, ``{job}-0``, ``{job}-1``...
    # (each numbering its ranks from 0; ``slow`` by the rank over all); 1: ``job`` alone.
    jobs: int = 1

    def job_size(self) -> int:
        """Ranks in each job (the last may have fewer): whole machines."""
        machines = -(-self.ranks // self.ranks_per_node)
        return -(-machines // self.jobs) * self.ranks_per_node

    def job_name(self, index: int) -> str:
        return self.job if self.jobs == 1 else f"{self.job}-{index}"


@dataclass
class SynthResult:
    messages: int = 0
    rank_steps: int = 0
    gpu_messages: int = 0
    max_behind_s: float = 0.0  # how far the publisher fell behind its schedule
    elapsed_s: float = 0.0
    cpu_s: float = 0.0  # the publisher's own CPU (its process, its reading thread included)


def node_of(rank: int, ranks_per_node: int) -> str:
    return f"node-{rank // ranks_per_node:05d}"


def step_row(step: int, end: float, step_s: float, slowdown: float, rng: random.Random) -> wire.Row:
    """One plausible data-parallel step: the slow rank computes longer, the others wait
    longer in the all-reduce, so every rank's step time is alike."""
    compute = step_s * 0.6 * slowdown * (0.97 + 0.06 * rng.random())
    optimizer = step_s * 0.05
    data = step_s * 0.02
    allreduce = max(0.0, step_s - compute - optimizer - data)
    return (step, end, step_s, compute, allreduce, optimizer, data)


class RawPublisher:
    """An MQTT 3.1.1 client that only publishes, writing its packets itself, every
    packet of a round in one write: the bytes paho would send (CONNECT with a clean
    session, PUBLISH at QoS 0 or 1) for a few microseconds a message. Through paho the
    generator took 0.8 of a core at 32,768 ranks via agents, on a shared machine taken
    from the daemon the load is for. A thread reads the broker's PUBACKs; ``close``
    waits for them all."""

    KEEPALIVE_S = 60
    """Announced in CONNECT (mosquitto 2.0.12+ refuses a 3.1.1 client without one);
    ``flush`` pings after half of it without a write."""

    def __init__(self, host: str, port: int, client_id: str, timeout_s: float = 30.0) -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ident = f"{client_id}-{secrets.token_hex(4)}".encode()
        # Protocol "MQTT" level 4, clean session, the keep-alive, the client id.
        body = b"\x00\x04MQTT\x04\x02" + self.KEEPALIVE_S.to_bytes(2, "big") + topic_field(ident)
        self._sock.sendall(b"\x10" + encode_length(len(body)) + body)
        connack = self._recv_exactly(4)
        if connack[0] != 0x20 or connack[3] != 0:
            raise ConnectionError(f"broker refused the connection: {connack.hex()}")
        # Sends time out (a stalled broker ends the run); the reader waits on.
        self._wrote = time.monotonic()
        self._out = bytearray()
        self._topics: dict[str, bytes] = {}
        self._pid = 0
        self.sent_qos1 = 0
        self.acked = 0
        self._reader = threading.Thread(target=self._read, name="tmd-synth-acks", daemon=True)
        self._reader.start()

    def _recv_exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self._sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("broker closed the connection")
            data += chunk
        return data

    def _read(self) -> None:
        buf = bytearray()
        while True:
            try:
                chunk = self._sock.recv(65536)
            except TimeoutError:
                continue  # nothing to read for a while: the broker has nothing to ack
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            pos = 0
            while (bounds := packet_bounds(buf, pos, 1 << 20)) is not None:
                first, _, end = bounds
                if first >> 4 == 4:  # PUBACK
                    self.acked += 1
                pos = end
            del buf[:pos]

    def publish(self, topic: str, payload: bytes, *, qos: int = 0, retain: bool = False) -> None:
        """Queue one PUBLISH for the next ``flush``."""
        field = self._topics.get(topic)
        if field is None:
            field = self._topics[topic] = topic_field(topic.encode())
        pid = 0
        if qos:
            self._pid = self._pid % 0xFFFF + 1
            pid = self._pid
            self.sent_qos1 += 1
        self._out += publish_packet(field, payload, retain=retain, pid=pid)

    def flush(self) -> None:
        now = time.monotonic()
        if not self._out and now - self._wrote > self.KEEPALIVE_S / 2:
            self._out += b"\xc0\x00"  # PINGREQ: the broker hears from it within its keep-alive
        if self._out:
            self._sock.sendall(self._out)
            self._out.clear()
            self._wrote = now

    def close(self, timeout_s: float = 30.0) -> None:
        """Send what is queued, wait for every PUBACK (up to ``timeout_s``), disconnect."""
        self.flush()
        deadline = time.monotonic() + timeout_s
        while (
            self.acked < self.sent_qos1
            and self._reader.is_alive()  # the broker is still there to ack
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        try:
            self._sock.sendall(b"\xe0\x00")  # DISCONNECT
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._reader.join(5)


def publish(spec: SynthSpec, results: Any = None) -> SynthResult:
    """Publish for ``spec.seconds``; put the SynthResult on ``results`` if given."""
    client = RawPublisher(spec.host, spec.port, f"tmd-synth-{spec.job}-{spec.seed}")
    rng = random.Random(spec.seed)
    members = [wire.Member(r, node_of(r, spec.ranks_per_node)) for r in range(spec.ranks)]
    t0 = time.time()
    size = spec.job_size()
    for j, first in enumerate(range(0, spec.ranks, size)):
        mine = [wire.Member(m.rank - first, m.node) for m in members[first : first + size]]
        status = wire.JobStatus(
            ts=t0, job=spec.job_name(j), generation=0, world_size=len(mine), members=mine
        )
        topic = wire.job_topic(spec.job_name(j), "status")
        client.publish(topic, wire.encode(status), qos=1, retain=True)
    client.flush()
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
        client.flush()
        time.sleep(0.002)
    out = sender.out
    out.elapsed_s = time.monotonic() - start
    client.close()  # every QoS 1 message acknowledged: the broker has them
    out.cpu_s = time.process_time() - cpu0
    if results is not None:
        results.put(out)
    return out


class _Sender:
    """``publish``'s schedule: ranks due by phase within each flush period, nodes' GPU
    samples by phase within each second, and what has been sent so far."""

    def __init__(
        self,
        spec: SynthSpec,
        client: RawPublisher,
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
        # Each rank's job (by index, and its name) and its rank in it.
        size = spec.job_size()
        self.job_names = [spec.job_name(j) for j in range(-(-n // size))]
        self.job_of = [self.job_names[r // size] for r in range(n)]
        self.size = size
        self.iter_topics = [wire.iter_topic(self.job_of[r], r % size) for r in range(n)]
        self.node_names = [
            node_of(i * spec.ranks_per_node, spec.ranks_per_node) for i in range(self.nodes)
        ]
        self.gpu_topics = [wire.node_topic(name, "gpu") for name in self.node_names]
        self.node_iter_topics = [wire.node_topic(name, "iter") for name in self.node_names]
        # The last sequence number sent on each topic: each node's two, each rank's.
        self.gpu_seq = [0] * self.nodes
        self.iter_seq = [0] * self.nodes
        self.rank_seq = [0] * n
        # The usual nodes, each of their ranks one step due, as vectors (``_due_columns``).
        self.np_rng = np.random.default_rng(spec.seed)
        self.next_step = np.ones(n, dtype=np.int64)  # each rank's next step to send
        self.phase_s = np.arange(n) / n * spec.step_s  # rank r's step ends at phase r/n
        self.slowdown = np.ones(n)
        for r, slow in spec.slow.items():
            if 0 <= r < n:
                self.slowdown[r] = slow
        self.gpu_pool = [self._gpus() for _ in range(64)]
        # Healthy, so one key (``wire.BriefSamples.key``) for all: their temperatures vary.
        self.gpu_key = wire.BriefSamples.key(self.gpu_pool[0])
        every = spec.full_sample_every_s
        self.briefs = [
            wire.BriefSamples(every, phase_s=every * i / self.nodes) for i in range(self.nodes)
        ]
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
            steps = [wire.StepTiming(*row) for row in self._rows_done(r, now)]
            if steps:
                self.rank_seq[r] += 1  # numbered as the runtime numbers what it publishes
                batch = wire.IterBatch(
                    ts=now,
                    job=self.job_of[r],
                    rank=r % self.size,
                    node=self.members[r].node,
                    steps=steps,
                    seq=self.rank_seq[r],
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
        first = self.sent_nodes
        now = time.time()
        # The nodes due now, made together as vectors when each of their ranks has one
        # step due (the usual case); else each rank apart (``_rows_done``).
        together = self._due_columns(first * k, min(n, due * k), now) if due > first else None
        while self.sent_nodes < due:
            i = self.sent_nodes
            slot = self.period * spec.flush_s + min(n, (i + 1) * k) / n * spec.flush_s
            out.max_behind_s = max(out.max_behind_s, now_m - slot)
            node = self.node_names[i]
            ranks: list[int] = []
            counts: list[int] = []
            if together is not None:
                a, b = (i - first) * k, min(n, (i + 1) * k) - first * k
                ranks, counts = together[0][a:b], [1] * (b - a)
                step, end_ts, step_s, compute_s, allreduce_s, optimizer_s, data_s = (
                    c[a:b] for c in together[1:]
                )
            else:
                rows: list[wire.Row] = []
                for r in range(i * k, min(n, (i + 1) * k)):
                    done = self._rows_done(r, now)
                    if done:
                        ranks.append(r)
                        counts.append(len(done))
                        rows += done
                step, end_ts, step_s, compute_s, allreduce_s, optimizer_s, data_s = (
                    list(c) for c in zip(*rows, strict=True)
                ) if rows else ([] for _ in range(7))  # fmt: skip
            out.rank_steps += len(step)
            alone = not (ranks and spec.relay_sample)  # on its own topic, numbered
            sample = self._sample(i, now, alone=alone) if spec.gpu_health else None
            if ranks:
                # As the agent relays them (wire.RelayedBatches.of), made in place.
                first_rank = ranks[0] - ranks[0] % self.size  # its job's (whole machines)
                relayed = wire.RelayedBatches(
                    job=self.job_of[ranks[0]], rank=[r - first_rank for r in ranks],
                    ts=[now] * len(ranks), generation=[0] * len(ranks),
                    run=[None] * len(ranks), count=counts, step=step, end_ts=end_ts,
                    step_s=step_s, compute_s=compute_s, allreduce_s=allreduce_s,
                    optimizer_s=optimizer_s, data_s=data_s,
                )  # fmt: skip
                inside = sample if spec.relay_sample else None
                self.iter_seq[i] += 1
                message = wire.NodeIter(
                    ts=now, node=node, jobs=[relayed], gpu=inside, seq=self.iter_seq[i]
                )
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

    def _gpus(self) -> list[wire.GpuSample]:
        """Healthy GPUs as ``tmd agent`` samples them on an H100: every field read
        (counters at 0, not None), so the daemon decodes and checks what it would."""
        return [
            wire.GpuSample(
                index=g, temp_c=55.0 + self.rng.random() * 10, power_w=400.0, util_pct=97.0,
                mem_used_mb=61_440, clock_event_reasons=0, ecc_sbe_volatile=0,
                ecc_dbe_volatile=0, ecc_sbe_aggregate=0, ecc_dbe_aggregate=0,
                retired_pages_pending=False, remap_pending=False, remap_failure=False,
                nvlink_replay=0, nvlink_recovery=0, nvlink_crc=0, pcie_replay=0,
                recovery_action=0,
            )
            for g in range(min(8, self.spec.ranks_per_node))
        ]  # fmt: skip

    def _sample(self, i: int, now: float, *, alone: bool = True) -> wire.NodeGpu:
        """Node ``i``'s GPUs now, healthy; their readings one of a pool made at start.
        ``alone``: sent on its own topic, so numbered as the agent numbers it."""
        gpus = self.gpu_pool[self.rng.randrange(len(self.gpu_pool))]
        seq = None
        if alone:
            seq = self.gpu_seq[i] = self.gpu_seq[i] + 1
        sample = wire.NodeGpu(ts=now, node=self.node_names[i], gpus=gpus, seq=seq)
        return self.briefs[i].shape(sample, now, key=self.gpu_key)

    def _due_columns(self, lo: int, hi: int, now: float) -> tuple[list[Any], ...] | None:
        """Ranks ``lo`` to ``hi`` and their step columns, as vectors, when each has
        exactly one step due by ``now`` (what ``_rows_done`` would make of each, alike
        in law); None otherwise."""
        spec = self.spec
        steps = self.next_step[lo:hi]
        ends = self.t0 + steps * spec.step_s + self.phase_s[lo:hi]
        if not ((ends <= now).all() and (ends + spec.step_s > now).all()):
            return None
        step_s = spec.step_s
        compute = step_s * 0.6 * self.slowdown[lo:hi] * (0.97 + 0.06 * self.np_rng.random(hi - lo))
        optimizer, data = step_s * 0.05, step_s * 0.02
        allreduce = np.maximum(0.0, step_s - compute - optimizer - data)
        m = hi - lo
        out = (list(range(lo, hi)), steps.tolist(), ends.tolist(), [step_s] * m,
               compute.tolist(), allreduce.tolist(), [optimizer] * m, [data] * m)  # fmt: skip
        self.next_step[lo:hi] += 1
        return out

    def _rows_done(self, r: int, now: float) -> list[wire.Row]:
        """Rank ``r``'s steps ended by ``now`` and not yet sent (at most one batch)."""
        spec, n = self.spec, self.spec.ranks
        rows: list[wire.Row] = []
        k = int(self.next_step[r])
        while len(rows) < wire.MAX_STEPS_PER_BATCH:
            end = self.t0 + (k + r / n) * spec.step_s
            if end > now:
                break
            rows.append(step_row(k, end, spec.step_s, spec.slow.get(r, 1.0), self.rng))
            k += 1
        self.next_step[r] = k
        return rows

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
