"""``failover``: a machine of a job failed — move its work to a ready standby at once.

Triggers: ``GpuFault``, ``NodeLost`` and ``RankStalled`` (configurable). The machine
is the unit: a finding names a machine (and the GPU at fault, which the reason names),
and the decision replaces the whole machine, every rank of the job on it, with a
standby machine of as many slots. With no such standby the job can only be restarted
from its last checkpoint without the machine: that is decided (``CheckpointRestart``;
the actuator asks the job for it) and journaled as such, not silently dropped.

One decision per (job, node) until the actuator reports that node's migration (or
restart) finished, or that it did not run it (a ``Hold`` naming this policy), or the
job restarted (``JobRestarted``: a new run), or the node is no longer a member of the
job: then the next finding decides again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tmd import wire
from tmd.daemon import events
from tmd.errors import ConfigError
from tmd.plugins import Context
from tmd.policies.base import Policy, jobs_on

TRIGGERS: dict[str, type[events.Finding]] = {
    "GpuFault": events.GpuFault,
    "NodeLost": events.NodeLost,
    "RankStalled": events.RankStalled,
}


@dataclass(frozen=True, kw_only=True)
class FailoverConfig:
    triggers: list[str] = field(default_factory=lambda: sorted(TRIGGERS))

    def validate(self) -> None:
        for name in self.triggers:
            if name not in TRIGGERS:
                raise ConfigError(
                    "policies.failover.triggers",
                    f"unknown finding {name!r} (known: {', '.join(sorted(TRIGGERS))})",
                )


class FailoverPolicy(Policy):
    name = "failover"
    Config = FailoverConfig
    consumes = (
        events.GpuFault,
        events.NodeLost,
        events.RankStalled,
        events.MigrationFinished,
        events.Hold,
        events.JobRestarted,
        wire.JobStatus,
    )
    config: FailoverConfig

    def __init__(self, config: FailoverConfig, *, context: Context) -> None:
        super().__init__(config, context=context)
        self._triggers: tuple[type[events.Finding], ...] = tuple(
            TRIGGERS[n] for n in config.triggers
        )
        self._handled: set[tuple[str, str]] = set()

    def observe(self, event: Any, now: float) -> Iterable[events.Event]:
        if isinstance(event, events.MigrationFinished) or (
            isinstance(event, events.Hold) and event.held == self.name
        ):
            # Finished, or not run (guardrails, no standby yet): the next finding about
            # this machine decides again.
            self._handled.discard((event.job, event.node))
            return ()
        if isinstance(event, events.JobRestarted):
            self._handled = {h for h in self._handled if h[0] != event.job}
            return ()
        if isinstance(event, wire.JobStatus):
            self._forget_left(event)
            return ()
        if not isinstance(event, self._triggers):
            return ()
        return self._decide(event, now)

    def _decide(self, finding: events.Finding, now: float) -> Iterator[events.Event]:
        view = self.context.view
        jobs = [finding.job] if finding.job else jobs_on(view, finding.node)
        cause = getattr(finding, "cause", "") or finding.detail
        where = finding.node
        if isinstance(finding, events.GpuFault):
            where += f" GPU {finding.gpu}"
        why = f"{type(finding).__name__} on {where}" + (f": {cause}" if cause else "")
        for job in jobs:
            if (job, finding.node) in self._handled:
                continue
            self._handled.add((job, finding.node))
            if view.ready_standbys(job, leaver=finding.node):
                yield events.Migrate(
                    ts=now, policy=self.name, job=job, node=finding.node, reason=why
                )
            else:
                seen = view.jobs.get(job)
                slots = seen.slots(finding.node) if seen is not None else 0
                size = f" of {slots} slots" if slots > 1 else ""
                yield events.CheckpointRestart(
                    ts=now,
                    policy=self.name,
                    job=job,
                    node=finding.node,
                    reason=f"{why}; no ready standby{size}, so restart from the last checkpoint",
                )

    def _forget_left(self, status: wire.JobStatus) -> None:
        """Forget the (job, node) pairs whose node is no longer a member of the job: what
        was decided about it is moot, and if it comes back it is decided about anew."""
        ours = [h for h in self._handled if h[0] == status.job]
        if not ours:
            return  # the usual case: no per-member work for a status
        nodes = {m.node for m in status.members}
        self._handled -= {h for h in ours if h[1] not in nodes}
