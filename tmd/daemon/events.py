"""Internal events: what detectors found and what policies decided.

Wire messages (``tmd.wire``) are what arrives; these are what tmd concludes. Facts are
named in the past tense, commands in the imperative. Every event is a frozen struct
with ``ts`` (seconds since the epoch, from the injected clock), so the journal stores
it as JSON and the simulator replays it.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class Event(msgspec.Struct, kw_only=True, frozen=True, tag=True):
    ts: float


class Finding(Event, kw_only=True, frozen=True):
    """Something a detector concluded about a node or a rank."""

    node: str
    job: str = ""
    detail: str = ""


class GpuFault(Finding, kw_only=True, frozen=True):
    """A GPU is unusable: fatal XID, volatile DBE, row-remap failure, fell off the bus."""

    gpu: int
    cause: str


class GpuDegraded(Finding, kw_only=True, frozen=True):
    """A GPU still works but is getting worse: throttling, pending remap, rising errors."""

    gpu: int
    cause: str


class StragglerFound(Finding, kw_only=True, frozen=True):
    slowdown: float  # 0.2 = 20% slower than its peers
    confidence: float
    since_step: int


class StragglerCleared(Finding, kw_only=True, frozen=True):
    pass


class NodeLost(Finding, kw_only=True, frozen=True):
    cause: Literal["last_will", "heartbeat"]


class RankStalled(Finding, kw_only=True, frozen=True):
    rank: int
    last_step: int


class Decision(Event, kw_only=True, frozen=True):
    """What a policy wants done, always with the reason that is journaled."""

    policy: str
    reason: str


class Migrate(Decision, kw_only=True, frozen=True):
    """Replace ``node`` of ``job`` with standby ``to`` (None: the actuator picks)."""

    job: str
    node: str
    to: str | None = None
    when: Literal["now", "next_tick"] = "now"


class Hold(Decision, kw_only=True, frozen=True):
    """Decided to do nothing, and why (journaled so operators see the reasoning)."""

    job: str = ""
    node: str = ""
    held: str = ""  # the policy whose Migrate the actuator did not run (guardrails etc.)


class CheckpointRestart(Decision, kw_only=True, frozen=True):
    """No ready standby can take ``node``'s place: restart ``job`` from its checkpoint
    without it. The actuator asks the job for it (``wire.Restart``) while the machine's
    processes still run; ``policy`` "runtime" records a rollback the runtime does by
    itself, which nobody needs to ask for."""

    job: str
    node: str


class Request(Event, kw_only=True, frozen=True):
    """Something asked of tmd from outside, by an operator or an alert."""

    requested_by: str = ""


class DrainRequested(Request, kw_only=True, frozen=True):
    """Move every job's work off ``node`` (maintenance)."""

    node: str


class MigrateRequested(Request, kw_only=True, frozen=True):
    job: str
    node: str
    to: str | None = None


class AlertFired(Request, kw_only=True, frozen=True):
    """One alert of an Alertmanager webhook (payload version 4)."""

    name: str
    status: Literal["firing", "resolved"]
    fingerprint: str
    starts_at: str
    labels: dict[str, str]


class MigrationFinished(Event, kw_only=True, frozen=True):
    """The actuator's word on a migration, with the downtime the runtime measured; also
    on a checkpoint restart it asked for, with ``to`` empty (nothing takes ``node``'s
    place; ``done``: the job answered that it restarts without it)."""

    migration_id: str
    job: str
    node: str
    to: str
    outcome: Literal["done", "aborted", "failed"]
    downtime_s: float | None = None


class JobRestarted(Event, kw_only=True, frozen=True):
    """A new run of ``job`` started from its checkpoint (its run counted up, or its
    generation and step went back), as its status showed the actuator: what was decided
    about the old run's machines is moot."""

    job: str
    generation: int
    step: int
    run: int = 0  # the new run's count (``wire.JobStatus.run``)


ALL: tuple[type[Event], ...] = (
    GpuFault,
    GpuDegraded,
    StragglerFound,
    StragglerCleared,
    NodeLost,
    RankStalled,
    Migrate,
    Hold,
    CheckpointRestart,
    DrainRequested,
    MigrateRequested,
    AlertFired,
    MigrationFinished,
    JobRestarted,
)
