"""Guardrails around every policy: what may actually be executed.

Applied by the actuator to each ``Migrate`` before it runs, whatever policy wanted
it: at most ``max_concurrent_per_job`` migrations in flight per job; a cooldown per
node; a cluster-wide rate limit per hour; planned migrations (every policy but
failover) keep ``min_standby_pool`` ready standbys in the job, while failover may
use the last one, since a dead machine is worse than an empty pool; and dry-run,
which journals every decision and executes none. A checkpoint restart is disruptive
too (``check_restart``): dry-run holds it, a job never migrates and restarts at once,
whichever came first, and a job is asked to restart without a machine at most once per
``node_cooldown_s`` (a machine that fails again in the next run does not make a restart
loop). ``check`` and ``check_restart`` are pure functions of the decision and the state
they are given.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tmd.config import GuardrailsConfig
from tmd.daemon import events

URGENT_POLICIES = frozenset({"failover", "alert"})
UNBUDGETED_POLICIES = frozenset({"runtime"})
"""Not the daemon's decisions: a failover the job's runtime did on its own is recorded
(and cools its machine down) but not counted against ``max_per_hour``, which bounds
what the daemon starts; a job's status, forged or not, cannot spend that budget."""
DRY_RUN = "dry run: decisions are journaled, nothing is executed"


@dataclass
class GuardState:
    """What the actuator knows: migrations in flight and recently started."""

    in_flight: dict[str, int] = field(default_factory=dict)  # job -> count
    restarting: dict[str, str] = field(default_factory=dict)  # job -> its restart's id
    last_on_node: dict[str, float] = field(default_factory=dict)  # node -> start time
    # (job, node) -> when the job was last asked to restart without node
    last_restart: dict[tuple[str, str], float] = field(default_factory=dict)
    started: deque[float] = field(default_factory=deque)  # start times, last hour

    def record_start(self, decision: events.Migrate, now: float) -> None:
        self.in_flight[decision.job] = self.in_flight.get(decision.job, 0) + 1
        self.last_on_node[decision.node] = now
        if decision.policy not in UNBUDGETED_POLICIES:
            self.started.append(now)

    def prune(self, now: float, *, cooldown_s: float) -> None:
        """Forget what no longer holds anything back: cooldowns older than
        ``cooldown_s`` (``guardrails.node_cooldown_s``) and starts older than an hour.
        What is in flight is kept: it leaves when its migration or restart ends."""
        self.last_on_node = {n: t for n, t in self.last_on_node.items() if now - t < cooldown_s}
        self.last_restart = {k: t for k, t in self.last_restart.items() if now - t < cooldown_s}
        _drop_before(self.started, now - 3600)

    def record_end(self, job: str) -> None:
        left = self.in_flight.get(job, 0) - 1
        if left > 0:
            self.in_flight[job] = left
        else:
            self.in_flight.pop(job, None)


def check(
    decision: events.Migrate,
    *,
    config: GuardrailsConfig,
    state: GuardState,
    ready_standbys: int,
    now: float,
) -> str | None:
    """Why ``decision`` must not run now, or None if it may."""
    _drop_before(state.started, now - 3600)
    if config.dry_run:
        return DRY_RUN
    restart = state.restarting.get(decision.job)
    if restart is not None:
        return f"job {decision.job} is restarting from its checkpoint ({restart})"
    if state.in_flight.get(decision.job, 0) >= config.max_concurrent_per_job:
        return (
            f"job {decision.job} already has {state.in_flight[decision.job]} migration(s) "
            f"in flight (guardrails.max_concurrent_per_job = "
            f"{config.max_concurrent_per_job})"
        )
    last = state.last_on_node.get(decision.node)
    if last is not None and now - last < config.node_cooldown_s:
        return (
            f"node {decision.node} was migrated {now - last:.0f} s ago "
            f"(guardrails.node_cooldown_s = {config.node_cooldown_s:g})"
        )
    if len(state.started) >= config.max_per_hour:
        return f"{len(state.started)} migrations in the last hour (guardrails.max_per_hour)"
    if ready_standbys == 0:
        return "no ready standby"
    urgent = decision.policy in URGENT_POLICIES
    if not urgent and ready_standbys <= config.min_standby_pool:
        return (
            f"{ready_standbys} ready standby(s) left and planned migrations keep "
            f"{config.min_standby_pool} (guardrails.min_standby_pool)"
        )
    return None


def check_restart(
    decision: events.CheckpointRestart,
    *,
    config: GuardrailsConfig,
    state: GuardState,
    now: float,
) -> str | None:
    """Why the checkpoint restart ``decision`` asks for must not be asked now, or None.
    The rate limit and node cooldown of migrations do not apply (a restart is what is
    left when no migration can run); a restart has its own cooldown per (job, node), as
    long as ``node_cooldown_s``."""
    if config.dry_run:
        return DRY_RUN
    job = decision.job
    if job in state.restarting:
        return f"job {job} is already restarting ({state.restarting[job]})"
    if state.in_flight.get(job, 0):
        return f"job {job} has {state.in_flight[job]} migration(s) in flight"
    last = state.last_restart.get((job, decision.node))
    if last is not None and now - last < config.node_cooldown_s:
        return (
            f"job {job} was asked to restart without {decision.node} {now - last:.0f} s ago "
            f"(guardrails.node_cooldown_s = {config.node_cooldown_s:g})"
        )
    return None


def _drop_before(started: deque[float], horizon: float) -> None:
    while started and started[0] < horizon:
        started.popleft()
