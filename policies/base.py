"""The policy interface, and what every policy asks of the cluster view.

Whether a job has a standby to migrate to is ``ClusterView.ready_standbys``: the same
answer the actuator acts on, so a policy does not decide a migration that the actuator
then holds for want of a standby."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tmd.daemon import events
from tmd.daemon.view import ClusterView, JobView
from tmd.plugins import Plugin


class Policy(Plugin):
    """Consumes findings and requests; emits ``tmd.daemon.events.Decision``s, each with a reason.

    Decisions are wishes: the guardrails (``tmd.daemon.actuator.guardrails``) and the actuator
    decide what is executed, and journal why when it is not."""


def jobs_on(view: ClusterView, node: str) -> list[str]:
    """Jobs that have ``node`` among their members, by the jobs' own status."""
    return sorted(name for name, job in view.jobs.items() if node in job.members.values())


@dataclass
class Straggler:
    since: float  # when it was found
    slowdown: float


class Stragglers:
    """Each job's slow machines as the straggler detector reported them, what the
    policies that replace stragglers (``rebalance``, ``fpi``) decide about: found,
    cleared, gone once its migration finished done or it left the job another way."""

    # The events ``observe`` reads.
    consumes = (events.StragglerFound, events.StragglerCleared, events.MigrationFinished)

    def __init__(self) -> None:
        self.by_key: dict[tuple[str, str], Straggler] = {}  # (job, node)

    def observe(self, event: Any, now: float) -> None:
        key = (event.job, event.node)
        if isinstance(event, events.StragglerFound):
            self.by_key[key] = Straggler(now, event.slowdown)
        elif isinstance(event, events.StragglerCleared):
            self.by_key.pop(key, None)
        elif isinstance(event, events.MigrationFinished) and event.outcome == "done":
            self.by_key.pop(key, None)  # the machine left the job
        # An aborted or failed migration left the machine in the job, as slow as it
        # was and flagged once (the detector does not find it again): kept, so a later
        # tick tries again. Found by ``tmd sim``: a runtime failover elsewhere in the
        # job aborts a planned move.

    def present(self, jobs: Mapping[str, JobView]) -> list[tuple[tuple[str, str], Straggler]]:
        """Those whose machine is still a member of its job in ``jobs`` (the view's),
        changing nothing: what ``/metrics`` exports between two ``forget_gone``.
        O(flagged + the members of their jobs): each job's machines are gathered once."""
        machines: dict[str, set[str]] = {}
        out = []
        for key, straggler in self.by_key.items():
            job = jobs.get(key[0])
            if job is None:
                continue
            members = machines.get(key[0])
            if members is None:
                members = machines[key[0]] = set(job.members.values())
            if key[1] in members:
                out.append((key, straggler))
        return out

    def forget_gone(self, jobs: Mapping[str, JobView]) -> None:
        """Forget those whose machine left its job another way (the runtime's failover
        replaced it, the job restarted without it), and those of jobs no longer in
        ``jobs`` (the view forgot them)."""
        self.by_key = dict(self.present(jobs))
