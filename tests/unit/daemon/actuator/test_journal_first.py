"""The actuator journals a transition before its memory moves: when the write fails (a
real SQLite journal whose write is refused), the flight, the ledger and the guardrails
are as they were, and the next answer, status or decision tries again."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.unit.daemon.actuator.test_actuator import (
    JOB,
    T0,
    WORKERS,
    Harness,
    ack,
    migrate,
    start,
    status,
)
from tmd import wire
from tmd.errors import JournalError


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path / "journal.sqlite3")


def refuse(h: Harness, table: str, when: str = "1") -> Callable[[], None]:
    """Make writes to ``table`` matching ``when`` fail; returns what lets them through."""
    op = "UPDATE" if table == "migrations" else "INSERT"
    _schema(h, f"CREATE TRIGGER refuse BEFORE {op} ON {table} WHEN {when}"
               " BEGIN SELECT RAISE(ABORT, 'refused'); END;")  # fmt: skip
    return lambda: _schema(h, "DROP TRIGGER refuse;")


def fail_commit(h: Harness, when: str) -> Callable[[], None]:
    """Make the COMMIT of a transaction that journals a transition matching ``when``
    fail (a deferred foreign key, checked only at COMMIT), the statements before it
    having gone through."""
    _schema(h, "CREATE TABLE parent (id INTEGER PRIMARY KEY);"
               "CREATE TABLE child (parent INTEGER REFERENCES parent (id)"
               " DEFERRABLE INITIALLY DEFERRED);"
               f"CREATE TRIGGER dangling AFTER UPDATE ON migrations WHEN {when}"
               " BEGIN INSERT INTO child VALUES (1); END;")  # fmt: skip
    h.journal._db.execute("PRAGMA foreign_keys = ON")  # per connection: the journal's own
    return lambda: _schema(h, "DROP TRIGGER dangling;")


def _schema(h: Harness, sql: str) -> None:
    other = sqlite3.connect(h.path)  # another process on the same file
    other.executescript(sql)
    other.close()


def states(h: Harness, mid: str) -> list[str]:
    rows = h.journal.events(kind="MigrationState")
    return [e.body["state"] for e in rows if e.body["migration_id"] == mid]


@pytest.mark.parametrize("fails", ["statement", "commit"])
def test_a_migration_whose_prepare_cannot_be_journaled_is_not_started(
    h: Harness, fails: str
) -> None:
    h.status(status())
    when = "NEW.state = 'preparing'"
    allow = refuse(h, "migrations", when) if fails == "statement" else fail_commit(h, when)
    with pytest.raises(JournalError):
        h.actuator.on_event(migrate(), T0)
    guard = h.actuator.guard_state
    assert h.actuator.flights == {}
    assert (guard.in_flight, guard.last_on_node, list(guard.started)) == ({}, {}, [])
    assert h.journal.recent_migrations(0) == []  # no planned row left for a restart
    allow()
    [prepare] = h.actuator.on_event(migrate(), T0 + 1)  # the policy decides again
    assert isinstance(prepare, wire.Prepare)
    assert states(h, prepare.migration_id) == ["planned", "preparing"]
    assert h.actuator.flights[prepare.migration_id].phase == "preparing"


@pytest.mark.parametrize(
    ("answers", "phase", "command", "history"),
    [
        ([("prepared", n) for n in WORKERS], "switching", wire.Switch,
         ["planned", "preparing", "prepared", "switching"]),
        ([("failed", "w1")], "aborting", wire.Abort, ["planned", "preparing", "aborting"]),
    ],
)  # fmt: skip
def test_a_phase_that_cannot_be_journaled_leaves_the_flight_as_it_was(
    h: Harness,
    answers: list[tuple[str, str]],
    phase: str,
    command: type[wire.Message],
    history: list[str],
) -> None:
    mid = start(h)
    flight = h.actuator.flights[mid]
    before = (flight.phase, flight.deadline, flight.next_send, flight.abort_reason)
    allow = refuse(h, "migrations", f"NEW.state = '{phase}'")
    with pytest.raises(JournalError):
        h.feed(*(ack(mid, kind, node) for kind, node in answers), now=T0 + 1)
    assert (flight.phase, flight.deadline, flight.next_send, flight.abort_reason) == before
    assert states(h, mid) == ["planned", "preparing"]  # "prepared" went with "switching"
    allow()
    out = h.feed(ack(mid, *answers[-1]), now=T0 + 2)  # the answer again, to a resend
    assert [type(m) for m in out] == [command]
    assert h.actuator.flights[mid].phase == phase
    assert states(h, mid) == history


def test_an_end_that_cannot_be_journaled_keeps_the_flight_and_its_count(h: Harness) -> None:
    mid = start(h)
    allow = refuse(h, "migrations", "NEW.state = 'aborted'")
    with pytest.raises(JournalError):
        h.feed(*(ack(mid, "aborted", n) for n in WORKERS), now=T0 + 1)
    assert mid in h.actuator.flights and h.actuator.guard_state.in_flight == {JOB: 1}
    assert h.finished() == [] and h.journal.in_flight()[0].id == mid
    allow()
    h.feed(ack(mid, "aborted", "w0"), now=T0 + 2)
    assert [(e.migration_id, e.outcome) for e in h.finished()] == [(mid, "aborted")]
    assert h.actuator.flights == {} and h.actuator.guard_state.in_flight == {}


def test_a_failover_the_runtime_did_that_cannot_be_journaled_is_seen_again(
    h: Harness,
) -> None:
    h.status(status())
    allow = refuse(h, "events", "NEW.kind = 'MigrationState'")
    switched = status(1, ["w0", "s0", "w2"], standbys={})
    with pytest.raises(JournalError):
        h.status(switched, T0 + 3)
    membership = h.actuator.memberships.get(JOB)
    assert membership is not None and membership.generation == 0  # not moved on
    assert h.actuator.flights == {} and h.actuator.ledger.replaced == {}
    assert h.journal.recent_migrations(0) == []
    allow()
    h.status(switched, T0 + 5)  # its next status
    h.feed(ack("failover-g0", "switched", "w0", 1.1), now=T0 + 6)
    [end] = h.finished()
    assert (end.node, end.to, end.outcome, end.downtime_s) == ("w1", "s0", "done", 1.1)


def test_a_membership_that_cannot_be_journaled_is_not_remembered(h: Harness) -> None:
    allow = refuse(h, "memberships")
    with pytest.raises(JournalError):
        h.status(status())
    assert h.actuator.memberships.get(JOB) is None
    allow()
    h.status(status())
    assert h.actuator.memberships.get(JOB) is not None
    assert h.journal.memberships()[JOB].members == dict(enumerate(WORKERS))
