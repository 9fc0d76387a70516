"""Standby choice: which standby takes a leaver's place, or why none may.

Whether a standby is ready at all is the cluster view's to say
(``ClusterView.ready_standbys``: ready in the job's own status, its node not offline,
no GPU fault or loss since its agent last reported, as many slots as the leaver has
ranks in the job, the leaver's GPU model), the same
answer the policies got when they decided. Here are only what the actuator knows on
top: a standby already joining another migration is taken, an operator may name the
one to use, and the fastest to warm up goes first.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import NamedTuple

from tmd.daemon import events
from tmd.daemon.actuator.flight import Flight
from tmd.daemon.view import ClusterView


class Choice(NamedTuple):
    standbys: list[str]  # who may take the leaver's place, best first
    held: str | None = None  # why the decision cannot run, before any guardrail


def ranked(view: ClusterView, job: str, leaver: str) -> list[str]:
    """The job's ready standbys for ``leaver``, fastest warm-up first (unknown last)."""
    infos = view.jobs[job].standbys

    def warmup(name: str) -> float:
        warmup_s = infos[name].warmup_s
        return warmup_s if warmup_s is not None else float("inf")

    return sorted(view.ready_standbys(job, leaver=leaver), key=lambda n: (warmup(n), n))


def choose(
    decision: events.Migrate,
    *,
    view: ClusterView,
    flights: Collection[Flight],
    replaced: Mapping[tuple[str, str], str],
) -> Choice:
    """The standbys that may take ``decision.node``'s place, or why the decision is held."""
    job = view.jobs.get(decision.job)
    members = set(job.members.values()) if job is not None else set()
    if job is None or not members:
        return Choice([], f"job {decision.job} has not reported its status")
    migrations = [f for f in flights if not f.is_restart]  # a restart's guardrail says why
    if any(f.job == decision.job and f.leaver == decision.node for f in migrations):
        return Choice([], "it is already being migrated")
    if decision.node not in members:
        by = replaced.get((decision.job, decision.node))
        if by:
            return Choice([], f"already replaced by {by}")
        return Choice([], f"{decision.node} is not a member of job {decision.job}")
    taken = {f.joiner for f in migrations}
    candidates = [s for s in ranked(view, decision.job, decision.node) if s not in taken]
    if decision.to is not None:
        if decision.to not in candidates:
            return Choice([], f"standby {decision.to} is not ready for job {decision.job}")
        candidates = [decision.to]
    return Choice(candidates)
