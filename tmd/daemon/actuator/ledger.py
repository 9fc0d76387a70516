"""The migrations the actuator drives, and their record.

Every transition is journaled before the command that follows it is sent, and before
the ledger's memory (the flight's phase, the flights in flight, what the guardrails
count) moves: a write that fails leaves the actuator as it was, to try again on the
next answer, status or timeout, and a daemon that stops between the two resumes from
the journal (``resume``). Each migration ends in exactly one ``MigrationFinished``:
the journal refuses to end one twice (``AlreadyFinished``), and only the first end is
counted and emitted. The ledger also keeps what the guardrails count (``GuardState``)
and who replaced whom.

A checkpoint restart the actuator asks for is kept the same way, as a row of its own
kind (``kind: restart`` in its detail, no joiner) that starts in state ``restarting``
and ends ``done`` (the job answered or restarted), ``aborted`` (it stopped, or the
machine left it) or ``failed`` (no answer); the ledger remembers, until the job's next
run, which machines a job was asked to restart without, answered or not: a restart
whose answer was lost must not be asked for a second time.

What the ledger remembers of jobs and machines is bounded: who replaced whom at most
``MAX_REPLACED`` machines, the oldest forgotten first, and both maps only for the jobs
the view still holds (``keep_only``, from the daemon's housekeeping).
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any, TypeVar

from tmd import wire
from tmd.daemon import events
from tmd.daemon.actuator.flight import Flight, Outcome, Phase, PhaseMachine, outcome_record
from tmd.daemon.actuator.guardrails import GuardState
from tmd.daemon.journal import Journal
from tmd.daemon.metrics import Metrics
from tmd.errors import AlreadyFinished

SOURCE = "actuator"
Emit = Callable[[events.Event, str], None]

MAX_REPLACED = 4096
"""Machines remembered as replaced (``Ledger.replaced``): what standby choice names as
``already replaced`` and membership tracking does not take for a runtime failover.
Both matter for the migrations of the last minutes, not of a long job's history."""

K = TypeVar("K")
V = TypeVar("V")


def remember(seen: dict[K, V], key: K, value: V, *, cap: int) -> None:
    """Set ``seen[key]``, newest last, keeping at most ``cap`` keys: the oldest go."""
    seen.pop(key, None)
    seen[key] = value
    while len(seen) > cap:
        del seen[next(iter(seen))]


class Ledger:
    def __init__(
        self,
        *,
        machine: PhaseMachine,
        journal: Journal,
        emit: Emit,
        metrics: Metrics | None,
        guard_state: GuardState,
        log: Any,
    ) -> None:
        self.machine = machine
        self.journal = journal
        self.emit = emit
        self.metrics = metrics
        self.guard_state = guard_state
        self.log = log
        self.flights: dict[str, Flight] = {}
        self.replaced: dict[tuple[str, str], str] = {}  # (job, node) -> who replaced it
        # (job, node) -> the restart that asked the job to go on without node, until the
        # job's next run
        self.restarts_asked: dict[tuple[str, str], str] = {}

    def replace(self, job: str, leaver: str, joiner: str) -> None:
        """Remember that ``joiner`` took ``leaver``'s place in ``job``."""
        remember(self.replaced, (job, leaver), joiner, cap=MAX_REPLACED)

    def keep_only(self, jobs: Container[str]) -> None:
        """Forget who replaced whom, and which restarts were asked, in jobs not in
        ``jobs``: the view forgot them, and one that comes back is decided about anew.
        Flights are kept: each ends on its own deadline."""
        self.replaced = {k: v for k, v in self.replaced.items() if k[0] in jobs}
        self.restarts_asked = {k: v for k, v in self.restarts_asked.items() if k[0] in jobs}

    def of_job(self, job: str) -> list[Flight]:
        return [f for f in self.flights.values() if f.job == job]

    def begin(self, flight: Flight, *, reason: str, now: float) -> bool:
        """Journal a new migration as ``planned`` (a restart as ``restarting``: nothing
        comes before its command); False if it was journaled already. Its detail names
        the policy that decided it, what a resumed migration is counted under."""
        policy = {"policy": flight.policy}
        if flight.is_restart:
            detail = {**self.machine.journaled(flight, "restarting"), **policy}
            return self.journal.begin_migration(
                id=flight.id, job=flight.job, leaver=flight.leaver, joiner="", reason=reason,
                ts=now, state="restarting", detail=detail,
            )  # fmt: skip
        return self.journal.begin_migration(
            id=flight.id, job=flight.job, leaver=flight.leaver, joiner=flight.joiner,
            reason=reason, ts=now, detail=policy,
        )  # fmt: skip

    def start(self, flight: Flight, started: float) -> None:
        """Drive ``flight``; the guardrails count it from ``started``."""
        if flight.is_restart:
            self.guard_state.restarting[flight.job] = flight.id
            self.guard_state.last_restart[(flight.job, flight.leaver)] = started
        else:
            if self.metrics is not None:
                self.metrics.migration_started(flight.policy)
            self.guard_state.record_start(
                events.Migrate(ts=started, policy=flight.policy, reason="", job=flight.job,
                               node=flight.leaver),
                started,
            )  # fmt: skip
        self.flights[flight.id] = flight
        self._count_in_flight()

    def _drop(self, flight: Flight) -> None:
        """Forget a flight that ended: the guardrails no longer count it."""
        self.flights.pop(flight.id, None)
        if flight.is_restart:
            if self.guard_state.restarting.get(flight.job) == flight.id:
                del self.guard_state.restarting[flight.job]
        else:
            self.guard_state.record_end(flight.job)
        self._count_in_flight()

    def _count_in_flight(self) -> None:
        if self.metrics is not None:
            migrating = sum(1 for f in self.flights.values() if not f.is_restart)
            self.metrics.migrations_in_flight.set(migrating)

    def enter(
        self,
        flight: Flight,
        phase: Phase,
        now: float,
        *,
        why: str = "",
        via: str = "",
        detail: dict[str, Any] | None = None,
    ) -> wire.Message:
        """Journal the new phase (after the state it passes ``via``, in one transaction),
        then move the flight to it and return its command to send. ``why``: an abort's
        reason, journaled and sent with it."""
        detail = {**self.machine.journaled(flight, phase), **(detail or {})}
        if why:
            detail["why"] = why
        with self.journal.atomic():
            if via:
                self.journal.set_migration_state(flight.id, via, ts=now)
            self.journal.set_migration_state(flight.id, phase, ts=now, detail=detail)
        if why:
            flight.abort_reason = why
        self.machine.set_phase(flight, phase, now)
        return self.machine.command(flight, now)

    def finish(self, flight: Flight, outcome: Outcome, now: float, *, detail: str = "") -> None:
        record, downtime = outcome_record(flight, outcome, detail)
        try:
            self.journal.set_migration_state(flight.id, outcome, ts=now, detail=record)
        except AlreadyFinished:
            self._drop(flight)
            return  # never report a migration twice
        self._drop(flight)
        if flight.is_restart:
            self._restart_finished(flight, outcome, now)
            return
        if outcome == "done":
            self.replace(flight.job, flight.leaver, flight.joiner)
        if self.metrics is not None:
            self.metrics.migrations.labels(outcome=outcome, policy=flight.policy).inc()
            if downtime is not None:
                # A switch cheaper than the step noise measures slightly below zero;
                # the event and the journal keep that, the histogram (whose _sum must
                # only grow) counts it as free.
                self.metrics.migration_downtime.observe(max(0.0, downtime))
        self.emit(
            events.MigrationFinished(
                ts=now, migration_id=flight.id, job=flight.job, node=flight.leaver,
                to=flight.joiner, outcome=outcome, downtime_s=downtime,
            ),
            SOURCE,
        )  # fmt: skip

    def _restart_finished(self, flight: Flight, outcome: Outcome, now: float) -> None:
        # Failed: nobody answered in time, yet the job may have heard it (the answer
        # was lost, or it checkpoints slowly) and be on its way out.
        if outcome in ("done", "failed"):
            self.restarts_asked[(flight.job, flight.leaver)] = flight.id
        if self.metrics is not None:
            self.metrics.restarts.labels(outcome=outcome).inc()
        self.emit(
            events.MigrationFinished(
                ts=now, migration_id=flight.id, job=flight.job, node=flight.leaver, to="",
                outcome=outcome,
            ),
            SOURCE,
        )  # fmt: skip

    def job_restarted(self, job: str) -> None:
        """A new run of ``job``: what it was asked to go on without is moot."""
        self.restarts_asked = {k: v for k, v in self.restarts_asked.items() if k[0] != job}
