"""The cluster view: jobs, their ranks and nodes, nodes and their GPUs, standbys.

Memory is bounded: each rank keeps a fixed ring of its last ``window`` steps, each
node its latest GPU sample and a short XID history, and the counts of jobs and nodes
are capped. So is what jobs hold against ``max_ranks``: each job its reporting ranks
or the members its status lists, whichever are more, plus the standby and excluded
machines its status lists (``JobView.held``); a message that would take more is
refused (``limit``) before it changes anything. Each message costs O(its own size),
independent of how many ranks exist.
Step reports may arrive twice, late or out of order: a step lands in the ring slot
``step % window``, a slot already holding that step is a duplicate, and a step older
than the ring is too late to matter and is dropped.

The view also holds the one definition of a ready standby (``ready_standbys``), which
the policies, the actuator's standby choice and its guardrails share, so a policy
does not decide a migration that the actuator then holds for want of a standby.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from tmd import wire
from tmd.config import Config
from tmd.daemon.columns import StepColumns
from tmd.daemon.freshness import Freshness
from tmd.daemon.ranks import RankState, StepsApplied
from tmd.errors import ProtocolError


@dataclass
class JobView:
    job: str
    world_size: int | None = None
    generation: int = 0
    state: str = "unknown"
    step: int = 0
    run: int = 0  # the launcher's restart count of the job (0 from old runtimes)
    # The (run, generation) its steps last went back at (``went_back``), and how many
    # times they have: a rank still at an earlier (run, generation) reports a timeline
    # the job has left (it has not reported since, or is gone).
    rewound: tuple[int, int] = (0, 0)
    rewinds: int = 0
    members: dict[int, str] = field(default_factory=dict)  # rank -> node (its machine)
    # rank -> its index among its machine's ranks; None from a runtime before machines
    # (one rank per machine)
    local_ranks: dict[int, int | None] = field(default_factory=dict)
    standbys: dict[str, wire.StandbyInfo] = field(default_factory=dict)
    # machines a Restart asked the job to go on without, as its status says
    excluded: frozenset[str] = frozenset()
    ranks: dict[int, RankState] = field(default_factory=dict)
    lost_at: float = -math.inf
    """When (daemon time) what one of its ranks published itself was last found lost
    on the way (``ClusterView.rank_gap``): its ranks' silences count from then."""
    cols: StepColumns | None = None
    """Its reporting ranks' recent steps, a column each (``RankState.col``); None
    until one reports."""
    last_seen: float = 0.0
    status_ts: float = 0.0
    held: int = 0
    """What the job counts against ``ingest.max_ranks`` (``ClusterView.held_ranks``)."""
    shard: tuple[int, int] | None = None
    """Its reporting ranks and their front step in its ingest shard, as last reported
    (``ClusterView.note_shard``); None: its ranks are here."""

    def machines(self) -> dict[str, list[int]]:
        """The job's machines, each with its ranks in local-rank order: what acts on a
        machine (a migration, a restart without it) acts on all of these."""
        out: dict[str, list[int]] = {}
        for rank in sorted(self.members, key=lambda r: (self.local_ranks.get(r) or 0, r)):
            out.setdefault(self.members[rank], []).append(rank)
        return out

    def went_back(self, run: int, generation: int) -> None:
        """Its steps went back at ``(run, generation)``: a new run from a checkpoint
        (generation 0), or a rollback to an earlier step in a new generation. Counted
        once however many of its ranks show it."""
        if (run, generation) > self.rewound:
            self.rewound = (run, generation)
            self.rewinds += 1

    def behind(self, state: RankState) -> bool:
        """Whether ``state`` is of a timeline the job has left (``went_back``)."""
        return (state.run, state.generation) < self.rewound

    def slots(self, node: str) -> int:
        """How many ranks of the job run on ``node`` (0: not a member): the slots a
        standby machine needs to take its place."""
        return sum(1 for n in self.members.values() if n == node)


MAX_RATE: Final = 100.0
"""The most messages a second an agent sends on one topic (its samples come at most
every 0.05 s, its relayed batches a few messages a tick)..."""
MAX_SLACK: Final = 128
"""...and at once (a relaying agent's backlog goes out in up to 64 messages back to
back): more missing than these allow is not believed (``ClusterView.gap``)."""
MAX_AHEAD_S: Final = 60.0
"""How far ahead of this daemon's clock an agent's stamp is taken as it is."""
RESTARTED_BELOW: Final = 16
"""A number that goes back to below this is an agent that started over (its first
messages may be lost too); one that goes back to above it is not believed."""
DOUBT_S: Final = 600.0
"""How long a node whose numbers were not believed has its gaps not judged."""
_NO_SEQ: Final = (0, 0.0)


def missing(last: int, last_ts: float, seq: int, ts: float) -> int | None:
    """How many a sender numbered between ``last`` (stamped ``last_ts``; 0: none yet)
    and ``seq`` (stamped ``ts``) never came: 0 where its count started over (below
    ``RESTARTED_BELOW``), the message came twice, or its clock stepped back (a count
    starts over from it). None where the numbers make no sense: going back to past
    where a count starts, or more missing than it could have sent between the two
    stamps (by the stamps, not by arrival: a backlog arrives at once)."""
    if not last or seq == last + 1 or seq == last or ts < last_ts:
        return 0
    if seq < last:
        return 0 if seq < RESTARTED_BELOW else None
    lost = seq - last - 1
    return lost if lost <= MAX_SLACK + MAX_RATE * (ts - last_ts) else None


@dataclass
class NodeView:
    node: str
    state: str = "unknown"
    role: str = "worker"
    gpus: list[wire.GpuInfo] = field(default_factory=list)
    sample: wire.NodeGpu | None = None
    """The last full sample (``wire.NodeGpu``): brief ones repeat it."""
    sample_seen: float = 0.0
    """When (daemon time) ``sample`` arrived: its temperatures are as old."""
    xids: deque[wire.XidEvent] = field(default_factory=lambda: deque(maxlen=32))
    last_seen: float = 0.0
    status_ts: float = 0.0
    status_seen: float = 0.0
    """When (daemon time) the last status published live arrived: the agent (re)started
    or reconnected then. A retained copy replayed on subscribing does not count."""
    live_seen: float = 0.0
    """When (daemon time) anything its agent published live last arrived."""
    seq: dict[str, tuple[int, float]] = field(default_factory=dict)
    """The last sequence number read on each of its agent's telemetry topics
    (``tmd.wire``), and its stamp, since its agent or this daemon last (re)connected."""
    seq_doubted_until: float = 0.0
    """Its numbers made no sense (``ClusterView.gap``): not judged until then."""


class ClusterView:
    @classmethod
    def of(cls, config: Config) -> ClusterView:
        """The view ``config`` asks for: its ``[ingest]`` bounds and window, and
        ``actuator.same_gpu_type``."""
        ing = config.ingest
        return cls(
            window_steps=ing.window_steps,
            max_ranks_per_job=ing.max_ranks_per_job,
            max_ranks=ing.max_ranks,
            max_jobs=ing.max_jobs,
            max_nodes=ing.max_nodes,
            same_gpu_model=config.actuator.same_gpu_type,
        )

    def __init__(
        self,
        *,
        window_steps: int = 128,
        max_ranks_per_job: int = 1 << 17,
        max_ranks: int = 1 << 17,
        max_jobs: int = 1024,
        max_nodes: int = 65536,
        same_gpu_model: bool = True,
    ) -> None:
        self.window_steps = window_steps
        self.max_ranks_per_job = max_ranks_per_job
        self.max_ranks = max_ranks
        self.max_jobs = max_jobs
        self.max_nodes = max_nodes
        # A standby must carry the GPU model of the machine it replaces (when both
        # agents reported one): ``actuator.same_gpu_type``.
        self.same_gpu_model = same_gpu_model
        self.jobs: dict[str, JobView] = {}
        self.nodes: dict[str, NodeView] = {}
        self.total_ranks = 0  # reporting ranks (RankState), over all jobs
        # The reporting ranks and steps held by the ingest shards (``tmd.daemon.shards``),
        # as they last reported: a head's view holds its jobs' statuses, not their ranks.
        self.elsewhere: tuple[int, int] = (0, 0)
        self.on_forget_job: Callable[[str], None] | None = None  # the shards' too
        # What the jobs hold against ``max_ranks``: the sum of their ``held``.
        self.held_ranks = 0
        # Whether this view is current (``tmd.daemon.freshness``); a view fed directly
        # is; the daemon installs one its ingest keeps up to date.
        self.freshness = Freshness.always()
        self._faults: dict[str, float] = {}  # node -> when a GpuFault came
        self._lost: dict[str, float] = {}  # node -> when a NodeLost came

    # -- apply: one per wire type, each O(size of the message) ---------------------------

    def apply_iter(self, batch: wire.IterBatch, now: float) -> StepsApplied:
        return self.apply_steps(
            batch.job, batch.rank, batch.node, batch.generation, batch.run, batch.rows(), now
        )

    def apply_steps(
        self, job_name: str, rank: int, node: str, generation: int, run: int | None,
        rows: Sequence[wire.Row], now: float, into: StepsApplied | None = None,
    ) -> StepsApplied:  # fmt: skip
        """One batch of a rank's steps (``rows``, at least one), whether the rank sent
        it (``IterBatch``) or its machine's agent relayed it (``RelayedBatches``); what
        became of them added to ``into`` (a message's count of its batches), or to a
        new count, and returned."""
        job = self.jobs.get(job_name)
        state = job.ranks.get(rank) if job is not None else None
        if state is None:
            state = self._new_rank(job, job_name, rank, node, now)
            job = self.jobs[job_name]
        assert job is not None
        if run is not None and run < state.run:
            # A batch of a run the job has left behind (delivered late, say after the
            # daemon reconnected): its timeline is gone, every step is late.
            out = into if into is not None else StepsApplied()
            state.late += len(rows)
            out.late += len(rows)
            return out
        if run is not None and run > state.run:
            state.new_run(run)  # a new run counts its generations from 0 again
            job.went_back(run, 0)
        elif generation > state.generation and rows[0][0] <= state.last_step:
            # A new generation restarted from an earlier step: a rollback; the job's
            # only where the rank was on its timeline (one that missed the last
            # rollback holds the steps of the one before: nothing new went back).
            current = not job.behind(state)
            state.reset()
            if current:
                job.went_back(state.run, generation)
        # An older generation's steps past what the newer one reached belong to a
        # timeline that was rolled back: too late to count.
        stale_above = state.last_step if generation < state.generation else None
        state.node = node
        state.generation = max(state.generation, generation)
        state.last_seen = now
        job.last_seen = now
        out = into if into is not None else StepsApplied()
        add = state.add
        for row in rows:
            if stale_above is not None and row[0] > stale_above:
                state.late += 1
                out.late += 1
                continue
            add(out, *row)
        return out

    def _new_rank(
        self, job: JobView | None, job_name: str, rank: int, node: str, now: float
    ) -> RankState:
        """Rank ``rank`` of job ``job_name`` (``job``, None where the view has none
        yet), new to the view, on ``node``. Every check before anything is made: a
        rejected message takes no slot."""
        bound = self.max_ranks_per_job
        if job is not None and job.world_size is not None:
            bound = job.world_size
        if rank >= bound:
            raise ProtocolError("rank", f"rank {rank} out of range for job {job_name} (< {bound})")
        # A new rank costs nothing where the job's status already listed as many members.
        grows = job is None or len(job.ranks) >= len(job.members)
        if grows and self.held_ranks >= self.max_ranks:
            raise _too_many_ranks(self.max_ranks)
        if job is None:
            job = self._job(job_name, now)
        if job.cols is None:
            # Made at their size: a copy into a new array would touch it all (numpy
            # asks for huge pages, so writing a row's first columns fills 2 MB).
            job.cols = StepColumns(self.window_steps, max(8, self._room(job, len(job.members))))
        state = job.ranks[rank] = RankState(rank, node, job.cols)
        self.total_ranks += 1
        self._hold(job, _held(len(job.ranks), job))
        return state

    def apply_relayed(
        self, relayed: wire.RelayedBatches, node: str, now: float, into: StepsApplied
    ) -> tuple[list[int], list[tuple[int, ProtocolError]]]:
        """One job's batches as ``node``'s agent relayed them (after ``check``), each
        applied as ``apply_steps`` applies a batch, its steps counted in ``into``:
        ``(the batches taken, (batch, why) for each refused)``. A refused batch leaves
        the others be. So is one of a rank the job's status places on another machine:
        an agent speaks for the ranks of its own machine only (a batch of an earlier
        generation may be a leaver's last, sent from where the rank ran before the
        switch).

        The usual batch, of a rank the view holds, in the run and generation it holds
        it in, goes straight into the rank's column: ``apply_steps`` minus what cannot
        happen to it."""
        name = relayed.job
        ranks, generations, runs = relayed.rank, relayed.generation, relayed.run
        step_col, end_col = relayed.step, relayed.end_ts
        s0, s1, s2, s3, s4 = (relayed.step_s, relayed.compute_s, relayed.allreduce_s,
                              relayed.optimizer_s, relayed.data_s)  # fmt: skip
        taken: list[int] = []
        refused: list[tuple[int, ProtocolError]] = []
        job = self.jobs.get(name)
        accepted = duplicate = late = 0
        pos = 0  # the first step of batch i in the step columns
        for i, count in enumerate(relayed.count):
            first, pos = pos, pos + count
            rank, generation, run = ranks[i], generations[i], runs[i]
            state = None
            if job is not None:
                placed = job.members.get(rank)
                if placed is not None and placed != node and generation >= job.generation:
                    refused.append((i, ProtocolError("mismatch", f"rank {rank} runs on {placed}")))
                    continue
                state = job.ranks.get(rank)
                if state is None and not run:
                    # New (a cluster's first second brings every rank's first step):
                    # as ``apply_steps`` makes it, where no new run has to be noted.
                    try:
                        state = self._new_rank(job, name, rank, node, now)
                    except ProtocolError as exc:
                        refused.append((i, exc))
                        continue
                    state.generation = generation
            if (
                job is not None
                and state is not None
                and generation == state.generation
                and (run is None or run == state.run)
            ):
                # Held, so within the job's bounds; neither a new run nor a new or old
                # generation: nothing to reset, no step from a rolled-back timeline.
                # Each step as ``RankState.add`` takes it, inline (the usual message
                # brings one step of each of a machine's ranks, and a call per step
                # was a fifth of the daemon's time).
                state.node = node
                job.last_seen = now
                cols, col, window = state.cols, state.col, state.window
                w_tags, w_end, t = cols.w_tags, cols.w_end_ts, cols.w_timings
                cols.w_last_seen[col] = now  # ``state.last_seen``, without the call
                w_last = cols.w_last_step
                last = w_last[col]
                oldest = last - window
                took = 0
                for k in range(first, pos):
                    step = step_col[k]
                    if step <= oldest:
                        late += 1
                        state.late += 1
                        continue
                    slot = step % window
                    if w_tags[slot, col] == step + 1:  # the step + 1 (``StepColumns.tags``)
                        duplicate += 1
                        state.duplicates += 1
                        continue
                    w_tags[slot, col] = step + 1
                    w_end[slot, col] = end_col[k]
                    t[slot, col] = s0[k]
                    t[window + slot, col] = s1[k]
                    t[2 * window + slot, col] = s2[k]
                    t[3 * window + slot, col] = s3[k]
                    t[4 * window + slot, col] = s4[k]
                    if step > last:
                        last = step
                        oldest = last - window
                    took += 1
                w_last[col] = last
                state.total_steps += took
                accepted += took
            else:
                rows = list(zip(step_col[first:pos], end_col[first:pos], s0[first:pos],
                                s1[first:pos], s2[first:pos], s3[first:pos], s4[first:pos],
                                strict=True))  # fmt: skip
                try:
                    self.apply_steps(name, rank, node, generation, run, rows, now, into)
                except ProtocolError as exc:
                    refused.append((i, exc))
                    continue
                job = self.jobs.get(name)  # the first batch of a new job made it
            taken.append(i)
        into.accepted += accepted
        into.duplicate += duplicate
        into.late += late
        return taken, refused

    def apply_job_status(self, status: wire.JobStatus, now: float) -> None:
        # Applied in arrival order: the broker's order per topic is the truth (a Last
        # Will composed at connect time carries an older ts than what it replaces).
        members = {m.rank: m.node for m in status.members}
        standbys = {s.node: s for s in status.standbys}
        excluded = frozenset(status.excluded)
        # Checked before anything changes: a refused status leaves the job as it was.
        known = self.jobs.get(status.job) or JobView(status.job)
        gone = [r for r in known.ranks if r >= status.world_size]
        held = max(len(known.ranks) - len(gone), len(members)) + len(standbys) + len(excluded)
        if self.held_ranks - known.held + held > self.max_ranks:
            raise _too_many_ranks(self.max_ranks)
        job = self._job(status.job, now, status=True)
        if status.run > job.run:
            # A new run of the job (its launcher started it again from a checkpoint):
            # its generations count from 0 again and its steps go back, so what the
            # ranks reported before belongs to a timeline that is gone. Kept, its
            # higher generation would make every step of the new run look late. (Each
            # batch names its run too: one that came first has moved its rank on.)
            for state in job.ranks.values():
                if state.run < status.run:
                    state.new_run(status.run)
            job.went_back(status.run, 0)
        job.status_ts = status.ts
        job.world_size = status.world_size
        job.generation = status.generation
        job.state = status.state
        job.step = status.step
        job.run = status.run
        job.excluded = excluded
        job.members = members
        job.local_ranks = {m.rank: m.local_rank for m in status.members}
        job.standbys = standbys
        for rank in gone:
            state = job.ranks.pop(rank)
            state.cols.give_back(state.col)
            self.total_ranks -= 1
        self._hold(job, held)
        self._reserve(job, len(members))  # last: the job is whole if it cannot

    def _reserve(self, job: JobView, ranks: int) -> None:
        """Columns for ``ranks`` of ``job`` made at once (``StepColumns.reserve``), as
        ``_room`` allows."""
        cols = job.cols
        if cols is not None and ranks > cols.capacity:
            cols.reserve(self._room(job, ranks))

    def _room(self, job: JobView, ranks: int) -> int:
        """``ranks`` columns for ``job`` if the columns of all jobs stay within
        ``max_ranks`` with them, else 0 (it grows as its ranks report, doubling): columns
        are not given back to memory, so a status that lists many members, then few,
        must not leave room behind that the next job's status adds to. All or none: a
        job made a little short of its members would double past them."""
        held = sum(j.cols.capacity for j in self.jobs.values() if j.cols is not None)
        mine = job.cols.capacity if job.cols is not None else 0
        return ranks if held - mine + ranks <= self.max_ranks else 0

    def apply_node_status(self, status: wire.NodeStatus, now: float, *, live: bool = True) -> None:
        """``live``: published now, not a retained copy replayed by the broker."""
        node = self._node(status.node, now, live=live)
        node.status_ts = status.ts
        if live:
            node.status_seen = now
            node.seq.clear()  # its agent (re)connected: what it sent meanwhile is its own
        node.state = status.state
        node.role = status.role
        if status.gpus:
            node.gpus = list(status.gpus)

    def apply_gpu(self, sample: wire.NodeGpu, now: float) -> str:
        """A node's GPU sample; which it was: ``full``, ``brief`` (it repeats the last
        full one held, ``sample``, which stays) or ``unresolved`` (a brief one whose
        full one never came here: a heartbeat only)."""
        sample.check()
        node = self._node(sample.node, now)
        if node.state != "online":
            node.state = "online"  # a sample proves the agent is alive
        if sample.reasons is None:
            node.sample, node.sample_seen = sample, now
            return "full"
        return "brief" if sample.repeats(node.sample) else "unresolved"

    def gap(self, node: str, topic: str, seq: int, ts: float, now: float) -> int | None:
        """How many messages ``node``'s agent sent on ``topic`` before the one numbered
        ``seq`` and sent at ``ts`` (its clock) never arrived (``tmd.wire``), as
        ``missing`` judges; None where the numbers make no sense (two agents under one
        name, or a forged number): that node's gaps are then not judged for
        ``DOUBT_S``, so no one agent keeps the whole view settling. Its first message
        makes the node (``limit`` past ``max_nodes``)."""
        view = self.nodes.get(node)
        if view is None:
            view = self._node(node, now)
        if now < view.seq_doubted_until:
            return 0
        if ts > now + MAX_AHEAD_S:
            ts = now + MAX_AHEAD_S
        seqs = view.seq
        last, last_ts = seqs.get(topic, _NO_SEQ)
        seqs[topic] = (seq, ts)
        if seq == last + 1:
            return 0  # the usual message
        lost = missing(last, last_ts, seq, ts)
        if lost is None:
            view.seq.clear()
            view.seq_doubted_until = now + DOUBT_S
        return lost

    def rank_gap(
        self, job: str, rank: int, run: int | None, generation: int, seq: int, ts: float,
        now: float,
    ) -> int | None:  # fmt: skip
        """As ``gap``, for what a rank published itself on its own topic, counted apart
        for each run and generation (a switch brings in another process, and the
        leaver's last batches may come after the joiner's first). A loss is its job's
        alone (``JobView.lost_at``): one rank's flaky link must not hold every other
        job's findings. 0 for a rank the view does not hold."""
        j = self.jobs.get(job)
        state = j.ranks.get(rank) if j is not None else None
        if j is None or state is None or now < state.seq_doubted_until:
            return 0
        if ts > now + MAX_AHEAD_S:
            ts = now + MAX_AHEAD_S
        last = state.seq
        state.seq = (seq, ts, run, generation)
        if last is None or last[2] != run or last[3] != generation or seq == last[0] + 1:
            return 0
        lost = missing(last[0], last[1], seq, ts)
        if lost is None:
            state.seq = None
            state.seq_doubted_until = now + DOUBT_S
        elif lost:
            j.lost_at = now
        return lost

    def restart_sequences(self) -> None:
        """This daemon (re)subscribed: what was sent while it was away is not a loss
        on the way to it. Each topic's count starts over from its next message, the
        agents' and the ranks'."""
        for view in self.nodes.values():
            view.seq.clear()
        for job in self.jobs.values():
            for state in job.ranks.values():
                state.seq = None

    def apply_xid(self, event: wire.XidEvent, now: float) -> None:
        self._node(event.node, now).xids.append(event)

    def _job(self, name: str, now: float, *, status: bool = False) -> JobView:
        job = self.jobs.get(name)
        if job is None:
            if len(self.jobs) >= self.max_jobs and not (status and self._make_room()):
                raise ProtocolError("limit", f"more than {self.max_jobs} jobs (ingest.max_jobs)")
            job = self.jobs[name] = JobView(name)
        job.last_seen = now
        return job

    def _hold(self, job: JobView, held: int) -> None:
        self.held_ranks += held - job.held
        job.held = held

    def _node(self, name: str, now: float, *, live: bool = True) -> NodeView:
        node = self.nodes.get(name)
        if node is None:
            if len(self.nodes) >= self.max_nodes:
                raise ProtocolError("limit", f"more than {self.max_nodes} nodes (ingest.max_nodes)")
            node = self.nodes[name] = NodeView(name)
        node.last_seen = now
        if live:
            node.live_seen = now
        return node

    # -- standbys: who may take a machine's place -----------------------------------------

    def note_fault(self, node: str, ts: float, *, lost: bool = False) -> None:
        """A GpuFault or NodeLost (``lost``) on ``node`` at ``ts`` (daemon time): no
        standby to move work onto until it proves itself again."""
        _note(self._lost if lost else self._faults, node, ts, self.max_nodes)

    def healthy(self, node: str, *, forget: bool = True) -> bool:
        """Neither ``gpu_faulty`` nor ``lost``."""
        return not self.gpu_faulty(node, forget=forget) and not self.lost(node, forget=forget)

    def gpu_faulty(self, node: str, *, forget: bool = True) -> bool:
        """A GpuFault on ``node`` since its agent last (re)started. Judged on the
        daemon's clock, as messages arrived: an agent's own clock (its messages' ts)
        may be anywhere. A fault the agent has since got over is forgotten, unless
        ``forget`` is False (a reader, such as ``/metrics``, that must change nothing)."""
        since = self._faults.get(node)
        if since is None:
            return False
        # A GPU fault keeps the node out until its agent restarts (a repaired node's
        # agent does) and publishes its status live after the fault.
        seen = self.nodes.get(node)
        if seen is None or seen.state != "online" or seen.status_seen <= since:
            return True
        if forget:
            del self._faults[node]
        return False

    def lost(self, node: str, *, forget: bool = True) -> bool:
        """Whether ``node`` is offline, or a NodeLost came and nothing from its agent
        since: its processes cannot be counted on to run, let alone to answer. A loss
        the agent has since disproved is forgotten, unless ``forget`` is False."""
        seen = self.nodes.get(node)
        if seen is not None and seen.state == "offline":
            return True
        since = self._lost.get(node)
        if since is None:
            return False
        # Anything the agent sent after the loss (a sample, an XID, its status) proves
        # the machine is up: the loss was a silence, not a death. Not a retained copy
        # the broker replays on a reconnect: a dead agent's last status is one.
        if seen is not None and seen.live_seen > since:
            if forget:
                del self._lost[node]
            return False
        return True

    def gpu_model(self, node: str) -> str:
        """The model of the node's first GPU, as its agent reported it ("" if not)."""
        seen = self.nodes.get(node)
        return seen.gpus[0].name if seen is not None and seen.gpus else ""

    def ready_standbys(
        self, job: str, *, leaver: str | None = None, forget: bool = True
    ) -> list[str]:
        """The job's standby machines that may take a machine's place now, by name:
        ready and not a member by the job's own status (``wire.ready_standbys``), their
        node not known to be offline and ``healthy``, and, given the ``leaver`` they
        would replace, with as many slots as it runs ranks of the job (when it runs any)
        and of its GPU model when both agents reported one (``same_gpu_model``).
        ``forget``: as ``healthy``'s (False: change nothing)."""
        j = self.jobs.get(job)
        if j is None:
            return []
        want = self.gpu_model(leaver) if leaver is not None and self.same_gpu_model else ""
        slots = j.slots(leaver) if leaver is not None else 0
        out = []
        ready = wire.ready_standbys(
            j.standbys.values(), set(j.members.values()), slots=slots or None
        )
        for name in ready:
            node = self.nodes.get(name)
            if node is not None and node.state == "offline":
                continue
            if not self.healthy(name, forget=forget):
                continue
            have = self.gpu_model(name)
            if want and have and want != have:
                continue
            out.append(name)
        return out

    # -- housekeeping and reading --------------------------------------------------------

    def _make_room(self) -> bool:
        """Drop a job known only from an ingest shard's report (no status, no rank
        here) for a job's status; False: none (a scan of the jobs, only when the view
        is full of them)."""
        for name, job in self.jobs.items():
            if job.shard is not None and not job.status_ts and not job.ranks:
                self._forgotten(self.jobs.pop(name))
                return True
        return False

    def note_shard(self, name: str, last_seen: float, ranks: int, step: int) -> None:
        """What the ingest shard that owns job ``name`` last said of it (``tmd.daemon
        .shards``): when it last heard of the job, its reporting ranks and their front
        step. A job known only from its ranks is known here so (as one is in-process,
        past ``max_jobs`` not)."""
        job = self.jobs.get(name)
        if job is None:
            if len(self.jobs) >= self.max_jobs:
                return
            job = self.jobs[name] = JobView(name)
        job.last_seen = max(job.last_seen, last_seen)
        job.shard = (ranks, step)

    def forget_job(self, name: str) -> bool:
        if self.on_forget_job is not None:
            self.on_forget_job(name)
        job = self.jobs.pop(name, None)
        if job is None:
            return False
        self._forgotten(job)
        return True

    def forget_silent(self, now: float, after_s: float) -> tuple[int, int]:
        """Drop jobs and nodes silent for ``after_s``; returns how many of each."""
        old_jobs = [j for j, v in self.jobs.items() if now - v.last_seen > after_s]
        for name in old_jobs:
            self._forgotten(self.jobs.pop(name))
        old_nodes = [n for n, v in self.nodes.items() if now - v.last_seen > after_s]
        for name in old_nodes:
            del self.nodes[name]
        return len(old_jobs), len(old_nodes)

    def _forgotten(self, job: JobView) -> None:
        self.total_ranks -= len(job.ranks)
        self.held_ranks -= job.held

    def total_steps(self) -> int:
        """Rank-steps taken, here and in the ingest shards."""
        here = sum(r.total_steps for j in self.jobs.values() for r in j.ranks.values())
        return here + self.elsewhere[1]

    def reporting_ranks(self) -> int:
        """Ranks reporting, here and in the ingest shards."""
        return self.total_ranks + self.elsewhere[0]

    def snapshot(self, now: float, *, job: str | None = None) -> dict[str, Any]:
        """A JSON-able picture for the API and ``tmd status``, without per-rank rows
        (``rank_rows`` gives those in chunks)."""
        jobs = [v for k, v in sorted(self.jobs.items()) if job is None or k == job]
        return {
            "ts": now,
            "jobs": [_job_json(j, now) for j in jobs],
            "nodes": [_node_json(n, now) for _, n in sorted(self.nodes.items())],
            "totals": {
                "jobs": len(self.jobs),
                "nodes": len(self.nodes),
                "ranks": self.reporting_ranks(),
            },
        }


def _held(ranks: int, job: JobView) -> int:
    """What a job of ``ranks`` reporting ranks holds against ``ingest.max_ranks``."""
    return max(ranks, len(job.members)) + len(job.standbys) + len(job.excluded)


def _too_many_ranks(bound: int) -> ProtocolError:
    return ProtocolError(
        "limit", f"more than {bound} ranks, members and standbys (ingest.max_ranks)"
    )


def _note(seen: dict[str, float], node: str, ts: float, bound: int) -> None:
    """Remember ``ts`` for ``node``, newest last, keeping at most ``bound`` nodes."""
    seen.pop(node, None)
    seen[node] = ts
    while len(seen) > bound:  # the oldest first
        del seen[next(iter(seen))]


def rank_rows(job: JobView, now: float, *, chunk: int = 1024) -> Iterator[list[dict[str, Any]]]:
    """The API's per-rank rows in chunks, so a caller can yield to the event loop
    between them (a 16k-rank job must not stall ingest)."""
    ordered = sorted(job.ranks)
    for start in range(0, len(ordered), chunk):
        # A rank may leave between chunks (the job's status shrank the world).
        states = (job.ranks.get(r) for r in ordered[start : start + chunk])
        yield [_rank_json(job, s, now) for s in states if s is not None]


def _rank_json(j: JobView, r: RankState, now: float) -> dict[str, Any]:
    return {
        "rank": r.rank,
        "node": j.members.get(r.rank, r.node),
        "last_step": r.last_step,
        "last_seen_s": round(now - r.last_seen, 3),
        "median_step_s": _median(r.recent("step_s", last=32)),
        "median_compute_s": _median(r.recent("compute_s", last=32)),
        "duplicates": r.duplicates,
        "late": r.late,
    }


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _job_json(j: JobView, now: float) -> dict[str, Any]:
    out: dict[str, Any] = {
        "job": j.job,
        "state": j.state,
        "world_size": j.world_size,
        "generation": j.generation,
        "step": max((r.last_step for r in j.ranks.values()), default=j.step),
        "reporting_ranks": len(j.ranks),
        # With ingest shards, its ranks are in one: as it last said (its rank rows, the
        # API asks it for).
        **({} if j.shard is None else {"reporting_ranks": j.shard[0], "step": j.shard[1]}),
        "standbys": [
            {"node": s.node, "state": s.state, "warmup_s": s.warmup_s, "slots": s.slots}
            for s in j.standbys.values()
        ],
        "last_seen_s": round(now - j.last_seen, 3),
    }
    return out


def _node_json(n: NodeView, now: float) -> dict[str, Any]:
    sample = n.sample
    return {
        "node": n.node,
        "state": n.state,
        "role": n.role,
        "gpus": len(n.gpus) or (len(sample.gpus) if sample else 0),
        "last_seen_s": round(now - n.last_seen, 3),
        "max_temp_c": max((g.temp_c for g in sample.gpus if g.temp_c is not None), default=None)
        if sample
        else None,
        # As of the last full sample (brief ones leave temperatures out).
        "sample_age_s": round(now - n.sample_seen, 3) if sample else None,
        "last_xid": (
            {"gpu": n.xids[-1].gpu, "xid": n.xids[-1].xid, "ts": n.xids[-1].ts} if n.xids else None
        ),
    }
