"""The journal: findings, decisions and migrations in SQLite (WAL), so ``tmd events``
shows history and a restarted daemon knows which migrations were in flight.

Writes are small and rare (findings and decisions, not telemetry), so they run on
the event loop; WAL with ``synchronous=NORMAL`` commits without an fsync per write.
A migration row moves through states; every transition is also an event row, so
the history of a migration is never overwritten.

Durability: a transition of a migration (or restart) is committed with
``synchronous=FULL``, so it is on the disk before the command that follows it is sent
and a power loss cannot take back a transition the runtime has acted on; findings,
events and memberships stay at ``NORMAL`` (a power loss may drop the last of them, never
corrupt the file). SQLite refuses to change the level inside a transaction, so it is
set before ``BEGIN`` and set back after the transaction ends; in WAL mode the FULL
commit's sync also makes every earlier NORMAL commit durable.

Every write is one transaction, and any error in it, ``COMMIT``'s included, rolls it
back, so a failed write leaves the connection usable for the next one. ``atomic``
groups writes that only make sense together (a migration's ``planned`` and
``preparing``): they are kept or dropped together, and each write inside it is a
savepoint of it.

The file stays bounded: ``prune`` (the daemon's housekeeping) deletes what is older
than the retention: events, migrations that ended, and the memberships of jobs the
daemon no longer knows.

``sqlite3`` stays inside: its errors come out as ``JournalError``, and setting the
state of a migration that already ended as ``AlreadyFinished``, so callers handle
errors of ours, not the driver's.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec

from tmd.daemon import events
from tmd.errors import AlreadyFinished, JournalError

TERMINAL_STATES: Final = frozenset({"done", "aborted", "failed"})

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    job TEXT NOT NULL DEFAULT '',
    node TEXT NOT NULL DEFAULT '',
    source TEXT NOT NULL DEFAULT '',
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_ts ON events (ts);
CREATE INDEX IF NOT EXISTS events_job ON events (job, id);
CREATE TABLE IF NOT EXISTS migrations (
    id TEXT PRIMARY KEY,
    job TEXT NOT NULL,
    leaver TEXT NOT NULL,
    joiner TEXT NOT NULL DEFAULT '',
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    created_ts REAL NOT NULL,
    updated_ts REAL NOT NULL,
    detail TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS migrations_state ON migrations (state);
CREATE TABLE IF NOT EXISTS memberships (
    job TEXT PRIMARY KEY,
    generation INTEGER NOT NULL,
    step INTEGER NOT NULL,
    ts REAL NOT NULL,
    members TEXT NOT NULL,
    run INTEGER NOT NULL DEFAULT 0,
    saved_ts REAL NOT NULL DEFAULT 0
);
"""
_SCHEMA_VERSION: Final = 1
_ADDED_COLUMNS: Final = (
    ("memberships", "run", "INTEGER NOT NULL DEFAULT 0"),
    # When (daemon time) the row was written; 0: by a tmd from before the column, whose
    # rows are judged by their status's own time instead.
    ("memberships", "saved_ts", "REAL NOT NULL DEFAULT 0"),
)
"""Columns added since a table was first created, each with a default, so a row written
before reads as that default. Additive changes keep the schema version (as the wire
keeps ``v = 1``): an older tmd names the columns it reads and writes, and goes on
working with the same file."""


@dataclass(frozen=True)
class EventRow:
    id: int
    ts: float
    kind: str
    job: str
    node: str
    source: str
    body: dict[str, Any]


@dataclass(frozen=True)
class MigrationRow:
    id: str
    job: str
    leaver: str
    joiner: str
    state: str
    reason: str
    created_ts: float
    updated_ts: float
    detail: dict[str, Any]


@dataclass(frozen=True)
class Membership:
    """A job's membership as one of its statuses said it: what the actuator compares
    the next status with (``tmd.daemon.actuator.membership``)."""

    generation: int
    step: int
    ts: float  # the status's own time
    members: dict[int, str]  # rank -> node
    run: int = 0  # the launcher's restart count (0: a row or a runtime from before runs)


_MEMBERSHIP: Final = "SELECT job, generation, step, ts, members, run FROM memberships"


def _membership(r: Any) -> Membership:
    return Membership(r[1], r[2], r[3], {int(k): v for k, v in json.loads(r[4])}, r[5])


class Journal:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._depth = 0  # nesting of ``_tx``: 0 outside a transaction
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._translated():
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            try:
                self._open(path)
            except BaseException:
                self._db.close()
                raise

    def _open(self, path: str | Path) -> None:
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > _SCHEMA_VERSION:
            raise JournalError(
                f"journal {path} has schema {version}, newer than this tmd ({_SCHEMA_VERSION})"
            )
        # executescript commits on its own; every statement in it is idempotent.
        self._db.executescript(_SCHEMA + f"PRAGMA user_version={_SCHEMA_VERSION};")
        for table, column, definition in _ADDED_COLUMNS:
            have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in have:  # a journal from before the column
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")

    def close(self) -> None:
        with self._translated():
            self._db.close()

    @contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            raise JournalError(f"journal {self.path}: {exc}") from exc

    @contextmanager
    def atomic(self) -> Iterator[None]:
        """Writes kept together or not at all, committed as durably as a transition."""
        with self._tx(durable=True):
            yield

    @contextmanager
    def _tx(self, *, durable: bool = False) -> Iterator[sqlite3.Connection]:
        """A transaction (inside ``atomic``, a savepoint of its transaction); ``durable``:
        committed with ``synchronous=FULL``."""
        db = self._db
        with self._translated():
            if self._depth:
                with self._savepoint():
                    yield db
                return
            if durable:
                db.execute("PRAGMA synchronous=FULL")
            self._depth = 1
            try:
                db.execute("BEGIN IMMEDIATE")
                yield db
                # A COMMIT that fails (a deferred constraint, a full disk, a busy lock)
                # leaves the transaction open, and every later BEGIN would fail on it.
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:  # some errors roll it back by themselves
                    db.execute("ROLLBACK")
                raise
            finally:
                self._depth = 0
                if durable and not db.in_transaction:
                    db.execute("PRAGMA synchronous=NORMAL")

    @contextmanager
    def _savepoint(self) -> Iterator[None]:
        db = self._db
        db.execute("SAVEPOINT tx")
        self._depth += 1
        try:
            yield
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK TO tx")
                db.execute("RELEASE tx")
            raise
        finally:
            self._depth -= 1
        db.execute("RELEASE tx")

    def _query(self, sql: str, args: Any = ()) -> list[Any]:
        with self._translated():
            return self._db.execute(sql, args).fetchall()

    # -- events ------------------------------------------------------------------------

    def record(self, event: events.Event, *, source: str = "") -> int:
        """Append a finding or decision; returns its id."""
        body = msgspec.json.encode(event).decode()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO events (ts, kind, job, node, source, body) VALUES (?,?,?,?,?,?)",
                (
                    event.ts,
                    type(event).__name__,
                    getattr(event, "job", "") or "",
                    getattr(event, "node", "") or "",
                    source,
                    body,
                ),
            )
            return int(cur.lastrowid or 0)

    def events(
        self,
        *,
        after_id: int = 0,
        limit: int = 100,
        job: str | None = None,
        kind: str | None = None,
        newest_first: bool = False,
    ) -> list[EventRow]:
        sql = "SELECT id, ts, kind, job, node, source, body FROM events WHERE id > ?"
        args: list[Any] = [after_id]
        if job:
            sql += " AND job = ?"
            args.append(job)
        if kind:
            sql += " AND kind = ?"
            args.append(kind)
        sql += f" ORDER BY id {'DESC' if newest_first else 'ASC'} LIMIT ?"
        args.append(max(1, min(limit, 10_000)))
        return [
            EventRow(r[0], r[1], r[2], r[3], r[4], r[5], json.loads(r[6]))
            for r in self._query(sql, args)
        ]

    def prune(self, before_ts: float, *, keep_jobs: Collection[str] = ()) -> int:
        """Delete what is older than ``before_ts``: events, migrations that ended, and
        the memberships saved before then of jobs not in ``keep_jobs`` (the jobs the
        daemon knows now); returns how many events went. A membership is read when its
        job's next status comes (``Memberships``): a job the view forgot whose row went
        is taken, if it comes back, for a job seen the first time."""
        marks = ",".join("?" * len(TERMINAL_STATES))
        with self._tx() as db:
            events = db.execute("DELETE FROM events WHERE ts < ?", (before_ts,)).rowcount
            db.execute(
                f"DELETE FROM migrations WHERE state IN ({marks}) AND updated_ts < ?",
                (*sorted(TERMINAL_STATES), before_ts),
            )
            db.execute(
                "DELETE FROM memberships"
                " WHERE (CASE WHEN saved_ts > 0 THEN saved_ts ELSE ts END) < ?"
                " AND job NOT IN (SELECT value FROM json_each(?))",
                (before_ts, json.dumps(sorted(keep_jobs))),
            )
            return events

    # -- migrations --------------------------------------------------------------------

    def begin_migration(
        self,
        *,
        id: str,
        job: str,
        leaver: str,
        joiner: str,
        reason: str,
        ts: float,
        state: str = "planned",
        detail: dict[str, Any] | None = None,
    ) -> bool:
        """Record a new migration in ``state`` (``planned`` unless it starts in a later
        one, with its ``detail``, in the same transaction); False if ``id`` exists
        (idempotent)."""
        with self._tx(durable=True) as db:
            cur = db.execute(
                "INSERT OR IGNORE INTO migrations"
                " (id, job, leaver, joiner, state, reason, created_ts, updated_ts, detail)"
                " VALUES (?,?,?,?,?,?,?,?,?)",
                (id, job, leaver, joiner, state, reason, ts, ts, json.dumps(detail or {})),
            )
            if cur.rowcount:
                body = {"reason": reason, **(detail or {})}
                self._transition_event(db, id, job, leaver, state, ts, body)
            return bool(cur.rowcount)

    def set_migration_state(
        self, id: str, state: str, *, ts: float, detail: dict[str, Any] | None = None
    ) -> None:
        """Move a migration to ``state``; ``AlreadyFinished`` if it has ended, KeyError
        if there is no such migration."""
        with self._tx(durable=True) as db:
            row = db.execute(
                "SELECT job, leaver, state FROM migrations WHERE id = ?", (id,)
            ).fetchone()
            if row is None:
                raise KeyError(f"no migration {id!r} in the journal")
            if row[2] in TERMINAL_STATES:
                raise AlreadyFinished(f"migration {id} is already {row[2]}")
            db.execute(
                "UPDATE migrations SET state = ?, updated_ts = ?,"
                " detail = json_patch(detail, ?) WHERE id = ?",
                (state, ts, json.dumps(detail or {}), id),
            )
            self._transition_event(db, id, row[0], row[1], state, ts, detail or {})

    def migration(self, id: str) -> MigrationRow | None:
        rows = self._migrations("WHERE id = ?", (id,))
        return rows[0] if rows else None

    def in_flight(self) -> list[MigrationRow]:
        """Migrations not yet done, aborted or failed: what a restarted daemon resumes."""
        marks = ",".join("?" * len(TERMINAL_STATES))
        return self._migrations(
            f"WHERE state NOT IN ({marks}) ORDER BY created_ts", tuple(sorted(TERMINAL_STATES))
        )

    def latest_migrations(self, limit: int = 10) -> list[MigrationRow]:
        """The newest migrations, newest first (``tmd status``)."""
        return self._migrations("ORDER BY created_ts DESC LIMIT ?", (max(1, limit),))

    # -- memberships -------------------------------------------------------------------

    def save_membership(self, job: str, membership: Membership, *, now: float = 0.0) -> None:
        """The last membership the actuator saw of ``job``, saved at ``now`` (daemon
        time; ``prune`` goes by it): after a restart it tells what changed while the
        daemon was down."""
        m = membership
        members = json.dumps(sorted(m.members.items()))
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO memberships"
                " (job, generation, step, ts, members, run, saved_ts) VALUES (?,?,?,?,?,?,?)",
                (job, m.generation, m.step, m.ts, members, m.run, now),
            )

    def membership(self, job: str) -> Membership | None:
        """The last membership saved of ``job``, if any."""
        rows = self._query(_MEMBERSHIP + " WHERE job = ?", (job,))
        return _membership(rows[0]) if rows else None

    def memberships(self) -> dict[str, Membership]:
        """The last membership saved of each job."""
        return {r[0]: _membership(r) for r in self._query(_MEMBERSHIP)}

    def recent_migrations(self, since_ts: float) -> list[MigrationRow]:
        """Migrations created at or after ``since_ts``, oldest first (rate limits and
        cooldowns survive a restart)."""
        return self._migrations("WHERE created_ts >= ? ORDER BY created_ts", (since_ts,))

    def _migrations(self, where: str, args: tuple[Any, ...]) -> list[MigrationRow]:
        sql = (
            "SELECT id, job, leaver, joiner, state, reason, created_ts, updated_ts, detail"
            f" FROM migrations {where}"
        )
        return [
            MigrationRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], json.loads(r[8]))
            for r in self._query(sql, args)
        ]

    @staticmethod
    def _transition_event(
        db: sqlite3.Connection,
        id: str,
        job: str,
        leaver: str,
        state: str,
        ts: float,
        detail: dict[str, Any],
    ) -> None:
        body = json.dumps({"migration_id": id, "state": state, **detail})
        db.execute(
            "INSERT INTO events (ts, kind, job, node, source, body) VALUES (?,?,?,?,?,?)",
            (ts, "MigrationState", job, leaver, "actuator", body),
        )
