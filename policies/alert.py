"""``alert``: Alertmanager alerts about a node become failover migrations.

The HTTP receiver (``POST /api/v1/alerts``) turns each alert of a version-4 webhook
into an ``AlertFired``; this policy maps its labels to a node (and optionally a job)
and migrates. Alertmanager resends firing alerts on every group interval, so an alert
is acted on once per (fingerprint, startsAt); resolved alerts change nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tmd.daemon import events
from tmd.plugins import Context
from tmd.policies.base import Policy, jobs_on

MAX_REMEMBERED = 10_000


@dataclass(frozen=True, kw_only=True)
class AlertConfig:
    node_label: str = "node"
    job_label: str = "job"
    # Only these alert names act (empty: any alert that names a node).
    alertnames: list[str] = field(default_factory=list)
    # node_exporter-style "host:9100" instance labels name the node before the colon.
    strip_port: bool = True

    def validate(self) -> None:
        pass


class AlertPolicy(Policy):
    name = "alert"
    Config = AlertConfig
    consumes = (events.AlertFired,)
    config: AlertConfig

    def __init__(self, config: AlertConfig, *, context: Context) -> None:
        super().__init__(config, context=context)
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()

    def observe(self, event: Any, now: float) -> Iterable[events.Event]:
        if event.status != "firing":
            return ()
        if self.config.alertnames and event.name not in self.config.alertnames:
            return ()
        key = (event.fingerprint, event.starts_at)
        if key in self._seen:
            return ()
        self._seen[key] = None
        if len(self._seen) > MAX_REMEMBERED:
            self._seen.popitem(last=False)
        return self._decide(event, now)

    def _decide(self, alert: events.AlertFired, now: float) -> Iterator[events.Event]:
        node = alert.labels.get(self.config.node_label, "")
        if self.config.strip_port:
            node = node.split(":")[0]
        why = f"alert {alert.name} ({alert.fingerprint})"
        if not node:
            yield events.Hold(
                ts=now, policy=self.name, reason=f"{why} has no {self.config.node_label!r} label"
            )
            return
        job = alert.labels.get(self.config.job_label)
        jobs = [job] if job else jobs_on(self.context.view, node)
        if not jobs:
            yield events.Hold(
                ts=now, policy=self.name, node=node, reason=f"{why}: no job runs on {node}"
            )
        for j in jobs:
            if self.context.view.ready_standbys(j, leaver=node):
                yield events.Migrate(ts=now, policy=self.name, job=j, node=node, reason=why)
            else:
                yield events.CheckpointRestart(
                    ts=now,
                    policy=self.name,
                    job=j,
                    node=node,
                    reason=f"{why}; no ready standby, so restart from the last checkpoint",
                )
