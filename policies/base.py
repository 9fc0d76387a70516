"""The policy interface, and what every policy asks of the cluster view.

Whether a job has a standby to migrate to is ``ClusterView.ready_standbys``: the same
answer the actuator acts on, so a policy does not decide a migration that the actuator
then holds for want of a standby."""

from __future__ import annotations

from tmd.daemon.view import ClusterView
from tmd.plugins import Plugin


class Policy(Plugin):
    """Consumes findings and requests; emits ``tmd.daemon.events.Decision``s, each with a reason.

    Decisions are wishes: the guardrails (``tmd.daemon.actuator.guardrails``) and the actuator
    decide what is executed, and journal why when it is not."""


def jobs_on(view: ClusterView, node: str) -> list[str]:
    """Jobs that have ``node`` among their members, by the jobs' own status."""
    return sorted(name for name, job in view.jobs.items() if node in job.members.values())
