"""Resuming, after a restart, the migrations the journal still holds in flight.

Every transition is journaled before the command that follows it is sent. After a
restart the actuator waits ``actuator.settle_s`` for the retained statuses, then
resumes each migration the journal still holds in flight from the phase it reached
(``Journal.in_flight``), so a migration is neither lost nor repeated, and each ends
in exactly one ``MigrationFinished``. The guardrails count the migrations of the last
hour from when they started, and the cooldowns of machines (migrated, or restarted
without) from then too, as if the daemon had not stopped.

A checkpoint restart still in flight is resumed the same way: its ``Restart`` is sent
again with the same id (the runtime acts on an id once), unless the job's status
already answered it; a new decision about the same machine is then held, never sent
as a second restart.
"""

from __future__ import annotations

import re
from collections import deque

from tmd import wire
from tmd.daemon.actuator.flight import RESTART, Flight, Phase, machine_slots
from tmd.daemon.actuator.ledger import Ledger
from tmd.daemon.actuator.membership import RUNTIME
from tmd.daemon.journal import TERMINAL_STATES, MigrationRow
from tmd.daemon.view import ClusterView, JobView

UNKNOWN_POLICY = "unknown"
"""Of a row journaled before its detail named the policy, whose reason names none."""
_POLICY_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")


def reconcile(
    ledger: Ledger, view: ClusterView, now: float, *, lookback_s: float = 3600.0
) -> list[wire.Message]:
    """Resume what the journal holds in flight; returns the commands to publish. The
    guardrails count what started in the last ``lookback_s`` (the longest of their
    windows)."""
    guard = ledger.guard_state
    out: list[wire.Message] = []
    for row in ledger.journal.recent_migrations(now - lookback_s):
        if row.state not in TERMINAL_STATES:
            continue  # counted again when it is resumed below
        if is_restart(row):  # not counted as a migration, but its machine cools down
            guard.last_restart[(row.job, row.leaver)] = row.created_ts
            continue
        if not row.detail.get("runtime_id"):  # the runtime's own: not the daemon's budget
            guard.started.append(row.created_ts)
        guard.last_on_node[row.leaver] = row.created_ts
    for row in ledger.journal.in_flight():
        if row.id in ledger.flights:
            continue
        out += resume(ledger, row, view.jobs.get(row.job), now)
    guard.started = deque(sorted(guard.started))
    return out


def resume(
    ledger: Ledger, row: MigrationRow, job: JobView | None, now: float
) -> list[wire.Message]:
    """Drive ``row`` again from the phase it reached; ``job`` as the view has it now."""
    if is_restart(row):
        return _resume_restart(ledger, row, job, now)
    if row.detail.get("runtime_id"):  # a failover the runtime did, awaiting its ack
        ledger.start(_restore(ledger, row, job, "runtime", now), row.created_ts)
        return []
    nodes = set(job.members.values()) if job is not None else set()
    if row.joiner in nodes and row.leaver not in nodes:
        flight = _restore(ledger, row, job, "switching", now)
        ledger.start(flight, row.created_ts)
        ledger.finish(flight, "done", now, detail="switched while the daemon was down")
        return []
    phase: Phase = "preparing"
    if row.state in ("prepared", "switching"):
        phase = "switching"
    elif row.state == "aborting":
        phase = "aborting"
    flight = _restore(ledger, row, job, phase, now)
    flight.abort_reason = str(row.detail.get("why", ""))
    # Journaled before the ledger drives it: a write that fails leaves it to the next start.
    if row.state == "planned":  # stopped before its prepare was journaled (or sent)
        command = ledger.enter(flight, "preparing", now, detail={"resumed": True})
    else:
        ledger.journal.set_migration_state(row.id, row.state, ts=now, detail={"resumed": True})
        command = ledger.machine.command(flight, now)
    ledger.start(flight, row.created_ts)  # cooldowns and rate limits count from then
    ledger.log.info("resuming migration", migration_id=row.id, state=row.state, phase=phase)
    return [command]


def is_restart(row: MigrationRow) -> bool:
    """Whether ``row`` is a checkpoint restart's, not a migration's."""
    return row.detail.get("kind") == RESTART


def _resume_restart(
    ledger: Ledger, row: MigrationRow, job: JobView | None, now: float
) -> list[wire.Message]:
    flight = _restore(ledger, row, job, "restarting", now)
    if job is not None:  # the status may have answered it while the daemon was down
        action, detail = ledger.machine.on_status(
            flight, job.generation, set(job.members.values()), state=job.state
        )
        if action in ("done", "aborted"):
            ledger.start(flight, row.created_ts)  # what the journal holds, until it ends
            ledger.finish(flight, action, now, detail=f"{detail} (while the daemon was down)")
            return []
    ledger.journal.set_migration_state(row.id, row.state, ts=now, detail={"resumed": True})
    ledger.start(flight, row.created_ts)
    ledger.log.info("resuming restart", migration_id=row.id, job=row.job, node=row.leaver)
    return [ledger.machine.command(flight, now)]


def _restore(
    ledger: Ledger, row: MigrationRow, job: JobView | None, phase: Phase, now: float
) -> Flight:
    return restore(row, job, phase, deadline=now + ledger.machine.timeout_s(phase))


def restore(row: MigrationRow, job: JobView | None, phase: Phase, *, deadline: float) -> Flight:
    """The flight record of a journaled migration, in ``phase`` until ``deadline``."""
    if "members" in row.detail:  # as journaled when it started
        members = frozenset(str(m) for m in row.detail["members"])
        # Journaled before machines had local ranks: one process per machine.
        slots = {str(n): int(k) for n, k in dict(row.detail.get("slots") or {}).items()}
    else:
        members = frozenset(job.members.values()) if job is not None else frozenset()
        if row.joiner in members:  # it switched: the members before it had the leaver
            members = (members - {row.joiner}) | {row.leaver}
        machines = job.machines() if job is not None else {}
        slots = machine_slots(machines, row.leaver, row.joiner)
    run = row.detail.get("run")  # a restart's; None: journaled before runs were counted
    return Flight(
        id=row.id, job=row.job, leaver=row.leaver, joiner=row.joiner,
        policy=policy_of(row), reason=row.reason, phase=phase,
        generation=int(row.detail.get("generation", job.generation if job else 0)),
        members=members, deadline=deadline, slots=slots,
        runtime_id=str(row.detail.get("runtime_id", "")),
        run=None if run is None else int(run),
    )  # fmt: skip


def policy_of(row: MigrationRow) -> str:
    """The policy that decided ``row``'s migration, as its detail names it (``Ledger.begin``).
    A row journaled before that: the runtime's failover (its reason is a sentence), else
    the policy its reason starts with ("policy: reason"), if that is a policy's name."""
    policy = row.detail.get("policy")
    if isinstance(policy, str) and policy:
        return policy
    if row.detail.get("runtime_id"):
        return RUNTIME
    named = row.reason.partition(":")[0]
    return named if _POLICY_NAME.fullmatch(named) else UNKNOWN_POLICY
