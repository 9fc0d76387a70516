"""Journal: findings and decisions are queryable; migrations keep their history and
survive a restart (reopen), so in-flight ones are known."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tmd.daemon import events
from tmd.daemon.journal import Journal, Membership
from tmd.errors import AlreadyFinished, JournalError

TS = 1_800_000_000.0


def test_events_recorded_and_filtered(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.sqlite3")
    a = j.record(events.NodeLost(ts=TS, node="n1", cause="heartbeat"), source="node_lost")
    b = j.record(
        events.Migrate(ts=TS + 1, policy="drain", reason="operator", job="job1", node="n1"),
        source="drain",
    )
    rows = j.events()
    assert [r.id for r in rows] == [a, b]
    assert rows[0].kind == "NodeLost" and rows[0].body["cause"] == "heartbeat"
    assert rows[1].job == "job1" and rows[1].source == "drain"
    assert [r.id for r in j.events(kind="Migrate")] == [b]
    assert [r.id for r in j.events(after_id=a)] == [b]
    assert [r.id for r in j.events(newest_first=True, limit=1)] == [b]
    assert j.prune(TS + 0.5) == 1
    assert [r.id for r in j.events()] == [b]
    assert j._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_migrations_survive_restart(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    j = Journal(path)
    assert j.begin_migration(id="m1", job="job", leaver="n1", joiner="s1", reason="xid 79", ts=TS)
    assert not j.begin_migration(id="m1", job="job", leaver="n1", joiner="s1", reason="x", ts=TS)
    j.set_migration_state("m1", "prepared", ts=TS + 1, detail={"warm": True})
    j.begin_migration(id="m2", job="job", leaver="n2", joiner="s2", reason="drain", ts=TS + 2)
    j.set_migration_state("m2", "done", ts=TS + 3, detail={"downtime_s": 0.2})
    j.close()

    j = Journal(path)  # the daemon restarted
    flight = j.in_flight()
    assert [(m.id, m.state, m.detail) for m in flight] == [("m1", "prepared", {"warm": True})]
    with pytest.raises(AlreadyFinished, match="already done"):
        j.set_migration_state("m2", "switching", ts=TS + 4)
    with pytest.raises(KeyError):
        j.set_migration_state("nope", "done", ts=TS)
    history = [(r.body["migration_id"], r.body["state"]) for r in j.events(kind="MigrationState")]
    assert history == [("m1", "planned"), ("m1", "prepared"), ("m2", "planned"), ("m2", "done")]


def test_sqlite_errors_come_out_as_journal_errors(tmp_path: Path) -> None:
    newer = tmp_path / "newer.sqlite3"
    sqlite3.connect(newer).execute("PRAGMA user_version = 99").connection.close()
    with pytest.raises(JournalError, match="newer than this tmd"):
        Journal(newer)
    garbage = tmp_path / "garbage.sqlite3"
    garbage.write_bytes(b"not a database" * 100)
    with pytest.raises(JournalError, match=r"garbage\.sqlite3"):
        Journal(garbage)
    j = Journal(tmp_path / "j.sqlite3")
    j.close()
    with pytest.raises(JournalError):
        j.record(events.NodeLost(ts=TS, node="n1", cause="heartbeat"))
    with pytest.raises(JournalError):
        j.in_flight()


def test_a_membership_keeps_its_run_and_rows_from_before_runs_read_as_run_0(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)  # a journal written before runs were counted
    old.executescript(
        "CREATE TABLE memberships (job TEXT PRIMARY KEY, generation INTEGER NOT NULL,"
        " step INTEGER NOT NULL, ts REAL NOT NULL, members TEXT NOT NULL);"
        "INSERT INTO memberships VALUES ('a', 2, 40, 1.0, '[[0, \"n0\"]]');"
        "PRAGMA user_version = 1;"
    )
    old.close()
    j = Journal(path)
    assert j.memberships() == {"a": Membership(2, 40, 1.0, {0: "n0"}, run=0)}
    j.save_membership("b", Membership(0, 40, 2.0, {0: "n1"}, run=3))
    j.close()
    j = Journal(path)  # opened again: the column is there once
    assert j.memberships()["b"].run == 3
    old = sqlite3.connect(path)  # what an older tmd writes, naming its columns, still goes
    old.execute(
        "INSERT OR REPLACE INTO memberships (job, generation, step, ts, members)"
        " VALUES ('c', 0, 0, 3.0, '[]')"
    )
    old.commit()
    old.close()
    assert j.memberships()["c"].run == 0


def _fail_commits(path: Path, j: Journal, when: str) -> None:
    """Make the COMMIT of every transaction that writes an event row matching ``when``
    fail: the row leaves a dangling deferred foreign key, checked only at COMMIT."""
    other = sqlite3.connect(path)
    other.executescript(
        "CREATE TABLE parent (id INTEGER PRIMARY KEY);"
        "CREATE TABLE child (parent INTEGER REFERENCES parent (id)"
        " DEFERRABLE INITIALLY DEFERRED);"
        f"CREATE TRIGGER dangling AFTER INSERT ON events WHEN {when}"
        " BEGIN INSERT INTO child VALUES (1); END;"
    )
    other.close()
    j._db.execute("PRAGMA foreign_keys = ON")  # per connection: the journal's own


def test_a_write_whose_commit_fails_is_rolled_back_and_the_next_one_works(
    tmp_path: Path,
) -> None:
    path = tmp_path / "j.sqlite3"
    j = Journal(path)
    j.begin_migration(id="m1", job="job", leaver="n1", joiner="s1", reason="drain", ts=TS)
    _fail_commits(path, j, "NEW.kind = 'NodeLost' OR NEW.body LIKE '%\"switching\"%'")
    with pytest.raises(JournalError, match="FOREIGN KEY constraint failed"):
        j.record(events.NodeLost(ts=TS, node="n1", cause="heartbeat"))
    with pytest.raises(JournalError, match="FOREIGN KEY constraint failed"):
        j.set_migration_state("m1", "switching", ts=TS + 1)  # a durable transition's
    # Nothing of either was kept, and the journal takes the next writes.
    j.record(events.Migrate(ts=TS + 2, policy="drain", reason="operator", job="job", node="n1"))
    j.set_migration_state("m1", "aborted", ts=TS + 3)
    assert [r.kind for r in j.events()] == ["MigrationState", "Migrate", "MigrationState"]
    assert [r.body["state"] for r in j.events(kind="MigrationState")] == ["planned", "aborted"]
    j.close()
    assert Journal(path).migration("m1").state == "aborted"  # type: ignore[union-attr]


def test_transitions_are_committed_with_synchronous_full_and_findings_normal(
    tmp_path: Path,
) -> None:
    path = tmp_path / "j.sqlite3"
    j = Journal(path)
    other = sqlite3.connect(path)  # each event row notes the level it was committed at
    other.executescript(
        "CREATE TABLE levels (kind TEXT, level INTEGER);"
        "CREATE TRIGGER level AFTER INSERT ON events BEGIN"
        " INSERT INTO levels SELECT NEW.kind, synchronous FROM pragma_synchronous; END;"
    )
    other.close()
    j.record(events.NodeLost(ts=TS, node="n1", cause="heartbeat"))
    j.begin_migration(id="m1", job="job", leaver="n1", joiner="s1", reason="drain", ts=TS)
    j.set_migration_state("m1", "preparing", ts=TS + 1)
    with j.atomic():
        j.record(events.NodeLost(ts=TS + 2, node="n2", cause="heartbeat"))
    j.record(events.NodeLost(ts=TS + 3, node="n3", cause="heartbeat"))
    FULL, NORMAL = 2, 1
    assert j._db.execute("SELECT kind, level FROM levels").fetchall() == [
        ("NodeLost", NORMAL),
        ("MigrationState", FULL),
        ("MigrationState", FULL),
        ("NodeLost", FULL),  # inside ``atomic``: committed with the transitions
        ("NodeLost", NORMAL),
    ]


def test_writes_in_atomic_are_kept_or_dropped_together(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    j = Journal(path)
    other = sqlite3.connect(path)
    other.executescript(
        "CREATE TRIGGER refuse BEFORE INSERT ON events WHEN NEW.body LIKE '%\"m2\"%'"
        " BEGIN SELECT RAISE(ABORT, 'refused'); END;"
    )
    other.close()

    def begin(id: str) -> None:
        j.begin_migration(id=id, job="job", leaver="n1", joiner="s1", reason="drain", ts=TS)

    with pytest.raises(JournalError, match="refused"), j.atomic():
        begin("m1")
        begin("m2")
    assert j.recent_migrations(0) == [] and j.events() == []
    with j.atomic():
        begin("m1")
        with pytest.raises(JournalError, match="refused"):
            begin("m2")  # its row goes with its event, the rest stays
        j.set_migration_state("m1", "preparing", ts=TS + 1)
    assert [(m.id, m.state) for m in j.recent_migrations(0)] == [("m1", "preparing")]
    assert len(j.events()) == 2


def test_prune_forgets_the_memberships_of_jobs_gone_and_the_migrations_ended(
    tmp_path: Path,
) -> None:
    j = Journal(tmp_path / "j.sqlite3")
    for i in range(5000):  # a churn of job names, each seen once
        j.save_membership(f"gone{i}", Membership(0, 1, TS, {0: f"n{i}"}), now=TS + i * 0.01)
    j.save_membership("live", Membership(3, 9, TS, {0: "n0"}), now=TS)
    j.save_membership("recent", Membership(0, 1, TS, {0: "n1"}), now=TS + 100)
    j._db.execute(  # a row of a tmd from before saved_ts: judged by its status's time
        "INSERT INTO memberships (job, generation, step, ts, members) VALUES"
        " ('old', 0, 0, ?, '[]'), ('old-but-recent', 0, 0, ?, '[]')",
        (TS, TS + 100),
    )
    for i, state in enumerate(["done", "aborted", "failed", "switching"]):
        j.begin_migration(id=f"m{i}", job="live", leaver="n0", joiner="s0", reason="", ts=TS)
        j.set_migration_state(f"m{i}", state, ts=TS + 1)
    j.begin_migration(id="m9", job="live", leaver="n0", joiner="s0", reason="", ts=TS + 100)
    j.set_migration_state("m9", "done", ts=TS + 100)

    j.prune(TS + 99, keep_jobs={"live", "nowhere"})
    assert set(j.memberships()) == {"live", "recent", "old-but-recent"}
    assert j.membership("live") == Membership(3, 9, TS, {0: "n0"})
    assert j.membership("gone0") is None
    assert {m.id for m in j.recent_migrations(0)} == {"m3", "m9"}  # in flight, or recent
    assert [m.id for m in j.in_flight()] == ["m3"]
