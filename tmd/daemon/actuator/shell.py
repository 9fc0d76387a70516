"""The ``Actuator``: composes the phase machine, the ledger, membership tracking,
resume and standby choice, and the thin asyncio shell that runs them.

For each ``Migrate`` decision it picks the standby (``standby``), applies the
guardrails, journals the migration and drives it (``flight``); for each
``CheckpointRestart`` it asks the job to restart without the machine when that is
still needed (``restart``), journaled and driven the same way; it follows each job's
status (``membership``) and, after a restart, resumes what the journal holds in
flight (``resume``). All of that is synchronous and takes the time as an argument
(``on_event``, ``on_tick``, ``reconcile``), so it runs on an injected clock in tests
and the simulator; ``run`` is the thin asyncio shell that feeds it from the bus and
publishes what it returns.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import aiomqtt

from tmd import log, wire
from tmd.clock import Clock
from tmd.config import ActuatorConfig, GuardrailsConfig
from tmd.daemon import events
from tmd.daemon.actuator import guardrails, membership, restart, resume, standby
from tmd.daemon.actuator.flight import (
    REPLACED_BY_RUNTIME,
    Flight,
    Next,
    Outcome,
    PhaseMachine,
    machine_slots,
)
from tmd.daemon.actuator.ledger import SOURCE, Emit, Ledger
from tmd.daemon.bus import Bus
from tmd.daemon.journal import Journal
from tmd.daemon.metrics import Metrics
from tmd.daemon.view import ClusterView
from tmd.errors import JournalError, PublishError

Publish = Callable[[str, bytes], Awaitable[None]]

TICK_S = 0.5


MAX_DEFERRED = 4096
"""Decisions kept while the daemon's view is not current (one per job and machine)."""


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
        self.reconciled = asyncio.Event()
        """Set once ``run`` has subscribed and reconciled what the journal holds."""
        self.guard_state = guardrails.GuardState()
        self.view = view
        self.journal = journal
        self.emit = emit
        self.metrics = metrics
        self.log = log.get("actuator")
        self._ignored_logged: set[str] = set()
        # Decisions taken while the daemon's view was stale or settling, by (job, node):
        # none starts until the view is trusted again (``tmd.daemon.freshness``).
        self._deferred: dict[tuple[str, str], events.Migrate | events.CheckpointRestart] = {}
        self.machine = PhaseMachine(config)
        self.ledger = Ledger(
            machine=self.machine, journal=journal, emit=emit, metrics=metrics,
            guard_state=self.guard_state, log=self.log,
        )  # fmt: skip
        self.memberships = membership.Memberships(journal, cap=view.max_jobs)
        self.failover_acks = membership.FailoverAcks()

    @property
    def flights(self) -> dict[str, Flight]:
        """The migrations in flight, by id."""
        return self.ledger.flights

    # -- inputs ------------------------------------------------------------------------

    def on_event(self, event: object, now: float) -> list[wire.Message]:
        """Feed one bus event; returns the commands to publish, in order."""
        if isinstance(event, (events.Migrate, events.CheckpointRestart)) and (
            self.view.freshness.since(now) is None
        ):
            self._defer(event, now)
            return []
        if isinstance(event, events.Migrate):
            return self._on_migrate(event, now)
        if isinstance(event, events.CheckpointRestart):
            return self._on_checkpoint_restart(event, now)
        if isinstance(event, wire.Ack):
            return self._on_ack(event, now)
        if isinstance(event, wire.JobStatus):
            return self._on_status(event, now)
        return []

    def on_tick(self, now: float) -> list[wire.Message]:
        """Timeouts and resends; returns the commands to publish."""
        out: list[wire.Message] = []
        if self._deferred and self.view.freshness.since(now) is not None:
            deferred, self._deferred = self._deferred, {}
            self.log.info("the view is current again: deciding", decisions=len(deferred))
            for decision in deferred.values():
                try:
                    out += self.on_event(decision, now)
                except Exception as exc:  # one failure must not drop the others
                    self.log.error("a deferred decision failed", error=repr(exc),
                                   job=decision.job, node=decision.node)  # fmt: skip
                    self._drop_deferred(decision, f"it failed when run: {exc!r}", now)
        for flight in list(self.flights.values()):
            out += self._apply(
                flight, self.machine.on_tick(flight, now, self.view.jobs.get(flight.job)), now
            )
        return out

    def prune(self, now: float) -> None:
        """Forget what is kept of jobs the view no longer holds, and cooldowns and rate
        limits that ran out: what outside publishers name must not pile up. O(what is
        kept), so the daemon's housekeeping calls it, not every message."""
        jobs = self.view.jobs
        self.memberships.keep_only(jobs)
        self.failover_acks.keep_only(jobs)
        self.ledger.keep_only(jobs)
        self.guard_state.prune(now, cooldown_s=self.guard.node_cooldown_s)

    def reconcile(self, now: float) -> list[wire.Message]:
        """Resume what the journal holds in flight (once, after a restart)."""
        return resume.reconcile(
            self.ledger, self.view, now, lookback_s=max(3600.0, self.guard.node_cooldown_s)
        )

    # -- decisions ---------------------------------------------------------------------

    def _on_migrate(self, decision: events.Migrate, now: float) -> list[wire.Message]:
        choice = standby.choose(
            decision, view=self.view, flights=list(self.flights.values()),
            replaced=self.ledger.replaced,
        )  # fmt: skip
        candidates, why = choice.standbys, choice.held
        if why is None:
            why = guardrails.check(
                decision, config=self.guard, state=self.guard_state,
                ready_standbys=len(candidates), now=now,
            )  # fmt: skip
            if not self.config.enabled and why is None:
                why = "actuator.enabled is false"
            if why is not None and self.guard.dry_run and candidates:
                why += f" (would migrate {decision.node} to {candidates[0]})"
        if why is not None:
            self.emit(
                events.Hold(
                    ts=now, policy=SOURCE, job=decision.job, node=decision.node,
                    reason=f"{decision.policy}'s migration of {decision.node} not run: {why}",
                    held=decision.policy,
                ),
                SOURCE,
            )  # fmt: skip
            return []
        job = self.view.jobs[decision.job]
        flight = Flight(
            id=f"m{int(now)}-{secrets.token_hex(4)}",
            job=decision.job,
            leaver=decision.node,
            joiner=candidates[0],
            policy=decision.policy,
            reason=decision.reason,
            phase="preparing",
            generation=job.generation,
            members=frozenset(job.members.values()),
            deadline=now + self.config.prepare_timeout_s,
            slots=machine_slots(job.machines(), decision.node, candidates[0]),
        )
        # Planned and preparing, or neither: a planned row no flight drives would be
        # resumed at the next start, long after the decision.
        with self.journal.atomic():
            self.ledger.begin(flight, reason=f"{decision.policy}: {decision.reason}", now=now)
            prepare = self.ledger.enter(flight, "preparing", now)
        self.ledger.start(flight, now)
        self.log.info(
            "migration started", migration_id=flight.id, job=flight.job,
            leaver=flight.leaver, joiner=flight.joiner, policy=flight.policy,
        )  # fmt: skip
        return [prepare]

    def _on_checkpoint_restart(
        self, decision: events.CheckpointRestart, now: float
    ) -> list[wire.Message]:
        if restart.is_the_runtimes(decision):
            return []  # the runtime is rolling back by itself: nothing to ask
        why = restart.held(decision, view=self.view, asked=self.ledger.restarts_asked)
        if why is None:
            why = guardrails.check_restart(
                decision, config=self.guard, state=self.guard_state, now=now
            )
            if not self.config.enabled and why is None:
                why = "actuator.enabled is false"
            if why is not None and self.guard.dry_run:
                why += f" (would ask job {decision.job} to restart without {decision.node})"
        if why is not None:
            self.emit(
                events.Hold(
                    ts=now, policy=SOURCE, job=decision.job, node=decision.node,
                    reason=f"{decision.policy}'s checkpoint restart without {decision.node} "
                    f"not asked: {why}",
                    held=decision.policy,
                ),
                SOURCE,
            )  # fmt: skip
            return []
        flight = restart.flight(
            decision, view=self.view, now=now, timeout_s=self.machine.timeout_s("restarting")
        )
        self.ledger.begin(flight, reason=f"{decision.policy}: {decision.reason}", now=now)
        self.ledger.start(flight, now)
        self.log.warning(
            "asking for a checkpoint restart", migration_id=flight.id, job=flight.job,
            node=flight.leaver, policy=flight.policy,
        )  # fmt: skip
        return [self.machine.command(flight, now)]

    # -- the runtime's answers ---------------------------------------------------------

    def _on_ack(self, ack: wire.Ack, now: float) -> list[wire.Message]:
        flight = self.flights.get(ack.migration_id)
        if flight is None:
            runtime = [
                f for f in self.flights.values()
                if f.runtime_id == ack.migration_id and f.job == ack.job
            ]  # fmt: skip
            # Machines the runtime replaced in one generation share its failover id, and
            # its one answer (with the downtime) speaks for all of them.
            for flight in runtime:
                self._apply(flight, self.machine.on_ack(flight, ack, now), now)
            # One failover may have replaced a machine the runtime chose and one ours
            # named: the one answer speaks for both.
            if self._replaced_ours(ack, now) or runtime:
                return []
            if ack.job not in self.view.jobs:
                # No status of the job, so no failover of it to wait for: an answer for
                # another head's job, or made up, and not kept.
                return []
            if ack.migration_id.startswith("failover-") and self.failover_acks.hold(ack):
                self.emit(
                    events.CheckpointRestart(
                        ts=now, policy=membership.RUNTIME, job=ack.job, node=ack.node,
                        reason=f"the runtime could not replace a lost rank: {ack.detail}",
                    ),
                    SOURCE,
                )  # fmt: skip
            return []  # an answer to someone else's, or a finished, migration
        if ack.job != flight.job:
            return []
        if flight.members and ack.node not in flight.members | {flight.joiner}:
            # Only the job's machines and the joiner take part: an answer from anyone
            # else is forged or misdirected, and must not move the migration.
            self._ignore("ack_not_a_participant", f"{ack.node} answered {flight.id}")
            return []
        return self._apply(flight, self.machine.on_ack(flight, ack, now), now)

    def _replaced_ours(self, ack: wire.Ack, now: float) -> bool:
        """The runtime's failover of generation ``g`` (its ``switched`` answer for
        ``failover-g{g}``) put in a machine's place the joiner one of our migrations of
        that generation named: a failover policy's migration of a machine whose
        processes died, and which the runtime replaced first with the same ready
        standby. The job's status already showed the switch (``switched_by_status``);
        the stayers will never answer our migration id, so the runtime's one answer,
        with its downtime, ends it now rather than at ``switch_timeout_s``. The answer
        must be this failover's (``_answers``): the runtime's ids start over with every
        run of the job."""
        if ack.kind != "switched" or not ack.migration_id.startswith("failover-g"):
            return False
        ours = [f for f in self.ledger.of_job(ack.job) if _answers(ack, f)]
        for flight in ours:
            flight.keep(ack)
            self._apply(flight, Next("done", REPLACED_BY_RUNTIME), now)
        return bool(ours)

    def _defer(self, decision: events.Migrate | events.CheckpointRestart, now: float) -> None:
        """Keep ``decision`` (the latest per job and machine) until the view is trusted;
        past ``MAX_DEFERRED`` the oldest is dropped as a ``Hold``, so its policy may
        decide again."""
        key = (decision.job, decision.node)
        self._deferred.pop(key, None)
        self._deferred[key] = decision
        if len(self._deferred) > MAX_DEFERRED:
            dropped = self._deferred.pop(next(iter(self._deferred)))
            why = f"more than {MAX_DEFERRED} decisions deferred while the view was stale"
            self._drop_deferred(dropped, why, now)
        if len(self._deferred) == 1:
            state = self.view.freshness.state(now)
            self.log.warning("deferring decisions: the daemon's view is not current", view=state)

    def _drop_deferred(
        self, decision: events.Migrate | events.CheckpointRestart, why: str, now: float
    ) -> None:
        """A deferred decision that will not run: a ``Hold``, so its policy may decide
        again."""
        self.emit(
            events.Hold(ts=now, policy=SOURCE, job=decision.job, node=decision.node,
                        reason=f"{decision.policy}'s decision about {decision.node} "
                        f"dropped: {why}", held=decision.policy),
            SOURCE,
        )  # fmt: skip

    def _ignore(self, reason: str, what: str) -> None:
        """Count a message not acted on; logged once per reason."""
        if self.metrics is not None:
            self.metrics.actuator_ignored.labels(reason=reason).inc()
        if reason not in self._ignored_logged:
            self._ignored_logged.add(reason)
            self.log.warning("ignored a message", reason=reason, what=what)

    def _on_status(self, status: wire.JobStatus, now: float) -> list[wire.Message]:
        before = self.memberships.get(status.job)
        seen = membership.since(before, status) if before is not None else "next"
        if seen == "late":
            return []  # an older status delivered late
        if seen == "new run":
            self._job_restarted(status, now)
            before = None
        after = membership.of(status)
        nodes = set(after.members.values())
        ours = [f for f in self.ledger.of_job(status.job) if f.phase != "runtime"]
        for flight in ours:
            step = self.machine.on_status(flight, status.generation, nodes, state=status.state)
            self._apply(flight, step, now)
            early = self.failover_acks.claim(status.job, f"failover-g{flight.generation}")
            if early is not None and flight.id in self.flights:
                self._replaced_ours(early, now)
        for job, node in [k for k in self.ledger.restarts_asked if k[0] == status.job]:
            if node not in nodes:  # it left: a later run that has it again may be asked
                del self.ledger.restarts_asked[(job, node)]
        if before is not None:
            moved = membership.moved(
                status.job, before, after,
                switched_to={f.joiner for f in ours if f.switched_by_status},
                replaced=self.ledger.replaced,
            )  # fmt: skip
            for machine in moved:
                self._record_runtime_failover(status, machine, before.generation, now)
        # Last: until what the status showed is journaled, the next status shows it again.
        self.memberships.record(status, before, now=now)
        return []

    def _job_restarted(self, status: wire.JobStatus, now: float) -> None:
        """A new run of the job (``membership.since``): what was in flight in the old one
        is over, and its ids will be used again."""
        for flight in self.ledger.of_job(status.job):
            # A restart we asked for that the new run answers: it happened.
            done = flight.phase in ("runtime", "restarting")
            outcome: Outcome = "done" if done else "aborted"
            self.ledger.finish(flight, outcome, now, detail="the job restarted")
        self.failover_acks.forget(status.job)
        self.ledger.job_restarted(status.job)
        restarted = events.JobRestarted(
            ts=now, job=status.job, generation=status.generation, step=status.step,
            run=status.run,
        )  # fmt: skip
        self.emit(restarted, SOURCE)

    def _record_runtime_failover(
        self, status: wire.JobStatus, machine: membership.Moved, old_gen: int, now: float
    ) -> None:
        ranks, leaver, joiner = machine
        if any(
            (r.job, r.leaver, r.joiner) == (status.job, leaver, joiner)
            for r in self.journal.in_flight()
        ):
            return  # a migration of ours that switched while the daemon was down
        flight = membership.runtime_failover(
            status, ranks=ranks, leaver=leaver, joiner=joiner, generation=old_gen, now=now
        )
        detail = {"rank": ranks[0], "ranks": list(ranks), "runtime_id": flight.runtime_id}
        with self.journal.atomic():
            fresh = self.ledger.begin(flight, reason=flight.reason, now=now)
            if fresh:
                self.journal.set_migration_state(flight.id, "switching", ts=now, detail=detail)
        self.ledger.replace(status.job, leaver, joiner)
        if not fresh:
            return  # already journaled (a status seen again after a restart)
        self.ledger.start(flight, now)
        early = self.failover_acks.claim(status.job, flight.runtime_id)
        if early is not None:
            self._apply(flight, self.machine.on_ack(flight, early, now), now)

    # -- carrying out what the machine decided -----------------------------------------

    def _apply(self, flight: Flight, step: Next, now: float) -> list[wire.Message]:
        """Journal, send or emit what the phase machine decided for ``flight``."""
        action, detail = step
        if action == "resend":
            return [self.machine.command(flight, now)]
        if action == "abort":
            return self._abort(flight, detail, now)
        if action == "switch":
            return [self.ledger.enter(flight, "switching", now, via="prepared")]
        if action == "switched":
            self.ledger.replace(flight.job, flight.leaver, flight.joiner)
        elif action in ("done", "aborted", "failed"):
            self.ledger.finish(flight, action, now, detail=detail)
        return []

    def _abort(self, flight: Flight, why: str, now: float) -> list[wire.Message]:
        if flight.switched_by_status:
            return self._apply(flight, self.machine.if_switched(flight), now)
        out = [self.ledger.enter(flight, "aborting", now, why=why)]
        self.log.warning("aborting migration", migration_id=flight.id, job=flight.job, why=why)
        # Everyone may have aborted already.
        self._apply(flight, self.machine.if_aborted(flight), now)
        return out

    # -- the asyncio shell -------------------------------------------------------------

    async def run(
        self, *, bus: Bus, clock: Clock, publish: Publish, subscribed: asyncio.Event
    ) -> None:
        """Feed the machine from the bus and publish its commands, until cancelled.

        A command that cannot be published (broker down) is not queued: the next
        resend carries it, so a long outage does not build a backlog of stale ones."""
        kinds = (events.Migrate, events.CheckpointRestart, wire.Ack, wire.JobStatus)
        sub = bus.subscribe("actuator", kinds)
        try:
            await subscribed.wait()
            await asyncio.sleep(self.config.settle_s)
            await self._send(self._guarded(self.reconcile, clock.now(), "reconcile"), publish)
            self.reconciled.set()
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
        except JournalError as exc:
            # The journal is the record of truth: without it, act on nothing (what
            # was not journaled is retried by the resends and timeouts).
            self.log.error("journal write failed", error=str(exc), during=what)
        except Exception:  # a bug must not take the daemon down with it
            self.log.exception("actuator failed", during=what)
            if self.metrics is not None:
                self.metrics.actuator_errors.labels(during=what).inc()
        return []

    async def _send(self, commands: list[wire.Message], publish: Publish) -> None:
        for command in commands:
            job = getattr(command, "job", "")
            try:
                await publish(wire.job_topic(job, "ctl"), wire.encode(command))
            except (PublishError, aiomqtt.MqttError, TimeoutError) as exc:
                self.log.warning(
                    "command not sent; it is sent again", error=str(exc),
                    migration_id=getattr(command, "migration_id", ""),
                )  # fmt: skip


def _answers(ack: wire.Ack, flight: Flight) -> bool:
    """Is ``ack`` the runtime's answer about a failover that did what ``flight`` meant
    to do? Its id names the flight's generation, a stayer answers from the next one,
    and its detail (``runtime/failover.py``'s ``Recovery.describe``), when it has one,
    names the flight's leaver replaced by its joiner."""
    detail = ack.detail
    return (
        flight.switched_by_status
        and ack.migration_id == f"failover-g{flight.generation}"
        and ack.generation in (None, flight.generation + 1)
        and ack.node in flight.members - {flight.leaver}
        and (not detail or f"{flight.leaver} replaced by {flight.joiner}" in detail)
    )
