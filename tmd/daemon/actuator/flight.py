"""One migration in flight, and the phase machine that drives it: pure, on the injected
clock.

The actuator drives the runtime's protocol over MQTT (QoS 1, ``tmd/v1/job/{job}/ctl``):

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

``Flight`` is the record; ``PhaseMachine`` moves it on what arrives (an ack, a status,
the time) and answers with a ``Next``: what the actuator then journals, sends or
emits (``tmd.daemon.actuator.ledger``). Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from tmd import wire
from tmd.config import ActuatorConfig
from tmd.daemon.view import JobView

Phase = Literal["preparing", "switching", "aborting", "runtime"]
Outcome = Literal["done", "aborted", "failed"]

RUNTIME_ACK_GRACE_S = 10.0
"""How long a failover the runtime did by itself waits for its donor's ``switched``
ack (which carries the downtime) before it is journaled without one."""
REPLACED_BY_RUNTIME = "replaced by the runtime's failover"


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

    def keep(self, ack: wire.Ack) -> None:
        """Record a member's answer; a repeat that carries the downtime replaces one that
        did not (the first answer may have been lost, or come from a resend)."""
        key = (ack.kind, ack.node)
        held = self.acks.get(key)
        if held is None or (held.downtime is None and ack.downtime is not None):
            self.acks[key] = ack

    @property
    def after_switch(self) -> frozenset[str]:
        """The members once it switched: the stayers and the joiner."""
        return (self.members - {self.leaver}) | {self.joiner}


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
        return wire.Abort(
            ts=now, job=flight.job, migration_id=flight.id, reason=flight.abort_reason[:1000]
        )

    @staticmethod
    def journaled(flight: Flight, phase: Phase) -> dict[str, Any]:
        """What the journal keeps on entering ``phase``, besides the phase."""
        if phase == "preparing":  # what a resumed migration checks its acks against
            return {"generation": flight.generation, "members": sorted(flight.members)}
        return {}

    # -- what arrives ------------------------------------------------------------------

    def on_ack(self, flight: Flight, ack: wire.Ack, now: float) -> Next:
        flight.keep(ack)
        if flight.phase == "runtime":  # the donor's answer carries the downtime
            return Next("done", REPLACED_BY_RUNTIME) if ack.kind == "switched" else STAY
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
    def on_status(flight: Flight, generation: int, nodes: set[str]) -> Next:
        """A status of the flight's job with these member ``nodes``."""
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
        if flight.switched_by_status:
            return Next("done", "switched (by the job's status); acks missing")
        if flight.phase == "aborting":
            back = job is not None and flight.leaver in job.members.values()
            if back and job is not None and job.state == "running":
                return Next("aborted", flight.abort_reason)
            return Next("failed", "no confirmation of the abort")
        waited = "prepared" if flight.phase == "preparing" else "switched"
        want = set(flight.after_switch if flight.phase == "switching" else flight.members)
        missing = ", ".join(sorted(want - flight.acked(waited))) or "none"
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
        if flight.members <= flight.acked("aborted") | flight.acked("failed"):
            return Next("aborted", flight.abort_reason)
        return STAY


def outcome_record(
    flight: Flight, outcome: Outcome, detail: str = ""
) -> tuple[dict[str, Any], float | None]:
    """What the journal keeps of a finished migration, and its downtime: the worst the
    stayers and the joiner measured (the leaver's own number does not count)."""
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
    return record, downtime
