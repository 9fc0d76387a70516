"""``drain``: operator requests — ``tmd drain NODE`` and ``tmd migrate --job J --node N
[--to S]`` — become migrations, with the operator named in the reason."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from tmd.daemon import events
from tmd.policies.base import Policy, jobs_on


class DrainPolicy(Policy):
    name = "drain"
    consumes = (events.DrainRequested, events.MigrateRequested)

    def observe(self, event: Any, now: float) -> Iterable[events.Event]:
        who = f" by {event.requested_by}" if event.requested_by else ""
        if isinstance(event, events.MigrateRequested):
            return [
                events.Migrate(
                    ts=now,
                    policy=self.name,
                    job=event.job,
                    node=event.node,
                    to=event.to,
                    reason=f"operator migrate{who}",
                )
            ]
        return self._drain(event.node, who, now)

    def _drain(self, node: str, who: str, now: float) -> Iterator[events.Event]:
        jobs = jobs_on(self.context.view, node)
        if not jobs:
            yield events.Hold(
                ts=now, policy=self.name, node=node, reason=f"drain{who}: no job runs on {node}"
            )
        for job in jobs:
            yield events.Migrate(
                ts=now, policy=self.name, job=job, node=node, reason=f"operator drain{who}"
            )
