"""Who is in each job, as its status says, and what a new status says happened.

The runtime also replaces a dead machine by itself (``tmd.runtime.failover``), faster
than any daemon could react. The actuator notices that from the job's status (a new
generation with a different node at a rank, without a migration of its own) and
journals it as a finished migration, so policies, guardrails and ``tmd events`` see
it like any other. A status of a higher run (the launcher's restart count) is a new run
of the job, restarted from its checkpoint, whatever time its new rank 0's clock put on
it; where the run cannot tell, so is a newer one whose generation and step went back
(``since``). The runtime's answers about its own failovers may come before the
status that explains them; they wait here to be claimed.

The last membership of each job is kept in the journal, so that a restarted daemon
sees what changed while it was down. Memory holds a cache of it: the jobs seen since
the daemon started, at most ``cap`` of them (the view's ``max_jobs``), the least
recently seen forgotten first, and only while the view holds them (``keep_only``); a
job not in it is read from the journal when its next status comes.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Mapping
from typing import Literal, NamedTuple

from tmd import wire
from tmd.daemon.actuator.flight import RUNTIME_ACK_GRACE_S, Flight
from tmd.daemon.actuator.ledger import remember
from tmd.daemon.journal import Journal, Membership

MAX_EARLY_ACKS = 1024
RUNTIME = "runtime"
"""The policy named in what the runtime did by itself: its failovers, its rollbacks."""

__all__ = [
    "FailoverAcks",
    "Membership",
    "Memberships",
    "Moved",
    "moved",
    "of",
    "runtime_failover",
    "since",
]


class Memberships:
    """The last membership the actuator saw of each job, kept in the journal."""

    def __init__(self, journal: Journal, *, cap: int) -> None:
        self._journal = journal
        self._cap = cap
        self._seen: dict[str, Membership] = {}  # the journal's rows read or written

    def __len__(self) -> int:
        return len(self._seen)

    def get(self, job: str) -> Membership | None:
        seen = self._seen.get(job)
        if seen is None:
            # Not seen since the start, or forgotten here: the status is recorded next,
            # and the job is here again from then on.
            seen = self._journal.membership(job)
            if seen is not None:
                remember(self._seen, job, seen, cap=self._cap)
        return seen

    def record(
        self, status: wire.JobStatus, before: Membership | None, *, now: float = 0.0
    ) -> Membership:
        """Remember what ``status`` says; journaled (saved at ``now``) when it differs
        from ``before`` (None: the first of the job, or of a new run of it) in
        generation, run or members."""
        after = of(status)
        if (
            before is None
            or after.generation != before.generation
            or after.run != before.run
            or after.members != before.members
        ):
            self._journal.save_membership(status.job, after, now=now)
        # After the journal: a failed write changes nothing.
        remember(self._seen, status.job, after, cap=self._cap)
        return after

    def keep_only(self, jobs: Container[str]) -> None:
        """Forget, in memory, the jobs not in ``jobs``; their rows stay in the journal
        until it prunes them (``Journal.prune``)."""
        self._seen = {job: m for job, m in self._seen.items() if job in jobs}


def of(status: wire.JobStatus) -> Membership:
    """The membership ``status`` says its job has."""
    return Membership(
        generation=status.generation, step=status.step, ts=status.ts,
        members={m.rank: m.node for m in status.members}, run=status.run,
    )  # fmt: skip


Since = Literal["next", "late", "new run"]


def since(before: Membership, status: wire.JobStatus) -> Since:
    """What ``status`` is to ``before``, the job's last membership: a ``new run`` of the
    job, a status of this run (``next``), or one older than ``before`` delivered
    ``late``.

    Statuses are ordered by what the job counts, its run, then its generation and step,
    not by their time: each member stamps ``ts`` on its own machine's clock, and a
    restarted job's new rank 0 may run on a machine whose clock is behind the old one's.
    A higher run is a new run whatever its generation, step and time: the usual restart
    starts again at generation 0 from the checkpoint at the step the old run ended on,
    and says so only by its run. A status of the same run whose generation and step did
    not go back is the ``next`` (a tie too: a status sent again). One of the same
    counted run (run 1 or more) whose generation or step went back is late: the
    launcher that counted it would have counted a restart too.

    Only where the counts cannot tell, the time decides, and then only with clocks
    that agree: a status is a new run if it is newer than ``before``, else late. That
    is a lower run (a status of an earlier run, or a job launched again from scratch,
    its launcher counting from 0 again), and run 0 gone back (a runtime from before
    runs, whose statuses carry none and decode as run 0, or a launcher that does not
    count its restarts)."""
    if status.run > before.run:
        return "new run"
    if status.run == before.run:
        if (status.generation, status.step) >= (before.generation, before.step):
            return "next"
        if status.run > 0:
            return "late"
    return "new run" if status.ts > before.ts else "late"


class Moved(NamedTuple):
    """A machine the runtime replaced by itself: its ranks that moved (ascending) from
    ``leaver`` to ``joiner``."""

    ranks: tuple[int, ...]
    leaver: str
    joiner: str


def moved(
    job: str,
    before: Membership,
    after: Membership,
    *,
    switched_to: Collection[str],
    replaced: Mapping[tuple[str, str], str],
) -> list[Moved]:
    """Each machine the runtime replaced by itself between two memberships: ranks now on
    another node, unless a migration of ours put them there (its joiner is in
    ``switched_to``, or ``replaced`` already says so). A machine whose K ranks all moved
    to one new machine is one replacement, not K."""
    if after.generation <= before.generation:
        return []
    found: dict[tuple[str, str], list[int]] = {}
    for rank, node in sorted(after.members.items()):
        old = before.members.get(rank)
        if old is None or old == node or node in switched_to:
            continue
        if replaced.get((job, old)) == node:
            continue  # a migration of ours whose acks came before this status
        found.setdefault((old, node), []).append(rank)
    return [Moved(tuple(ranks), old, new) for (old, new), ranks in found.items()]


def runtime_failover(
    status: wire.JobStatus,
    *,
    ranks: tuple[int, ...],
    leaver: str,
    joiner: str,
    generation: int,
    now: float,
) -> Flight:
    """The record of a failover the runtime did by itself at ``generation`` (machine
    ``leaver``'s ``ranks`` now on ``joiner``), awaiting the donor's ack that carries its
    downtime."""
    runtime_id = f"failover-g{generation}"
    lost = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return Flight(
        # The status's time tells apart runs of a job that restarted (the runtime's
        # generations, and so its failover ids, start over) and is the same when a
        # retained status is delivered again. The first rank names the machine, as it
        # did when every machine had one.
        id=f"{status.job}.{runtime_id}.r{ranks[0]}.t{int(status.ts)}"[-128:],
        job=status.job, leaver=leaver, joiner=joiner, policy=RUNTIME,
        reason=f"the runtime replaced lost {lost} (machine {leaver}) with {joiner}",
        phase="runtime", generation=generation, members=frozenset(), runtime_id=runtime_id,
        deadline=now + RUNTIME_ACK_GRACE_S,
    )  # fmt: skip


class FailoverAcks:
    """The runtime's answers about failovers it did by itself, before their status:
    at most ``MAX_EARLY_ACKS`` of each kind, the oldest forgotten first, and only
    while the view holds their job (``keep_only``)."""

    def __init__(self) -> None:
        self._early: dict[tuple[str, str], wire.Ack] = {}  # (job, runtime id)
        self._rollbacks: dict[tuple[str, str], None] = {}  # (job, runtime id) recorded

    def __len__(self) -> int:
        return len(self._early) + len(self._rollbacks)

    def hold(self, ack: wire.Ack) -> bool:
        """Keep ``ack`` until its status comes; True for the first ``failed`` of that
        failover: the runtime could not replace the machine and rolls back."""
        key = (ack.job, ack.migration_id)
        remember(self._early, key, ack, cap=MAX_EARLY_ACKS)  # past it: acks nobody claimed
        if ack.kind == "failed" and key not in self._rollbacks:  # one per survivor
            # Past the cap a rollback may be recorded twice: a decision only journaled,
            # never asked for (the runtime rolls back by itself).
            remember(self._rollbacks, key, None, cap=MAX_EARLY_ACKS)
            return True
        return False

    def claim(self, job: str, runtime_id: str) -> wire.Ack | None:
        """The answer held for the runtime's failover ``runtime_id``, if one came. It is
        kept for the other machines the same failover replaced (one answer, one id,
        for all of them), until the job's next run."""
        return self._early.get((job, runtime_id))

    def forget(self, job: str) -> None:
        """A new run of ``job`` uses the runtime's ids again."""
        self._early = {k: v for k, v in self._early.items() if k[0] != job}
        self._rollbacks = {k: v for k, v in self._rollbacks.items() if k[0] != job}

    def keep_only(self, jobs: Container[str]) -> None:
        """Forget the answers of jobs not in ``jobs``."""
        self._early = {k: v for k, v in self._early.items() if k[0] in jobs}
        self._rollbacks = {k: v for k, v in self._rollbacks.items() if k[0] in jobs}
