"""``rebalance``: every N minutes, replace each job's worst persistent straggler when
the time it is expected to save outweighs what the migration is expected to cost.

A straggler slows the whole data-parallel job by its slowdown ``s``: over a horizon
``H`` the job loses ``H * s / (1 + s)`` of wall time to it. A migration costs its
downtime, taken as the median of the downtimes the runtime measured on this cluster
(``MigrationFinished``), or a prior until there are some, times a safety factor.
Hysteresis: a straggler must have persisted ``persist_s`` before it is replaced.
Every tick journals what was decided for each job with a straggler, migrate or hold,
with the numbers.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from tmd.daemon import events
from tmd.errors import ConfigError
from tmd.plugins import Context
from tmd.policies.base import Policy, Straggler, Stragglers


@dataclass(frozen=True, kw_only=True)
class RebalanceConfig:
    interval_min: float = 10.0
    horizon_min: float = 60.0
    persist_s: float = 60.0
    prior_downtime_s: float = 5.0  # until the runtime has measured some
    safety_factor: float = 2.0

    def validate(self) -> None:
        for key in ("interval_min", "horizon_min", "prior_downtime_s", "safety_factor"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"policies.rebalance.{key}", "must be > 0")
        if self.persist_s < 0:
            raise ConfigError("policies.rebalance.persist_s", "must be >= 0")


class RebalancePolicy(Policy):
    name = "rebalance"
    Config = RebalanceConfig
    consumes = (events.StragglerFound, events.StragglerCleared, events.MigrationFinished)
    config: RebalanceConfig

    def __init__(self, config: RebalanceConfig, *, context: Context) -> None:
        super().__init__(config, context=context)
        self.tick_interval = timedelta(minutes=config.interval_min)  # type: ignore[misc]
        self._stragglers = Stragglers()
        self._downtimes: deque[float] = deque(maxlen=32)

    def observe(self, event: Any, now: float) -> Iterable[events.Event]:
        self._stragglers.observe(event, now)  # an aborted move's is kept, to try again
        done = isinstance(event, events.MigrationFinished) and event.outcome == "done"
        if done and event.downtime_s is not None:
            self._downtimes.append(event.downtime_s)
        return ()

    def expected_cost_s(self) -> float:
        measured = statistics.median(self._downtimes) if self._downtimes else None
        # A measured downtime can be slightly negative (cheaper than step noise): free.
        base = max(0.0, measured) if measured is not None else self.config.prior_downtime_s
        return base * self.config.safety_factor

    def tick(self, now: float) -> Iterable[events.Event]:
        self._stragglers.forget_gone(self.context.view.jobs)
        by_job: dict[str, list[tuple[str, Straggler]]] = {}
        for (job, node), s in self._stragglers.by_key.items():
            by_job.setdefault(job, []).append((node, s))
        for job, stragglers in sorted(by_job.items()):
            yield from self._decide(job, stragglers, now)

    def _decide(
        self, job: str, stragglers: list[tuple[str, Straggler]], now: float
    ) -> Iterator[events.Event]:
        cfg = self.config
        ripe = [(n, s) for n, s in stragglers if now - s.since >= cfg.persist_s]
        if not ripe:
            yield events.Hold(
                ts=now,
                policy=self.name,
                job=job,
                reason=f"stragglers younger than {cfg.persist_s:g} s",
            )
            return
        node, worst = max(ripe, key=lambda x: x[1].slowdown)
        horizon_s = cfg.horizon_min * 60
        saving = horizon_s * worst.slowdown / (1 + worst.slowdown)
        cost = self.expected_cost_s()
        numbers = (
            f"{node} {worst.slowdown:+.0%} for {now - worst.since:.0f} s: saves "
            f"~{saving:.0f} s per {cfg.horizon_min:g} min vs ~{cost:.1f} s downtime"
        )
        if saving <= cost:
            yield events.Hold(
                ts=now, policy=self.name, job=job, node=node, reason=f"not worth it: {numbers}"
            )
        elif not self.context.view.ready_standbys(job, leaver=node):
            yield events.Hold(
                ts=now, policy=self.name, job=job, node=node, reason=f"no ready standby: {numbers}"
            )
        else:
            yield events.Migrate(ts=now, policy=self.name, job=job, node=node, reason=numbers)
