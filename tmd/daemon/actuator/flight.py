"""One migration in flight, and the phase machine that drives it: pure, on the injected
clock.

The actuator drives the runtime's protocol over MQTT (QoS 1, ``tmd/v1/job/{job}/ctl``):

    planned -> preparing  Prepare sent; every member answers ``prepared`` (its next
                          group, the joiner included, is built)
            -> switching  Switch sent; the stayers and the joiner answer ``switched``,
                          each with the downtime it measured
            -> done       MigrationFinished(outcome="done", downtime_s=...)

The unit is the machine: a member is a machine of K ranks, one process each, and the
joiner a standby machine of as many slots. Every process answers for itself (``Ack``
with its ``local_rank``), so a machine is prepared, switched or aborted once all K of
its processes said so (``Flight.acked``); one process's ``failed`` or ``aborted``
speaks for the whole migration.

A ``failed`` answer, or a phase that outlives its timeout, sends ``Abort`` (state
``aborting``); the members' ``aborted`` answers end it as ``aborted``. While it waits
the actuator sends the current command again every ``actuator.resend_s``, with the
same migration id: the runtime acts on a command once and answers a repeat with
where it stands, so a lost message or a restarted daemon costs a retry, never a
second migration. The job's retained status is the other source of truth: a
generation that put the joiner in the leaver's place means the switch happened, even
if the acks were lost.

A checkpoint restart is a flight too, of one phase (``restarting``): ``Restart`` sent
until the job answers ``restarting`` (any one process: rank 0 writes the checkpoint),
its status says it is restarting, or a new run of it starts -> ``done``; its status
says it stopped (it ended without restarting), or the machine left the job without a
new run -> ``aborted``; no answer within ``actuator.switch_timeout_s`` -> ``failed``.
It has no joiner, and names the run of the job it is for (``Flight.run``).

``Flight`` is the record; ``PhaseMachine`` moves it on what arrives (an ack, a status,
the time) and answers with a ``Next``: what the actuator then journals, sends or
emits (``tmd.daemon.actuator.ledger``). Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from tmd import wire
from tmd.config import ActuatorConfig
from tmd.daemon.view import JobView

Phase = Literal["preparing", "switching", "aborting", "runtime", "restarting"]
Outcome = Literal["done", "aborted", "failed"]

RUNTIME_ACK_GRACE_S = 10.0
"""How long a failover the runtime did by itself waits for its donor's ``switched``
ack (which carries the downtime) before it is journaled without one."""
REPLACED_BY_RUNTIME = "replaced by the runtime's failover"
RESTART = "restart"
"""The journaled ``kind`` of a checkpoint restart's row (a migration's has none)."""


AckKey = tuple[str, str, int | None]
"""(kind, node, local rank): one process's answer; local rank None is the machine's
only process (a runtime from before machines)."""


@dataclass
class Flight:
    """One migration the actuator is driving (or, phase ``runtime``, recording; phase
    ``restarting``: a checkpoint restart without ``leaver``, no joiner)."""

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
    slots: dict[str, int] = field(default_factory=dict)
    """node -> its processes (ranks) when it started, the joiner taking the leaver's;
    a node not named has one (a flight journaled before machines had local ranks)."""
    acks: dict[AckKey, wire.Ack] = field(default_factory=dict)
    switched_by_status: bool = False
    runtime_id: str = ""  # the runtime's own id of a failover it did by itself
    run: int | None = None
    """A restart's: the run of the job it is for (``wire.JobStatus.run``; None: journaled
    before runs were counted, any run)."""

    def slots_of(self, node: str) -> int:
        return self.slots.get(node, 1)

    def answered(self, kind: str, node: str, *, also: str = "") -> int:
        """How many of ``node``'s processes answered ``kind`` (or ``also``)."""
        return len({local for k, n, local in self.acks if n == node and k in (kind, also)})

    def acked(self, kind: str, *, also: str = "") -> set[str]:
        """The nodes all of whose processes answered ``kind`` (or ``also``)."""
        seen: dict[str, set[int | None]] = {}
        for k, node, local in self.acks:
            if k in (kind, also):
                seen.setdefault(node, set()).add(local)
        return {node for node, procs in seen.items() if len(procs) >= self.slots_of(node)}

    def keep(self, ack: wire.Ack) -> None:
        """Record a process's answer; a repeat that carries the downtime replaces one that
        did not (the first answer may have been lost, or come from a resend)."""
        key = (ack.kind, ack.node, ack.local_rank)
        held = self.acks.get(key)
        if held is None or (held.downtime is None and ack.downtime is not None):
            self.acks[key] = ack

    @property
    def after_switch(self) -> frozenset[str]:
        """The members once it switched: the stayers and the joiner."""
        return (self.members - {self.leaver}) | {self.joiner}

    @property
    def is_restart(self) -> bool:
        return self.phase == "restarting"


def machine_slots(
    machines: Mapping[str, Sequence[int]], leaver: str, joiner: str
) -> dict[str, int]:
    """Each machine's processes, from its ranks (``JobView.machines``); the joiner has
    as many as the leaver it replaces. Machines of one rank are left out (the default)."""
    slots = {node: len(ranks) for node, ranks in machines.items() if len(ranks) != 1}
    k = slots.get(leaver) or slots.get(joiner) or 1
    for node in (leaver, joiner):
        if not node:
            continue
        if k != 1:
            slots[node] = k
        else:
            slots.pop(node, None)
    return slots


class Next(NamedTuple):
    """What the actuator does after a step of the machine.

    ``none``; ``resend`` the current command; ``abort`` (``detail``: why); ``switch``:
    everyone is prepared, journal it and send the switch; ``switched``: the job's status
    shows the joiner in the leaver's place; or end as ``done``, ``aborted`` or
    ``failed`` (``detail`` is journaled with the outcome)."""

    action: Literal["none", "resend", "abort", "switch", "switched", "done", "aborted", "failed"]
    detail: str = ""


STAY = Next("none")


@dataclass(frozen=True)
class PhaseMachine:
    """The protocol's decisions, as functions of a flight, what arrived and the time."""

    config: ActuatorConfig

    def timeout_s(self, phase: Phase) -> float:
        c = self.config
        return {
            "preparing": c.prepare_timeout_s,
            "switching": c.switch_timeout_s,
            "aborting": c.abort_timeout_s,
            "runtime": RUNTIME_ACK_GRACE_S,
            "restarting": c.switch_timeout_s,
        }[phase]

    def set_phase(self, flight: Flight, phase: Phase, now: float) -> None:
        flight.phase = phase
        flight.deadline = now + self.timeout_s(phase)

    def command(self, flight: Flight, now: float) -> wire.Message:
        """The command of the flight's phase, due again ``resend_s`` from now."""
        flight.next_send = now + self.config.resend_s
        if flight.phase == "preparing":
            return wire.Prepare(
                ts=now, job=flight.job, migration_id=flight.id, leaver=flight.leaver,
                joiner=flight.joiner, deadline_s=self.config.prepare_timeout_s,
            )  # fmt: skip
        if flight.phase == "switching":
            return wire.Switch(ts=now, job=flight.job, migration_id=flight.id)
        if flight.phase == "restarting":
            return wire.Restart(
                ts=now, job=flight.job, migration_id=flight.id, node=flight.leaver,
                reason=flight.reason[:1000], run=flight.run,
            )  # fmt: skip
        return wire.Abort(
            ts=now, job=flight.job, migration_id=flight.id, reason=flight.abort_reason[:1000]
        )

    @staticmethod
    def journaled(flight: Flight, phase: Phase) -> dict[str, Any]:
        """What the journal keeps on entering ``phase``, besides the phase."""
        if phase == "preparing":  # what a resumed migration checks its acks against
            return {
                "generation": flight.generation, "members": sorted(flight.members),
                "slots": dict(sorted(flight.slots.items())),
            }  # fmt: skip
        if phase == "restarting":  # what tells a restart's row from a migration's
            return {"kind": RESTART, "generation": flight.generation, "run": flight.run}
        return {}

    # -- what arrives ------------------------------------------------------------------

    def on_ack(self, flight: Flight, ack: wire.Ack, now: float) -> Next:
        if flight.phase == "runtime":  # the donor's answer carries the downtime
            # It has no members to check an answer against: only the one that ends it
            # is kept, so answers from anyone cannot pile up on it.
            if ack.kind != "switched":
                return STAY
            flight.keep(ack)
            return Next("done", REPLACED_BY_RUNTIME)
        flight.keep(ack)
        if flight.phase == "restarting":
            # One answer is enough: rank 0 writes the checkpoint, and every process
            # checkpoints and exits on the same command.
            who = f"{ack.node}" + (f" rank {ack.rank}" if ack.rank is not None else "")
            if ack.kind == "restarting":
                return Next("done", f"{who} answered restarting")
            if ack.kind == "failed":
                return Next("failed", f"{who} failed: {ack.detail}")
            return STAY
        if ack.kind == "failed" and flight.phase in ("preparing", "switching"):
            return Next("abort", f"{ack.node} failed: {ack.detail}")
        if ack.kind == "failed" and flight.phase == "aborting":
            return self.if_aborted(flight)  # a refuser's answer may be the last one
        if ack.kind == "aborted":
            if flight.phase != "aborting":
                # A member aborted on its own (the joiner died, a member failed): the
                # migration is over for everyone, since the vote is collective.
                flight.abort_reason = flight.abort_reason or f"{ack.node}: {ack.detail}"
                self.set_phase(flight, "aborting", now)
            return self.if_aborted(flight)
        # A member is prepared once its next group is built, which takes the joiner:
        # the members' acks imply the joiner's (which a resumed migration may never
        # get again: a prepared joiner waits for its state, not for commands).
        if (
            ack.kind == "prepared"
            and flight.phase == "preparing"
            and flight.members <= flight.acked("prepared")
        ):
            return Next("switch")
        if ack.kind == "switched":
            # The prepared acks were lost, or the switch beat an abort sent on a
            # timeout (the runtime answers that abort with "already switched"):
            # either way the switch is what happened.
            if flight.phase != "switching":
                self.set_phase(flight, "switching", now)
            return self.if_switched(flight)
        return STAY

    @staticmethod
    def on_status(
        flight: Flight, generation: int, nodes: set[str], *, state: str = "running"
    ) -> Next:
        """A status of the flight's job with these member ``nodes``, in ``state``."""
        if flight.phase == "restarting":
            # A new run (the usual end: the job restarted without the machine) is the
            # actuator's to see first (``membership.since``); what is left here is the
            # same run.
            if state == "restarting":
                return Next("done", "the job's status says restarting")
            if state == "stopped":
                return Next("aborted", "the job stopped")
            if flight.leaver not in nodes:
                return Next(
                    "aborted",
                    f"{flight.leaver} left the job in generation {generation} without a "
                    "restart (the runtime replaced it, or went on without it)",
                )
            return STAY
        if flight.phase == "runtime" or generation <= flight.generation:
            return STAY
        if flight.joiner in nodes and flight.leaver not in nodes:
            flight.switched_by_status = True
            return Next("switched")
        if flight.switched_by_status:
            return STAY  # it switched: a later change of members does not undo that
        if flight.phase != "aborting":
            # The membership changed under this migration (the runtime replaced a
            # dead rank, which ends any planned migration): it cannot go on.
            return Next("aborted", "the job's membership changed")
        return STAY

    def on_tick(self, flight: Flight, now: float, job: JobView | None) -> Next:
        """Timeouts and resends; ``job`` is the flight's job in the view, if known."""
        if flight.phase == "runtime":
            return Next("done", REPLACED_BY_RUNTIME) if now >= flight.deadline else STAY
        if now >= flight.deadline:
            return self._timed_out(flight, job)
        if now >= flight.next_send:
            return Next("resend")
        return STAY

    def _timed_out(self, flight: Flight, job: JobView | None) -> Next:
        if flight.phase == "restarting":
            return Next(
                "failed", f"no answer to the restart within {self.timeout_s('restarting'):g} s"
            )
        if flight.switched_by_status:
            return Next("done", "switched (by the job's status); acks missing")
        if flight.phase == "aborting":
            back = job is not None and flight.leaver in job.members.values()
            if back and job is not None and job.state == "running":
                return Next("aborted", flight.abort_reason)
            return Next("failed", "no confirmation of the abort")
        waited = "prepared" if flight.phase == "preparing" else "switched"
        want = set(flight.after_switch if flight.phase == "switching" else flight.members)
        missing = ", ".join(_missing(flight, waited, want)) or "none"
        return Next("abort", f"timed out waiting for {waited} from {missing}")

    # -- whether it is over ------------------------------------------------------------

    @staticmethod
    def if_switched(flight: Flight) -> Next:
        if flight.phase == "switching" and flight.after_switch <= flight.acked("switched"):
            return Next("done")
        return STAY

    @staticmethod
    def if_aborted(flight: Flight) -> Next:
        # A member that refused the prepare ("failed") never joined the migration.
        if flight.members <= flight.acked("aborted", also="failed"):
            return Next("aborted", flight.abort_reason)
        return STAY


def _missing(flight: Flight, kind: str, want: set[str]) -> list[str]:
    """The nodes in ``want`` not all of whose processes answered ``kind``, a machine of
    several with how many did."""
    out = []
    for node in sorted(want - flight.acked(kind)):
        k = flight.slots_of(node)
        out.append(f"{node} ({flight.answered(kind, node)} of {k})" if k > 1 else node)
    return out


def outcome_record(
    flight: Flight, outcome: Outcome, detail: str = ""
) -> tuple[dict[str, Any], float | None]:
    """What the journal keeps of a finished migration, and its downtime: the worst any
    process of the stayers and the joiner measured (the leaver's own number does not
    count); the median is over those processes too."""
    downtimes = [
        ack.downtime
        for (kind, node, _), ack in flight.acks.items()
        if kind == "switched" and ack.downtime is not None and node != flight.leaver
    ]
    downtime = max((d.total_s for d in downtimes), default=None)
    record: dict[str, Any] = {"outcome": outcome}
    if detail:
        record["detail"] = detail
    if downtime is not None:
        median = statistics.median(d.total_s for d in downtimes)
        worst = max(downtimes, key=lambda d: d.total_s)
        record.update(
            downtime_s=downtime, downtime_median_s=median,
            breakdown={"stop_s": worst.stop_s, "transfer_s": worst.transfer_s,
                       "switch_s": worst.switch_s, "first_step_s": worst.first_step_s},
        )  # fmt: skip
    return record, downtime
