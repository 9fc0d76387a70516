"""The actuator: turns ``Migrate`` decisions into live migrations of running jobs, and
``CheckpointRestart`` decisions into restarts the jobs are asked for.

One concern per module:

- ``flight``: the flight record and the pure phase machine of the migration protocol;
- ``ledger``: the migrations in flight and their record (journal, metrics, events);
- ``membership``: each job's membership, and the failovers and restarts it reveals;
- ``resume``: resuming, after a restart, what the journal holds in flight;
- ``standby``: which standby takes a leaver's place;
- ``restart``: when a job is asked to restart without a machine, and that restart's flight;
- ``guardrails``: the limits on what may run at all;
- ``shell``: the ``Actuator`` that composes them, and its asyncio loop.
"""

from __future__ import annotations

from tmd.daemon.actuator.flight import RUNTIME_ACK_GRACE_S, Flight, Outcome, Phase
from tmd.daemon.actuator.ledger import SOURCE
from tmd.daemon.actuator.shell import TICK_S, Actuator, Publish

__all__ = [
    "RUNTIME_ACK_GRACE_S",
    "SOURCE",
    "TICK_S",
    "Actuator",
    "Flight",
    "Outcome",
    "Phase",
    "Publish",
]
