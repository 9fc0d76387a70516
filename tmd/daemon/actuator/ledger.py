"""The migrations the actuator drives, and their record.

Every transition is journaled before the command that follows it is sent, and each
migration ends in exactly one ``MigrationFinished``: the journal refuses to end one
twice (``AlreadyFinished``), and only the first end is counted and emitted. The
ledger also keeps what the guardrails count (``GuardState``) and who replaced whom.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tmd import wire
from tmd.daemon import events
from tmd.daemon.actuator.flight import Flight, Outcome, Phase, PhaseMachine, outcome_record
from tmd.daemon.actuator.guardrails import GuardState
from tmd.daemon.journal import Journal
from tmd.daemon.metrics import Metrics
from tmd.errors import AlreadyFinished

SOURCE = "actuator"
Emit = Callable[[events.Event, str], None]


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

    def of_job(self, job: str) -> list[Flight]:
        return [f for f in self.flights.values() if f.job == job]

    def begin(self, flight: Flight, *, reason: str, now: float) -> bool:
        """Journal a new migration as ``planned``; False if it was journaled already."""
        return self.journal.begin_migration(
            id=flight.id, job=flight.job, leaver=flight.leaver, joiner=flight.joiner,
            reason=reason, ts=now,
        )  # fmt: skip

    def start(self, flight: Flight, started: float) -> None:
        """Drive ``flight``; the guardrails count it from ``started``."""
        self.guard_state.record_start(
            events.Migrate(ts=started, policy=flight.policy, reason="", job=flight.job,
                           node=flight.leaver),
            started,
        )  # fmt: skip
        self.flights[flight.id] = flight
        if self.metrics is not None:
            self.metrics.migrations_in_flight.set(len(self.flights))

    def enter(
        self, flight: Flight, phase: Phase, now: float, *, detail: dict[str, Any] | None = None
    ) -> wire.Message:
        """Journal the new phase first, then return its command to send."""
        self.machine.set_phase(flight, phase, now)
        detail = {**self.machine.journaled(flight, phase), **(detail or {})}
        self.journal.set_migration_state(flight.id, phase, ts=now, detail=detail)
        return self.machine.command(flight, now)

    def finish(self, flight: Flight, outcome: Outcome, now: float, *, detail: str = "") -> None:
        record, downtime = outcome_record(flight, outcome, detail)
        self.flights.pop(flight.id, None)
        self.guard_state.record_end(flight.job)
        try:
            self.journal.set_migration_state(flight.id, outcome, ts=now, detail=record)
        except AlreadyFinished:
            return  # never report a migration twice
        if outcome == "done":
            self.replaced[(flight.job, flight.leaver)] = flight.joiner
        if self.metrics is not None:
            self.metrics.migrations.labels(outcome=outcome).inc()
            self.metrics.migrations_in_flight.set(len(self.flights))
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
