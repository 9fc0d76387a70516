"""The policy interface, and what every policy asks of the cluster view."""

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


def ready_standbys(view: ClusterView, job: str) -> list[str]:
    """The job's standbys that reported ready and whose node is not known to be down."""
    j = view.jobs.get(job)
    if j is None:
        return []
    out = []
    for name, standby in sorted(j.standbys.items()):
        node = view.nodes.get(name)
        if standby.state == "ready" and (node is None or node.state != "offline"):
            out.append(name)
    return out
