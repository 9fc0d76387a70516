"""The actuator: turns ``Migrate`` decisions into live migrations of running jobs.

For each decision it applies the guardrails, picks the standby (ready in the job's
own status, its node not known to be offline, the same GPU model as the leaver when
both agents reported one), journals the migration, and drives the runtime's protocol
over MQTT (QoS 1, ``tmd/v1/job/{job}/ctl``):

    planned -> preparing  Prepare sent; every member answers ``prepared`` (its next
                          group, the joiner included, is built)
            -> switching  Switch sent; the stayers and the joiner answer ``switched``,
                          each with the downtime it measured
            -> done       MigrationFinished(outcome="done", downtime_s=...)

A ``failed`` answer, or a phase that outlives its timeout, sends ``Abort`` (state
``aborting``); the members' ``aborted`` answers end it as ``aborted``. While it waits
the actuator sends the current command again every ``actuator.resend_s``, with the
same migration id: the runtime acts on a command once and answers a repeat with
where it stands, so a lost message or a restarted daemon costs a retry, never a
second migration. The job's retained status is the other source of truth: a
generation that put the joiner in the leaver's place means the switch happened, even
if the acks were lost.

Every transition is journaled before the command that follows it is sent. After a
restart the actuator waits ``actuator.settle_s`` for the retained statuses, then
resumes each migration the journal still holds in flight from the phase it reached
(``Journal.in_flight``), so a migration is neither lost nor repeated, and each ends
in exactly one ``MigrationFinished``.

The runtime also replaces a dead rank by itself (``tmd.runtime.failover``), faster
than any daemon could react. The actuator notices that from the job's status (a new
generation with a different node at a rank, without a migration of its own) and
journals it as a finished migration, so policies, guardrails and ``tmd events`` see
it like any other.

The state machine is synchronous and takes the time as an argument (``on_event``,
``on_tick``), so it runs on an injected clock in tests and the simulator; ``run`` is
the thin asyncio shell that feeds it from the bus and publishes what it returns.
"""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
import statistics
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiomqtt

from tmd import log, wire
from tmd.clock import Clock
from tmd.config import ActuatorConfig, GuardrailsConfig
from tmd.daemon import events
from tmd.daemon.actuator import guardrails
from tmd.daemon.bus import Bus
from tmd.daemon.journal import TERMINAL_STATES, Journal, MigrationRow
from tmd.daemon.metrics import Metrics
from tmd.daemon.view import ClusterView

Phase = Literal["preparing", "switching", "aborting", "runtime"]
Outcome = Literal["done", "aborted", "failed"]
Publish = Callable[[str, bytes], Awaitable[None]]
Emit = Callable[[events.Event, str], None]

SOURCE = "actuator"
TICK_S = 0.5
MAX_EARLY_ACKS = 1024
RUNTIME_ACK_GRACE_S = 10.0
"""How long a failover the runtime did by itself waits for its donor's ``switched``
ack (which carries the downtime) before it is journaled without one."""


@dataclass
class Flight:
    """One migration the actuator is driving (or, phase ``runtime``, recording)."""

    id: str
    job: str
    leaver: str
    joiner: str
    policy: str
    reason: str
    phase: Phase
    generation: int  # the job's generation when the migration started
    members: frozenset[str]  # the job's nodes when it started
    deadline: float
    next_send: float = 0.0
    abort_reason: str = ""
    acks: dict[tuple[str, str], wire.Ack] = field(default_factory=dict)  # (kind, node)
    switched_by_status: bool = False
    runtime_id: str = ""  # the runtime's own id of a failover it did by itself

    def acked(self, kind: str) -> set[str]:
        return {node for k, node in self.acks if k == kind}


class Actuator:
    def __init__(
        self,
        *,
        config: ActuatorConfig,
        guard: GuardrailsConfig,
        view: ClusterView,
        journal: Journal,
        emit: Emit,
        metrics: Metrics | None = None,
    ) -> None:
        self.config = config
        self.guard = guard
        self.guard_state = guardrails.GuardState()
        self.view = view
        self.journal = journal
        self.emit = emit
        self.metrics = metrics
        self.log = log.get("actuator")
        self.flights: dict[str, Flight] = {}
        # The membership the actuator last saw per job, kept in the journal so that a
        # restarted daemon sees what changed while it was down:
        # job -> (generation, step, status ts, rank -> node).
        self._seen: dict[str, tuple[int, int, float, dict[int, str]]] = journal.memberships()
        self._rollbacks: set[tuple[str, str]] = set()  # (job, failover id) journaled
        # Failover acks of the runtime that arrived before the status that explains them.
        self._early: dict[tuple[str, str], wire.Ack] = {}
        self._replaced: dict[tuple[str, str], str] = {}  # (job, node) -> who replaced it
        self._unhealthy: dict[str, float] = {}  # node -> when a GpuFault or NodeLost came

    # -- inputs ------------------------------------------------------------------------

    def on_event(self, event: object, now: float) -> list[wire.Message]:
        """Feed one bus event; returns the commands to publish, in order."""
        if isinstance(event, events.Migrate):
            return self._on_migrate(event, now)
        if isinstance(event, wire.Ack):
            return self._on_ack(event, now)
        if isinstance(event, wire.JobStatus):
            return self._on_status(event, now)
        if isinstance(event, (events.GpuFault, events.NodeLost)):
            # Not a standby to move work onto, until it proves itself again.
            self._unhealthy[event.node] = now
        return []

    def on_tick(self, now: float) -> list[wire.Message]:
        """Timeouts and resends; returns the commands to publish."""
        out: list[wire.Message] = []
        for flight in list(self.flights.values()):
            if flight.phase == "runtime":
                if now >= flight.deadline:
                    self._finish(flight, "done", now, detail="replaced by the runtime's failover")
                continue
            if now >= flight.deadline:
                out += self._on_timeout(flight, now)
            elif now >= flight.next_send:
                out.append(self._command(flight, now))
        return out

    def reconcile(self, now: float) -> list[wire.Message]:
        """Resume what the journal holds in flight (once, after a restart)."""
        out: list[wire.Message] = []
        for row in self.journal.recent_migrations(now - 3600):
            if row.state not in TERMINAL_STATES:
                continue  # counted again when it is resumed below
            self.guard_state.started.append(row.created_ts)
            self.guard_state.last_on_node[row.leaver] = row.created_ts
        for row in self.journal.in_flight():
            if row.id in self.flights:
                continue
            out += self._resume(row, now)
        self.guard_state.started = deque(sorted(self.guard_state.started))
        return out

    # -- decisions ---------------------------------------------------------------------

    def _on_migrate(self, decision: events.Migrate, now: float) -> list[wire.Message]:
        job = self.view.jobs.get(decision.job)
        members = set(job.members.values()) if job is not None else set()

        def hold(why: str) -> list[wire.Message]:
            self.emit(
                events.Hold(
                    ts=now, policy=SOURCE, job=decision.job, node=decision.node,
                    reason=f"{decision.policy}'s migration of {decision.node} not run: {why}",
                    held=decision.policy,
                ),
                SOURCE,
            )  # fmt: skip
            return []

        if job is None or not members:
            return hold(f"job {decision.job} has not reported its status")
        busy = [f for f in self.flights.values() if f.job == decision.job]
        if any(f.leaver == decision.node for f in busy):
            return hold("it is already being migrated")
        if decision.node not in members:
            by = self._replaced.get((decision.job, decision.node))
            if by:
                return hold(f"already replaced by {by}")
            return hold(f"{decision.node} is not a member of job {decision.job}")
        taken = {f.joiner for f in self.flights.values()}
        candidates = [s for s in self._standbys(decision.job, decision.node) if s not in taken]
        if decision.to is not None:
            if decision.to not in candidates:
                return hold(f"standby {decision.to} is not ready for job {decision.job}")
            candidates = [decision.to]
        why = guardrails.check(
            decision, config=self.guard, state=self.guard_state,
            ready_standbys=len(candidates), now=now,
        )  # fmt: skip
        if not self.config.enabled and why is None:
            why = "actuator.enabled is false"
        if why is not None:
            if self.guard.dry_run and candidates:
                why += f" (would migrate {decision.node} to {candidates[0]})"
            return hold(why)
        flight = Flight(
            id=f"m{int(now)}-{secrets.token_hex(4)}",
            job=decision.job,
            leaver=decision.node,
            joiner=candidates[0],
            policy=decision.policy,
            reason=decision.reason,
            phase="preparing",
            generation=job.generation,
            members=frozenset(members),
            deadline=now + self.config.prepare_timeout_s,
        )
        self.journal.begin_migration(
            id=flight.id, job=flight.job, leaver=flight.leaver, joiner=flight.joiner,
            reason=f"{decision.policy}: {decision.reason}", ts=now,
        )  # fmt: skip
        self._start(flight, now)
        self.log.info(
            "migration started", migration_id=flight.id, job=flight.job,
            leaver=flight.leaver, joiner=flight.joiner, policy=flight.policy,
        )  # fmt: skip
        return [self._enter(flight, "preparing", now)]

    def _standbys(self, job_name: str, leaver: str) -> list[str]:
        """Ready standbys of the job that may take ``leaver``'s place, best first."""
        job = self.view.jobs[job_name]
        members = set(job.members.values())
        want = self._gpu_model(leaver) if self.config.same_gpu_type else None
        out = []
        for name, info in sorted(job.standbys.items()):
            node = self.view.nodes.get(name)
            if info.state != "ready" or name in members:
                continue
            if node is not None and node.state == "offline":
                continue
            if not self._healthy(name, node):
                continue
            have = self._gpu_model(name)
            if want and have and want != have:
                continue
            out.append((info.warmup_s if info.warmup_s is not None else float("inf"), name))
        return [name for _, name in sorted(out)]

    def _healthy(self, name: str, node: Any) -> bool:
        since = self._unhealthy.get(name)
        if since is None:
            return True
        # A lost node is back once its agent reported after the loss; a GPU fault
        # keeps the node out until its agent restarts (a repaired node's agent does).
        if node is not None and node.state == "online" and node.status_ts > since:
            del self._unhealthy[name]
            return True
        return False

    def _gpu_model(self, node: str) -> str:
        seen = self.view.nodes.get(node)
        return seen.gpus[0].name if seen is not None and seen.gpus else ""

    # -- the runtime's answers ---------------------------------------------------------

    def _on_ack(self, ack: wire.Ack, now: float) -> list[wire.Message]:
        flight = self.flights.get(ack.migration_id)
        if flight is None:
            runtime = [
                f for f in self.flights.values()
                if f.runtime_id == ack.migration_id and f.job == ack.job
            ]  # fmt: skip
            if runtime:
                return self._on_runtime_ack(runtime[0], ack, now)
            if ack.migration_id.startswith("failover-"):
                self._early[(ack.job, ack.migration_id)] = ack
                while len(self._early) > MAX_EARLY_ACKS:  # acks nobody will claim
                    del self._early[next(iter(self._early))]
                key = (ack.job, ack.migration_id)
                if ack.kind == "failed" and key not in self._rollbacks:  # one per survivor
                    self._rollbacks.add(key)
                    self.emit(
                        events.CheckpointRestart(
                            ts=now, policy="runtime", job=ack.job, node=ack.node,
                            reason=f"the runtime could not replace a lost rank: {ack.detail}",
                        ),
                        SOURCE,
                    )  # fmt: skip
            return []  # an answer to someone else's, or a finished, migration
        if ack.job != flight.job:
            return []
        _keep(flight, ack)
        if ack.kind == "failed" and flight.phase in ("preparing", "switching"):
            return self._abort(flight, f"{ack.node} failed: {ack.detail}", now)
        if ack.kind == "aborted":
            if flight.phase != "aborting":
                # A member aborted on its own (the joiner died, a member failed): the
                # migration is over for everyone, since the vote is collective.
                flight.abort_reason = flight.abort_reason or f"{ack.node}: {ack.detail}"
                self._set_phase(flight, "aborting", now)
            return self._check_aborted(flight, now)
        # A member is prepared once its next group is built, which takes the joiner:
        # the members' acks imply the joiner's (which a resumed migration may never
        # get again: a prepared joiner waits for its state, not for commands).
        if (
            ack.kind == "prepared"
            and flight.phase == "preparing"
            and flight.members <= flight.acked("prepared")
        ):
            self.journal.set_migration_state(flight.id, "prepared", ts=now)
            return [self._enter(flight, "switching", now)]
        if ack.kind == "switched":
            # The prepared acks were lost, or the switch beat an abort sent on a
            # timeout (the runtime answers that abort with "already switched"):
            # either way the switch is what happened.
            if flight.phase != "switching":
                self._set_phase(flight, "switching", now)
            return self._check_switched(flight, now)
        return []

    def _check_switched(self, flight: Flight, now: float) -> list[wire.Message]:
        if flight.phase != "switching":
            return []
        needed = (flight.members - {flight.leaver}) | {flight.joiner}
        if needed <= flight.acked("switched"):
            self._finish(flight, "done", now)
        return []

    def _check_aborted(self, flight: Flight, now: float) -> list[wire.Message]:
        # A member that refused the prepare ("failed") never joined the migration.
        if flight.members <= flight.acked("aborted") | flight.acked("failed"):
            self._finish(flight, "aborted", now, detail=flight.abort_reason)
        return []

    def _on_status(self, status: wire.JobStatus, now: float) -> list[wire.Message]:
        members = {m.rank: m.node for m in status.members}
        before = self._seen.get(status.job)
        if before is not None and (status.generation, status.step) < before[:2]:
            if status.ts <= before[2]:
                return []  # an older status delivered late
            # A new run of the job: restarted from its checkpoint, its generation
            # starts over at 0 and its step goes back to the checkpoint's.
            self._job_restarted(status, now)
            before = None
        seen = (status.generation, status.step, status.ts, members)
        self._seen[status.job] = seen
        if before is None or seen[0] != before[0] or seen[3] != before[3]:
            self.journal.save_membership(
                status.job, generation=status.generation, step=status.step, ts=status.ts,
                members=members,
            )  # fmt: skip
        nodes = set(members.values())
        ours = [f for f in self.flights.values() if f.job == status.job and f.phase != "runtime"]
        for flight in ours:
            if status.generation <= flight.generation:
                continue
            if flight.joiner in nodes and flight.leaver not in nodes:
                flight.switched_by_status = True
                self._replaced[(flight.job, flight.leaver)] = flight.joiner
            elif flight.phase != "aborting":
                # The membership changed under this migration (the runtime replaced a
                # dead rank, which ends any planned migration): it cannot go on.
                self._finish(flight, "aborted", now, detail="the job's membership changed")
        if before is None or status.generation <= before[0]:
            return []
        ours_done = {f.joiner for f in ours if f.switched_by_status}
        for rank, node in sorted(members.items()):
            old = before[3].get(rank)
            if old is None or old == node or node in ours_done:
                continue
            if self._replaced.get((status.job, old)) == node:
                continue  # a migration of ours whose acks came before this status
            self._record_runtime_failover(status, rank, old, node, before[0], now)
        return []

    def _job_restarted(self, status: wire.JobStatus, now: float) -> None:
        """A new run of the job (a checkpoint restart starts over at generation 0): what
        was in flight in the old one is over, and its ids will be used again."""
        for flight in [f for f in self.flights.values() if f.job == status.job]:
            outcome: Outcome = "done" if flight.phase == "runtime" else "aborted"
            self._finish(flight, outcome, now, detail="the job restarted")
        self._early = {k: v for k, v in self._early.items() if k[0] != status.job}
        self._rollbacks = {k for k in self._rollbacks if k[0] != status.job}

    def _record_runtime_failover(
        self, status: wire.JobStatus, rank: int, leaver: str, joiner: str, old_gen: int, now: float
    ) -> None:
        if any(
            (r.job, r.leaver, r.joiner) == (status.job, leaver, joiner)
            for r in self.journal.in_flight()
        ):
            return  # a migration of ours that switched while the daemon was down
        runtime_id = f"failover-g{old_gen}"
        flight = Flight(
            # The status's time tells apart runs of a job that restarted (the runtime's
            # generations, and so its failover ids, start over) and is the same when a
            # retained status is delivered again.
            id=f"{status.job}.{runtime_id}.r{rank}.t{int(status.ts)}"[-128:],
            job=status.job, leaver=leaver, joiner=joiner, policy="runtime",
            reason=f"the runtime replaced lost rank {rank} ({leaver}) with {joiner}",
            phase="runtime", generation=old_gen, members=frozenset(), runtime_id=runtime_id,
            deadline=now + RUNTIME_ACK_GRACE_S,
        )  # fmt: skip
        self._replaced[(status.job, leaver)] = joiner
        if not self.journal.begin_migration(
            id=flight.id, job=flight.job, leaver=leaver, joiner=joiner,
            reason=flight.reason, ts=now,
        ):  # fmt: skip
            return  # already journaled (a status seen again after a restart)
        self._start(flight, now)
        self.journal.set_migration_state(
            flight.id, "switching", ts=now, detail={"rank": rank, "runtime_id": runtime_id}
        )
        early = self._early.pop((status.job, runtime_id), None)
        if early is not None:
            self._on_runtime_ack(flight, early, now)

    def _on_runtime_ack(self, flight: Flight, ack: wire.Ack, now: float) -> list[wire.Message]:
        _keep(flight, ack)
        if ack.kind == "switched":
            self._finish(flight, "done", now, detail="replaced by the runtime's failover")
        return []

    # -- timeouts, abort, resume -------------------------------------------------------

    def _on_timeout(self, flight: Flight, now: float) -> list[wire.Message]:
        if flight.switched_by_status:
            self._finish(flight, "done", now, detail="switched (by the job's status); acks missing")
            return []
        if flight.phase == "aborting":
            job = self.view.jobs.get(flight.job)
            back = job is not None and flight.leaver in job.members.values()
            if back and job is not None and job.state == "running":
                self._finish(flight, "aborted", now, detail=flight.abort_reason)
            else:
                self._finish(flight, "failed", now, detail="no confirmation of the abort")
            return []
        waited = "prepared" if flight.phase == "preparing" else "switched"
        have = flight.acked(waited)
        want = set(flight.members)
        if flight.phase == "switching":
            want = (want - {flight.leaver}) | {flight.joiner}
        missing = ", ".join(sorted(want - have)) or "none"
        return self._abort(flight, f"timed out waiting for {waited} from {missing}", now)

    def _abort(self, flight: Flight, why: str, now: float) -> list[wire.Message]:
        if flight.switched_by_status:
            return self._check_switched(flight, now)
        flight.abort_reason = why
        self.log.warning("aborting migration", migration_id=flight.id, job=flight.job, why=why)
        out = [self._enter(flight, "aborting", now, detail={"why": why})]
        self._check_aborted(flight, now)  # everyone may have aborted already
        return out

    def _resume(self, row: MigrationRow, now: float) -> list[wire.Message]:
        if row.detail.get("runtime_id"):  # a failover the runtime did, awaiting its ack
            self._restore(row, "runtime", now)
            return []
        job = self.view.jobs.get(row.job)
        nodes = set(job.members.values()) if job is not None else set()
        if row.joiner in nodes and row.leaver not in nodes:
            self._restore(row, "switching", now)
            self._finish(
                self.flights[row.id], "done", now, detail="switched while the daemon was down"
            )
            return []
        phase: Phase = "preparing"
        if row.state in ("prepared", "switching"):
            phase = "switching"
        elif row.state == "aborting":
            phase = "aborting"
        flight = self._restore(row, phase, now)
        flight.abort_reason = str(row.detail.get("why", ""))
        self.log.info("resuming migration", migration_id=row.id, state=row.state, phase=phase)
        if row.state == "planned":  # stopped before its prepare was journaled (or sent)
            return [self._enter(flight, "preparing", now, detail={"resumed": True})]
        self.journal.set_migration_state(row.id, row.state, ts=now, detail={"resumed": True})
        return [self._command(flight, now)]

    def _restore(self, row: MigrationRow, phase: Phase, now: float) -> Flight:
        job = self.view.jobs.get(row.job)
        if "members" in row.detail:  # as journaled when it started
            members = frozenset(str(m) for m in row.detail["members"])
        else:
            members = frozenset(job.members.values()) if job is not None else frozenset()
            if row.joiner in members:  # it switched: the members before it had the leaver
                members = (members - {row.joiner}) | {row.leaver}
        flight = Flight(
            id=row.id, job=row.job, leaver=row.leaver, joiner=row.joiner,
            policy=row.reason.partition(":")[0], reason=row.reason, phase=phase,
            generation=int(row.detail.get("generation", job.generation if job else 0)),
            members=members, deadline=now + self._timeout(phase),
            runtime_id=str(row.detail.get("runtime_id", "")),
        )  # fmt: skip
        self._start(flight, row.created_ts)  # cooldowns and rate limits count from then
        return flight

    # -- bookkeeping -------------------------------------------------------------------

    def _start(self, flight: Flight, started: float) -> None:
        self.guard_state.record_start(
            events.Migrate(ts=started, policy=flight.policy, reason="", job=flight.job,
                           node=flight.leaver),
            started,
        )  # fmt: skip
        self._track(flight)

    def _track(self, flight: Flight) -> None:
        self.flights[flight.id] = flight
        if self.metrics is not None:
            self.metrics.migrations_in_flight.set(len(self.flights))

    def _timeout(self, phase: Phase) -> float:
        c = self.config
        return {
            "preparing": c.prepare_timeout_s,
            "switching": c.switch_timeout_s,
            "aborting": c.abort_timeout_s,
            "runtime": RUNTIME_ACK_GRACE_S,
        }[phase]

    def _set_phase(self, flight: Flight, phase: Phase, now: float) -> None:
        flight.phase = phase
        flight.deadline = now + self._timeout(phase)

    def _enter(
        self, flight: Flight, phase: Phase, now: float, *, detail: dict[str, Any] | None = None
    ) -> wire.Message:
        """Journal the new phase first, then return its command to send."""
        self._set_phase(flight, phase, now)
        extra: dict[str, Any] = {}
        if phase == "preparing":  # what a resumed migration checks its acks against
            extra = {"generation": flight.generation, "members": sorted(flight.members)}
        detail = {**extra, **(detail or {})}
        self.journal.set_migration_state(flight.id, phase, ts=now, detail=detail)
        return self._command(flight, now)

    def _command(self, flight: Flight, now: float) -> wire.Message:
        flight.next_send = now + self.config.resend_s
        if flight.phase == "preparing":
            return wire.Prepare(
                ts=now, job=flight.job, migration_id=flight.id, leaver=flight.leaver,
                joiner=flight.joiner, deadline_s=self.config.prepare_timeout_s,
            )  # fmt: skip
        if flight.phase == "switching":
            return wire.Switch(ts=now, job=flight.job, migration_id=flight.id)
        return wire.Abort(
            ts=now, job=flight.job, migration_id=flight.id, reason=flight.abort_reason[:1000]
        )

    def _finish(self, flight: Flight, outcome: Outcome, now: float, *, detail: str = "") -> None:
        downtimes = {
            node: ack.downtime
            for (kind, node), ack in flight.acks.items()
            if kind == "switched" and ack.downtime is not None and node != flight.leaver
        }
        downtime = max((d.total_s for d in downtimes.values()), default=None)
        record: dict[str, Any] = {"outcome": outcome}
        if detail:
            record["detail"] = detail
        if downtime is not None:
            median = statistics.median(d.total_s for d in downtimes.values())
            worst = max(downtimes.values(), key=lambda d: d.total_s)
            record.update(
                downtime_s=downtime, downtime_median_s=median,
                breakdown={"stop_s": worst.stop_s, "transfer_s": worst.transfer_s,
                           "switch_s": worst.switch_s, "first_step_s": worst.first_step_s},
            )  # fmt: skip
        self.flights.pop(flight.id, None)
        self.guard_state.record_end(flight.job)
        try:
            self.journal.set_migration_state(flight.id, outcome, ts=now, detail=record)
        except ValueError:
            return  # already finished: never report a migration twice
        if outcome == "done":
            self._replaced[(flight.job, flight.leaver)] = flight.joiner
        if self.metrics is not None:
            self.metrics.migrations.labels(outcome=outcome).inc()
            self.metrics.migrations_in_flight.set(len(self.flights))
            if downtime is not None:
                self.metrics.migration_downtime.observe(downtime)
        self.emit(
            events.MigrationFinished(
                ts=now, migration_id=flight.id, job=flight.job, node=flight.leaver,
                to=flight.joiner, outcome=outcome, downtime_s=downtime,
            ),
            SOURCE,
        )  # fmt: skip

    # -- the asyncio shell -------------------------------------------------------------

    async def run(
        self, *, bus: Bus, clock: Clock, publish: Publish, subscribed: asyncio.Event
    ) -> None:
        """Feed the machine from the bus and publish its commands, until cancelled.

        A command that cannot be published (broker down) is not queued: the next
        resend carries it, so a long outage does not build a backlog of stale ones."""
        sub = bus.subscribe(
            "actuator",
            (events.Migrate, events.GpuFault, events.NodeLost, wire.Ack, wire.JobStatus),
        )
        try:
            await subscribed.wait()
            await asyncio.sleep(self.config.settle_s)
            await self._send(self._guarded(self.reconcile, clock.now(), "reconcile"), publish)
            while True:
                batch = await sub.batch(TICK_S)
                out: list[wire.Message] = []
                for event in batch:
                    out += self._guarded(self.on_event, event, clock.now(), type(event).__name__)
                out += self._guarded(self.on_tick, clock.now(), "tick")
                await self._send(out, publish)
        finally:
            bus.unsubscribe(sub)

    def _guarded(self, step: Callable[..., list[wire.Message]], *args: Any) -> list[wire.Message]:
        *call, what = args
        try:
            return step(*call)
        except sqlite3.Error as exc:
            # The journal is the record of truth: without it, act on nothing (what
            # was not journaled is retried by the resends and timeouts).
            self.log.error("journal write failed", error=str(exc), during=what)
        except Exception:  # a bug must not take the daemon down with it
            self.log.exception("actuator failed", during=what)
        return []

    async def _send(self, commands: list[wire.Message], publish: Publish) -> None:
        for command in commands:
            job = getattr(command, "job", "")
            try:
                await publish(wire.job_topic(job, "ctl"), wire.encode(command))
            except (aiomqtt.MqttError, TimeoutError) as exc:
                self.log.warning(
                    "command not sent; it is sent again", error=str(exc),
                    migration_id=getattr(command, "migration_id", ""),
                )  # fmt: skip


def _keep(flight: Flight, ack: wire.Ack) -> None:
    """Record a member's answer; a repeat that carries the downtime replaces one that
    did not (the first answer may have been lost, or come from a resend)."""
    key = (ack.kind, ack.node)
    held = flight.acks.get(key)
    if held is None or (held.downtime is None and ack.downtime is not None):
        flight.acks[key] = ack
