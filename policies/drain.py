"""``drain``: operator requests — ``tmd drain NODE`` and ``tmd migrate --job J --node N
[--to S]`` — become migrations, with the operator named in the reason.

A drain is kept until it is carried out, as a drained node stays cordoned until it is
empty. While the machine still runs ranks of a job, a decision the actuator did not
run (a ``Hold`` naming this policy: another migration of the job in flight, no ready
standby yet, a guardrail) or a migration that did not finish (``aborted``,
``failed``) is decided again at a later tick: ``retry_s`` after the first, the wait
doubling each time up to ``retry_max_s``. The drain of a machine in a job is forgotten
once its migration is done or the machine runs no rank of that job (the runtime
replaced it, the job restarted without it). A second drain of the same machine starts
it over. Drains are held in memory: a restarted daemon has forgotten them (drain
again). In dry run every retry is journaled as another held decision, at most one per
``retry_max_s``. ``tmd migrate`` is one request, decided once. Found by ``tmd sim
--live``: a drain that met another migration in flight was held and then lost.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from tmd.daemon import events
from tmd.errors import ConfigError
from tmd.plugins import Context
from tmd.policies.base import Policy, jobs_on

MAX_DRAINS = 4096
"""Drains kept at once (job, machine); past it the oldest is forgotten."""


@dataclass(frozen=True, kw_only=True)
class DrainConfig:
    retry_s: float = 10.0
    retry_max_s: float = 300.0

    def validate(self) -> None:
        if not self.retry_s > 0:
            raise ConfigError("policies.drain.retry_s", "must be > 0")
        if not self.retry_max_s >= self.retry_s:
            raise ConfigError("policies.drain.retry_max_s", "must be >= retry_s")


@dataclass
class _Drain:
    who: str
    wait_s: float  # before the next decision, once one was not carried out
    due: float | None = None  # when to decide again; None while a decision is out
    last: str = ""  # why the last was not carried out


class DrainPolicy(Policy):
    name = "drain"
    Config = DrainConfig
    consumes = (
        events.DrainRequested,
        events.MigrateRequested,
        events.Hold,
        events.MigrationFinished,
    )
    config: DrainConfig

    def __init__(self, config: DrainConfig | None, *, context: Context) -> None:
        config = config or DrainConfig()
        super().__init__(config, context=context)
        # Ticks at half the wait, so that a retry comes at most half a wait late.
        self.tick_interval = timedelta(seconds=config.retry_s / 2)  # type: ignore[misc]
        self._drains: dict[tuple[str, str], _Drain] = {}

    def observe(self, event: Any, now: float) -> Iterable[events.Event]:
        if isinstance(event, events.Hold):
            if event.held == self.name:
                self._not_done((event.job, event.node), event.reason, now)
            return ()
        if isinstance(event, events.MigrationFinished):
            key = (event.job, event.node)
            if event.outcome == "done":
                self._drains.pop(key, None)
            else:
                self._not_done(key, f"the migration ended {event.outcome}", now)
            return ()
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
            self._drains.pop((job, node), None)  # a new drain starts over, and is newest
            self._drains[(job, node)] = _Drain(who=who, wait_s=self.config.retry_s)
            while len(self._drains) > MAX_DRAINS:
                del self._drains[next(iter(self._drains))]
            yield events.Migrate(
                ts=now, policy=self.name, job=job, node=node, reason=f"operator drain{who}"
            )

    def _not_done(self, key: tuple[str, str], why: str, now: float) -> None:
        drain = self._drains.get(key)
        if drain is None or drain.due is not None:
            return  # not ours, or already waiting
        drain.due = now + drain.wait_s
        drain.wait_s = min(drain.wait_s * 2, self.config.retry_max_s)
        drain.last = why

    def tick(self, now: float) -> Iterable[events.Event]:
        jobs = self.context.view.jobs
        for key, drain in list(self._drains.items()):
            job, node = key
            if job not in jobs or node not in jobs[job].members.values():
                del self._drains[key]  # it left the job another way: nothing to drain
                continue
            if drain.due is None or now < drain.due:
                continue
            drain.due = None
            yield events.Migrate(
                ts=now, policy=self.name, job=job, node=node,
                reason=f"operator drain{drain.who}, again (the last: {drain.last})",
            )  # fmt: skip
