"""Checkpoint restarts: when the actuator asks a job to restart without a machine.

A policy decides ``CheckpointRestart`` when no standby machine can take a faulty
machine's place. While that machine's processes still run, nothing else will stop the
job, so the actuator asks it to (``wire.Restart`` for the job's current run: checkpoint
at the next boundary, record the machine as excluded, exit for a restart without it).
It does not when the runtime already rolls back by itself (the decision of policy
``runtime``), when the job is not running (already restarting or stopped), when the
machine is no longer a member or the job already goes on without it (its status's
``excluded``), when the machine is lost (``ClusterView.lost``: offline, or a NodeLost
and nothing from its agent since, so its processes cannot be counted on to run and
answer; the runtime replaces or rolls back lost ranks by itself), or when it already
asked this run of the job to go on without the machine.

The restart is then driven like a migration of one phase (``flight``: ``restarting``)
and kept in the ledger; the guardrails decide whether it may run now
(``guardrails.check_restart``).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

from tmd.daemon import events
from tmd.daemon.actuator.flight import Flight
from tmd.daemon.actuator.membership import RUNTIME
from tmd.daemon.view import ClusterView

RUNNING = frozenset({"running", "migrating"})
"""The job states in which its processes run and can be asked to restart."""


def held(
    decision: events.CheckpointRestart,
    *,
    view: ClusterView,
    asked: Mapping[tuple[str, str], str],
) -> str | None:
    """Why no restart may be asked for ``decision`` (before any guardrail), or None.
    ``asked``: (job, node) -> the restart that already asked this run of the job to go
    on without node."""
    job = view.jobs.get(decision.job)
    if job is None or not job.members:
        return f"job {decision.job} has not reported its status"
    if decision.node not in job.members.values():
        return f"{decision.node} is not a member of job {decision.job}"
    if decision.node in job.excluded:
        return f"job {decision.job} already goes on without it (its status excludes it)"
    if job.state not in RUNNING:
        return f"job {decision.job} is {job.state}"
    if view.lost(decision.node):
        return (
            f"{decision.node} is lost (offline, or a NodeLost and nothing from its agent "
            "since): its processes cannot be asked; the runtime replaces or rolls back "
            "lost ranks by itself"
        )
    earlier = asked.get((decision.job, decision.node))
    if earlier is not None:
        return f"job {decision.job} was already asked to restart without it ({earlier})"
    return None


def is_the_runtimes(decision: events.CheckpointRestart) -> bool:
    """A rollback the runtime does by itself: recorded, never asked for."""
    return decision.policy == RUNTIME


def flight(
    decision: events.CheckpointRestart, *, view: ClusterView, now: float, timeout_s: float
) -> Flight:
    """The record of a restart of ``decision.job`` without ``decision.node``, asked now."""
    job = view.jobs[decision.job]
    ranks = job.machines().get(decision.node, [])
    return Flight(
        id=f"r{int(now)}-{secrets.token_hex(4)}",
        job=decision.job,
        leaver=decision.node,
        joiner="",
        policy=decision.policy,
        reason=decision.reason,
        phase="restarting",
        generation=job.generation,
        members=frozenset(job.members.values()),
        deadline=now + timeout_s,
        slots={decision.node: len(ranks)} if len(ranks) > 1 else {},
        run=job.run,
    )
