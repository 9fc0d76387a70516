"""Wire types of protocol version 1: every MQTT topic and payload of tmd, declared once.

The agent, the training runtime and the daemon all encode and decode with this
module, so it imports nothing but msgspec. Payloads are JSON objects carrying ``v``
(schema version) and ``ts`` (seconds since the epoch, sender's clock). Additive
changes keep ``v = 1``: unknown fields are ignored, so old daemons read new agents.
Every number that arrives from outside is bounded here, so a decoded message is
safe to use: durations are finite and non-negative, ranks and lists are bounded,
names are single topic segments.

Sequence numbers (``seq``): an agent numbers what it sends on each of its telemetry
topics (``gpu``, ``iter``) 1, 2, 3..., counting only what it handed to the broker; a
restarted agent starts over at 1; so does a rank process on its own ``iter`` topic,
counted apart for each run and generation (a switch brings in another process), and
after each reconnect (what its dead connection held was lost before the broker). MQTT
keeps one publisher's messages on a topic in order, so a receiver that reads ``n``
after ``m < n - 1`` knows ``n - m - 1`` were lost on the way (a broker drops what a
subscriber that lags cannot take), and one that reads ``n <= m`` knows the sender
started over (or a message came twice across a reconnect) and counts on from ``n``.
What an agent handed over just before its link died is lost before the broker, and
may be counted so where its reconnect's status arrives after its next messages: a
loss all the same.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Collection, Iterable, Iterator
from typing import Annotated, Any, Final, Literal

import msgspec

from tmd.errors import ProtocolError

VERSION: Final = 1
PREFIX: Final = "tmd/v1"

# -- bounded scalar types --------------------------------------------------------------

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@-]+$")]
"""A node, job or migration name: one MQTT topic segment, no wildcards."""
Text = Annotated[str, msgspec.Meta(max_length=1024)]
"""Free text (details, reasons): bounded so a message cannot bloat the view."""
Label = Annotated[str, msgspec.Meta(max_length=256)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=86_400.0)]
SignedSeconds = Annotated[float, msgspec.Meta(ge=-86_400.0, le=86_400.0)]
"""A measured difference against a median step: below zero when the step it
describes was faster than the median (step-time noise), never clamped."""
Timestamp = Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=1 << 24)]
Step = Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)]
GpuIndex = Annotated[int, msgspec.Meta(ge=0, lt=64)]

MAX_STEPS_PER_BATCH: Final = 1024
MAX_RELAYED_BATCHES: Final = 1024
"""Per ``NodeIter``: the batches of every rank of a machine since the last flush."""
MAX_RELAYED_STEPS: Final = 1 << 16
"""Per ``RelayedBatches``: the steps of its batches, all together."""
MAX_RELAYED_JOBS: Final = 64
"""Per ``NodeIter``: the jobs whose ranks run on the machine."""
MAX_GPUS_PER_NODE: Final = 64
MAX_MEMBERS: Final = 1 << 20


class Message(msgspec.Struct, kw_only=True, frozen=True):
    """Fields every payload carries."""

    v: int = VERSION
    ts: Timestamp


# -- node: agent -> daemon -------------------------------------------------------------


class GpuInfo(msgspec.Struct, kw_only=True, frozen=True):
    index: GpuIndex
    uuid: Label = ""
    name: Label = ""
    memory_mb: Count | None = None


class NodeStatus(Message, kw_only=True, frozen=True):
    """``tmd/v1/node/{node}/status``, QoS 1, retained; also the agent's Last Will."""

    node: Name
    state: Literal["online", "offline"]
    role: Literal["worker", "standby"] = "worker"
    gpus: Annotated[list[GpuInfo], msgspec.Meta(max_length=MAX_GPUS_PER_NODE)] = []
    hostname: Label = ""
    agent: Label = ""


class GpuSample(msgspec.Struct, kw_only=True, frozen=True):
    """One NVML sample of one GPU. ``None`` means the device does not support it."""

    index: GpuIndex
    temp_c: float | None = None
    power_w: float | None = None
    util_pct: float | None = None
    mem_used_mb: Count | None = None
    clock_event_reasons: Count | None = None  # nvmlDeviceGetCurrentClocksEventReasons bitmask
    ecc_sbe_volatile: Count | None = None
    ecc_dbe_volatile: Count | None = None
    ecc_sbe_aggregate: Count | None = None
    ecc_dbe_aggregate: Count | None = None
    retired_pages_pending: bool | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    nvlink_replay: Count | None = None  # summed over links
    nvlink_recovery: Count | None = None
    nvlink_crc: Count | None = None
    pcie_replay: Count | None = None
    recovery_action: Count | None = None  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION


BRIEF_FIELDS: Final = frozenset(
    {"index", "clock_event_reasons", "temp_c", "power_w", "util_pct", "mem_used_mb"}
)
"""What a brief sample does not repeat from its full one: the GPU's clock event reasons
(sent), and the readings no detector judges (not sent). Every other field is a
counter or a flag that stays put on a healthy GPU."""


class NodeGpu(Message, kw_only=True, frozen=True):
    """``tmd/v1/node/{node}/gpu``, QoS 0: one sample of every GPU; doubles as heartbeat.

    Full or brief (``BriefSamples``): a brief sample sends no ``gpus`` but each GPU's
    clock event reasons (``reasons``), and says that every GPU's counters and flags
    read as in the full sample of the same ``rev``. A receiver that does not hold that
    one takes it as a heartbeat; a daemon from before briefs reads it as a sample of
    no GPUs, and judges the GPUs on the full samples, one every few seconds."""

    node: Name
    gpus: Annotated[list[GpuSample], msgspec.Meta(max_length=MAX_GPUS_PER_NODE)] = []
    seq: Count | None = None
    """The agent's sequence number on this topic (see the module's docstring); None
    inside a ``NodeIter``, and from agents that do not number their samples."""
    rev: Count | None = None
    """Which reading of the GPUs' counters and flags a full sample carries (the agent
    numbers them as they change), or a brief one repeats; None from agents that send
    every sample in full."""
    reasons: Annotated[list[Count | None], msgspec.Meta(max_length=MAX_GPUS_PER_NODE)] | None = None
    """Set on a brief sample only: each GPU's clock event reasons, in the order of the
    full sample's ``gpus``."""

    @property
    def brief(self) -> bool:
        return self.reasons is not None

    def check(self) -> None:
        """ProtocolError ``schema`` where a GPU's index comes twice (one sample each),
        or a brief sample carries GPUs or no ``rev``."""
        if self.reasons is not None:
            if self.gpus or self.rev is None:
                raise ProtocolError("schema", "a brief GPU sample carries no gpus, and a rev")
        elif len({g.index for g in self.gpus}) != len(self.gpus):
            raise ProtocolError("schema", "a GPU index comes twice in one sample")

    def repeats(self, full: NodeGpu | None) -> bool:
        """Whether this brief sample repeats ``full`` (the last full one its receiver
        holds from the node): the same ``rev``, and a reading for each of its GPUs."""
        return (
            full is not None
            and full.rev == self.rev
            and self.reasons is not None
            and len(self.reasons) == len(full.gpus)
        )


class BriefSamples:
    """How an agent abbreviates its samples (``agent.full_sample_every_s``): in full
    when a GPU's counters or flags (all but ``BRIEF_FIELDS``) changed, for the next
    ``repeat`` samples after (one dropped on the way does not hide a change until the
    next full one), and every ``every_s`` seconds (a daemon that (re)starts or lost
    one resolves briefs from then on); briefly otherwise. ``every_s`` 0: always full.
    A change takes the next ``rev``; the first is taken from the clock, so a restarted
    agent does not repeat its last life's numbers."""

    def __init__(self, every_s: float, *, repeat: int = 2, phase_s: float = 0.0) -> None:
        """``phase_s``: the first periodic full sample that much sooner (agents started
        at once, as a simulated cluster's, spread theirs as agents started apart do).
        ``every_s`` 0, or a sample without GPUs (heartbeat only): always in full."""
        self.every_s = every_s
        self.repeat = repeat
        self.rev = time.time_ns() // 1_000_000  # ms: below ``Count``'s bound for ages
        self._key: tuple[Any, ...] | None = None
        self._full_at = -math.inf
        self._left = 0
        self._phase_s = phase_s

    def reset(self) -> None:
        """The next samples in full under a new ``rev`` (a new connection: what was
        sent before may not have gone, and briefs must not lean on it)."""
        if self._key is not None:
            self._key = None
            self.rev += 1

    @staticmethod
    def key(gpus: list[GpuSample]) -> tuple[Any, ...]:
        """What a brief sample repeats of ``gpus``: all but ``BRIEF_FIELDS``, and the
        GPUs' indexes in order."""
        return tuple(
            (g.index, *(getattr(g, f) for f in g.__struct_fields__ if f not in BRIEF_FIELDS))
            for g in gpus
        )

    def shape(self, sample: NodeGpu, now: float, *, key: tuple[Any, ...] | None = None) -> NodeGpu:
        """``sample`` as it goes out: in full with its ``rev``, or brief. ``key``:
        ``BriefSamples.key(sample.gpus)``, where the caller has it already."""
        if self.every_s <= 0 or not sample.gpus:
            return sample  # a heartbeat without GPUs: nothing to abbreviate
        if key is None:
            key = self.key(sample.gpus)
        if key != self._key:
            if self._key is not None:
                self.rev += 1
            self._key, self._left = key, self.repeat + 1
        if self._left > 0:  # a change, or the first: in full, the period from it
            self._left -= 1
            self._full_at = now - self._phase_s
            return msgspec.structs.replace(sample, rev=self.rev)
        if now - self._full_at >= self.every_s:
            self._full_at, self._phase_s = now, 0.0
            return msgspec.structs.replace(sample, rev=self.rev)
        return NodeGpu(
            ts=sample.ts, node=sample.node, seq=sample.seq, rev=self.rev,
            reasons=[g.clock_event_reasons for g in sample.gpus],
        )  # fmt: skip


class XidEvent(Message, kw_only=True, frozen=True):
    """``tmd/v1/node/{node}/xid``, QoS 1. ``ts`` is when the driver reported it."""

    node: Name
    gpu: GpuIndex
    xid: Count
    detail: Text = ""


# -- job: runtime -> daemon ------------------------------------------------------------


class StepTiming(msgspec.Struct, array_like=True, frozen=True):
    """One training step of one rank, sent as a JSON array to keep batches small:
    ``[step, end_ts, step_s, compute_s, allreduce_s, optimizer_s, data_s]``.

    ``compute_s`` is forward + backward; ``allreduce_s`` the time spent waiting in
    gradient collectives. In data-parallel training every rank waits for the slowest,
    so ``step_s`` is alike everywhere and a slow machine shows in ``compute_s``.
    """

    step: Step
    end_ts: Timestamp
    step_s: Seconds
    compute_s: Seconds
    allreduce_s: Seconds
    optimizer_s: Seconds
    data_s: Seconds


Row = tuple[int, float, float, float, float, float, float]
"""A step as ``StepTiming`` orders it: step, end_ts, then the durations."""


class IterBatch(Message, kw_only=True, frozen=True):
    """``tmd/v1/job/{job}/rank/{rank}/iter``, QoS 0: the steps since the last batch."""

    job: Name
    rank: Rank
    node: Name
    generation: Count = 0
    steps: Annotated[list[StepTiming], msgspec.Meta(min_length=1, max_length=MAX_STEPS_PER_BATCH)]
    run: Count | None = None
    """The job's run (``JobStatus.run``: its launcher's restart count) these steps belong
    to; None from a runtime before runs were sent (then the job's status tells)."""
    seq: Count | None = None
    """The rank process's sequence number on this topic, of what it published itself
    (see the module's docstring; what its machine's agent relayed is not counted)."""

    def rows(self) -> list[Row]:
        """Its steps as ``Row`` tuples, the form the view takes them in."""
        return [(s.step, s.end_ts, s.step_s, s.compute_s, s.allreduce_s, s.optimizer_s,
                 s.data_s) for s in self.steps]  # fmt: skip


_STEP_FIELDS: Final = ("step", "end_ts", "step_s", "compute_s", "allreduce_s",
                       "optimizer_s", "data_s")  # fmt: skip


class RelayedBatches(msgspec.Struct, kw_only=True, frozen=True):
    """One job's batches in a ``NodeIter``, as columns: batch ``i`` is rank
    ``rank[i]``'s, made at ``ts[i]``, of ``generation[i]`` and ``run[i]`` (as in
    ``IterBatch``), with ``count[i]`` steps. The step columns hold the steps of every
    batch, batch after batch, each field of ``StepTiming`` a column. What a rank
    published as ``IterBatch`` naming the ``NodeIter``'s node, in a form the daemon
    reads without a Python object per step (``batches`` gives them back)."""

    job: Name
    rank: Annotated[list[Rank], msgspec.Meta(min_length=1, max_length=MAX_RELAYED_BATCHES)]
    ts: Annotated[list[Timestamp], msgspec.Meta(max_length=MAX_RELAYED_BATCHES)]
    generation: Annotated[list[Count], msgspec.Meta(max_length=MAX_RELAYED_BATCHES)]
    run: Annotated[list[Count | None], msgspec.Meta(max_length=MAX_RELAYED_BATCHES)]
    count: Annotated[
        list[Annotated[int, msgspec.Meta(ge=1, le=MAX_STEPS_PER_BATCH)]],
        msgspec.Meta(max_length=MAX_RELAYED_BATCHES),
    ]
    step: Annotated[list[Step], msgspec.Meta(max_length=MAX_RELAYED_STEPS)]
    end_ts: Annotated[list[Timestamp], msgspec.Meta(max_length=MAX_RELAYED_STEPS)]
    step_s: Annotated[list[Seconds], msgspec.Meta(max_length=MAX_RELAYED_STEPS)]
    compute_s: Annotated[list[Seconds], msgspec.Meta(max_length=MAX_RELAYED_STEPS)]
    allreduce_s: Annotated[list[Seconds], msgspec.Meta(max_length=MAX_RELAYED_STEPS)]
    optimizer_s: Annotated[list[Seconds], msgspec.Meta(max_length=MAX_RELAYED_STEPS)]
    data_s: Annotated[list[Seconds], msgspec.Meta(max_length=MAX_RELAYED_STEPS)]

    def check(self) -> None:
        """ProtocolError ``schema`` unless the columns line up: one entry per batch in
        each batch column, ``sum(count)`` in each step column."""
        n = len(self.rank)
        if not len(self.ts) == len(self.generation) == len(self.run) == len(self.count) == n:
            raise ProtocolError("schema", "relayed batch columns of different lengths")
        steps = sum(self.count)
        if not (  # spelled out: a generator of getattr cost 2% of the daemon at 131,072 ranks
            len(self.step) == len(self.end_ts) == len(self.step_s) == len(self.compute_s)
            == len(self.allreduce_s) == len(self.optimizer_s) == len(self.data_s) == steps
        ):  # fmt: skip
            raise ProtocolError("schema", f"relayed step columns hold other than {steps} steps")

    def steps(self) -> Iterator[Row]:
        """Every step of every batch as a ``Row``, batch after batch (after ``check``,
        which makes the columns of one length)."""
        return zip(self.step, self.end_ts, self.step_s, self.compute_s, self.allreduce_s,
                   self.optimizer_s, self.data_s, strict=True)  # fmt: skip

    def rows(self) -> Iterable[tuple[int, list[Row]]]:
        """``(i, its steps)`` for each batch ``i``, in order (after ``check``)."""
        steps = self.steps()
        for i, count in enumerate(self.count):
            yield i, [next(steps) for _ in range(count)]

    def batches(self, node: str) -> list[IterBatch]:
        """The batches as their ranks made them (after ``check``)."""
        return [
            IterBatch(ts=self.ts[i], job=self.job, rank=self.rank[i], node=node,
                      generation=self.generation[i], run=self.run[i],
                      steps=[StepTiming(*row) for row in rows])
            for i, rows in self.rows()
        ]  # fmt: skip

    @classmethod
    def of(cls, batches: Iterable[IterBatch]) -> list[RelayedBatches]:
        """``batches`` as columns, one ``RelayedBatches`` per job, in order of first
        appearance (each job's batches in their order)."""
        by_job: dict[str, list[IterBatch]] = {}
        for b in batches:
            by_job.setdefault(b.job, []).append(b)
        out = []
        for job, bs in by_job.items():
            steps = [s for b in bs for s in b.steps]
            out.append(cls(
                job=job, rank=[b.rank for b in bs], ts=[b.ts for b in bs],
                generation=[b.generation for b in bs], run=[b.run for b in bs],
                count=[len(b.steps) for b in bs],
                **{f: [getattr(s, f) for s in steps] for f in _STEP_FIELDS},
            ))  # fmt: skip
        return out


class NodeIter(Message, kw_only=True, frozen=True):
    """``tmd/v1/node/{node}/iter``, QoS 1: what a machine's agent relays each tick, one
    message for the ranks on the machine (``tmd.agent.relay``): the ranks' batches as
    they made them, as columns per job (``RelayedBatches``). ``gpu``, a sample of the same
    tick, is read where present; ``tmd agent`` sends its samples on ``gpu`` as ever
    (the heartbeat for a daemon or broker ACL that does not know this topic). Added
    in protocol 1 without a version change: ranks without an agent, or whose agent
    does not confirm a batch, publish ``IterBatch`` directly, and a daemon that does
    not subscribe to this topic sees their steps only so. Deploy the daemon and the
    ACL before the agents."""

    node: Name
    jobs: Annotated[list[RelayedBatches], msgspec.Meta(min_length=1, max_length=MAX_RELAYED_JOBS)]
    gpu: NodeGpu | None = None
    seq: Count | None = None
    """The agent's sequence number on this topic (see the module's docstring)."""


def default_node_name() -> str:
    """A machine's name when none is configured: its host name, the name the agent
    publishes under, DCGM-exporter's ``Hostname`` label and every rank on the machine
    share (``TMD_NODE``'s default). Characters a topic segment may not hold become
    ``-``."""
    name = socket.gethostname()[:128] or "localhost"
    return "".join(c if c.isalnum() or c in "_.:@-" else "-" for c in name)


class Member(msgspec.Struct, array_like=True, frozen=True):
    """``[rank, node, local_rank]``: a rank of the job, the machine it runs on, and its
    index among that machine's ranks (its GPU on a GPU cluster). A payload from before
    machines had local ranks is ``[rank, node]`` and decodes with ``local_rank`` None:
    one rank per machine."""

    rank: Rank
    node: Name
    local_rank: GpuIndex | None = None


class StandbyInfo(msgspec.Struct, kw_only=True, frozen=True):
    """A standby machine: ``slots`` processes on ``node``, one per local rank, each
    warmed up. It is ``ready`` once every slot is, and can then replace a machine
    that runs ``slots`` ranks of the job."""

    node: Name
    state: Literal["warming", "ready", "joining", "failed"]
    warmup_s: Seconds | None = None
    slots: Annotated[int, msgspec.Meta(ge=1, le=MAX_GPUS_PER_NODE)] = 1


class JobStatus(Message, kw_only=True, frozen=True):
    """``tmd/v1/job/{job}/status``, QoS 1, retained: who is in the job now."""

    job: Name
    generation: Count
    world_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_MEMBERS)]
    members: Annotated[list[Member], msgspec.Meta(max_length=MAX_MEMBERS)]
    standbys: Annotated[list[StandbyInfo], msgspec.Meta(max_length=4096)] = []
    state: Literal["running", "migrating", "stopped", "restarting"] = "running"
    step: Step = 0
    run: Count = 0
    """How many times the job was started again before this run (the launcher's restart
    count): a higher run is a new run of the job, whatever its generation and step."""
    excluded: Annotated[list[Name], msgspec.Meta(max_length=4096)] = []
    """Machines a ``Restart`` asked the job to go on without: what a launcher reads to
    start the next run elsewhere (state ``restarting``)."""


def ready_standbys(
    standbys: Iterable[StandbyInfo], members: Collection[str], *, slots: int | None = None
) -> list[str]:
    """The standby machines, by name, that said they are ready and are not yet members:
    what a job's own status offers; with ``slots``, only those that can take a machine
    of that many ranks. The daemon adds what only it knows, the health and GPU model of
    their nodes (``ClusterView.ready_standbys``)."""
    return sorted(
        s.node
        for s in standbys
        if s.state == "ready" and s.node not in members and (slots is None or s.slots == slots)
    )


# -- job control: daemon -> runtime, and acks back -------------------------------------


class Prepare(Message, kw_only=True, frozen=True, tag_field="cmd", tag="prepare"):
    """Phase 1: build the next group with ``joiner`` in place of ``leaver``: every rank
    of the leaving machine is replaced by the joiner's slot of the same local rank."""

    job: Name
    migration_id: Name
    leaver: Name  # machine going out
    joiner: Name  # standby machine coming in
    deadline_s: Seconds = 60.0


class Switch(Message, kw_only=True, frozen=True, tag_field="cmd", tag="switch"):
    """Phase 2: swap at ``at_step`` (None: the first boundary every member agrees on)."""

    job: Name
    migration_id: Name
    at_step: Step | None = None


class Abort(Message, kw_only=True, frozen=True, tag_field="cmd", tag="abort"):
    job: Name
    migration_id: Name
    reason: Text = ""


class Restart(Message, kw_only=True, frozen=True, tag_field="cmd", tag="restart"):
    """Checkpoint at the next boundary, record ``node`` as excluded in the job's status,
    and exit for a restart without that machine: what the daemon asks for when no
    standby machine can replace a faulty machine whose processes still run."""

    job: Name
    migration_id: Name
    node: Name
    reason: Text = ""
    run: Count | None = None
    """The run of the job this restart is for (``JobStatus.run``); a runtime of
    another run ignores it."""


Control = Prepare | Switch | Abort | Restart


class Downtime(msgspec.Struct, kw_only=True, frozen=True):
    """Where a switch's downtime went, as measured by the runtime: ``total_s`` is the
    end of the last step before the switch to the end of the first step after it,
    minus one median step, and the four parts add up to it. ``first_step_s`` is the
    first step's excess over a median step; it and ``total_s`` are unclamped, so a
    switch cheaper than the step noise can come out slightly below zero."""

    total_s: SignedSeconds
    stop_s: Seconds = 0.0
    transfer_s: Seconds = 0.0
    switch_s: Seconds = 0.0
    first_step_s: SignedSeconds = 0.0


class Ack(Message, kw_only=True, frozen=True):
    """``tmd/v1/job/{job}/ack``, QoS 1: a member's answer to a control message."""

    job: Name
    migration_id: Name
    kind: Literal["prepared", "switched", "failed", "aborted", "restarting"]
    """``restarting``: the answer to a ``Restart``, the checkpoint written and the
    machine recorded as excluded; the process exits next."""
    node: Name
    rank: Rank | None = None
    local_rank: GpuIndex | None = None
    """Which of the machine's processes answers: a machine of K ranks answers K times
    (None from a runtime before machines: one process per machine)."""
    generation: Count | None = None
    at_step: Step | None = None
    downtime: Downtime | None = None
    detail: Text = ""


# -- topics ----------------------------------------------------------------------------


def node_topic(node: str, kind: Literal["status", "gpu", "xid", "iter"]) -> str:
    return f"{PREFIX}/node/{node}/{kind}"


def iter_topic(job: str, rank: int) -> str:
    return f"{PREFIX}/job/{job}/rank/{rank}/iter"


def job_topic(job: str, kind: Literal["status", "ctl", "ack"]) -> str:
    return f"{PREFIX}/job/{job}/{kind}"


def probe_topic(daemon: str) -> str:
    """A daemon's own lag probe: it alone publishes and reads it (``tmd.daemon.freshness``)."""
    return f"{PREFIX}/daemon/{daemon}/probe"


SUBSCRIPTIONS: Final = (
    (f"{PREFIX}/node/+/status", 1),
    (f"{PREFIX}/node/+/gpu", 0),
    (f"{PREFIX}/node/+/xid", 1),
    (f"{PREFIX}/node/+/iter", 0),
    (f"{PREFIX}/job/+/rank/+/iter", 0),
    (f"{PREFIX}/job/+/status", 1),
    (f"{PREFIX}/job/+/ack", 1),
)
"""What the daemon subscribes to, and at which QoS (``ctl`` is the daemon's own
output). Telemetry at 0, as its publishers send it, the relayed ``NodeIter`` too: its
agent publishes it at QoS 1 to know the broker has it, but on the broker's leg to the
daemon, whose sessions are clean, an acknowledgement brings nothing back after a
reconnect and cost the daemon a PUBACK per message, 15% of its CPU at 32,768 ranks.
What a broker queues for a daemon that lags is bounded either way (mosquitto's
``max_queued_messages``, see ``deploy/mosquitto/tmd.conf``), and a lagging daemon
knows it lags (``tmd.daemon.freshness``). Events and state at 1."""

# -- codec -----------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


class _Header(msgspec.Struct):
    v: Any = None


_header_decoder = msgspec.json.Decoder(_Header)
_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def decoder_for(kind: Any) -> msgspec.json.Decoder[Any]:
    found = _decoders.get(kind)
    if found is None:
        found = _decoders[kind] = msgspec.json.Decoder(kind)
    return found


def decode(data: bytes, kind: Any) -> Any:
    """Decode ``data`` as ``kind`` (a Struct type or the ``Control`` union; or a part of
    a message, ``RelayedBatches`` say, which carries no version of its own).

    Raises ProtocolError with reason ``json`` (not JSON), ``version`` (``v`` is not
    1), ``schema`` (missing field, wrong type) or ``value`` (out of range, bad name,
    too many items, unknown command).
    """
    try:
        message = decoder_for(kind).decode(data)
    except RecursionError:
        raise ProtocolError("json", "nested too deeply") from None
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError too
        _raise_for_version(data)
        if not isinstance(exc, msgspec.ValidationError):
            raise ProtocolError("json", str(exc)) from None
        text = str(exc)
        reason = "schema" if ("missing required field" in text or ", got `" in text) else "value"
        raise ProtocolError(reason, text) from None
    if isinstance(message, Message) and message.v != VERSION:  # not a part of one
        raise ProtocolError("version", f"unsupported schema version {message.v!r}")
    return message


def _raise_for_version(data: bytes) -> None:
    try:
        header = _header_decoder.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return
    if header.v is not None and header.v != VERSION:
        raise ProtocolError("version", f"unsupported schema version {header.v!r}")
