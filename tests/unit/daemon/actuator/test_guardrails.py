"""Guardrails: a pure check of each migration against the configured limits."""

from __future__ import annotations

import pytest

from tmd.config import GuardrailsConfig
from tmd.daemon import events
from tmd.daemon.actuator.guardrails import GuardState, check, check_restart
from tmd.errors import ConfigError

T0 = 1_800_000_000.0


def migrate(policy: str = "rebalance", job: str = "a", node: str = "n0") -> events.Migrate:
    return events.Migrate(ts=T0, policy=policy, job=job, node=node, reason="test")


def test_limits() -> None:
    cfg = GuardrailsConfig(node_cooldown_s=100, max_per_hour=3, min_standby_pool=1)
    state = GuardState()
    assert check(migrate(), config=cfg, state=state, ready_standbys=2, now=T0) is None
    state.record_start(migrate(), T0)
    blocked = check(migrate(node="n1"), config=cfg, state=state, ready_standbys=2, now=T0)
    assert blocked and "max_concurrent_per_job" in blocked
    assert (
        check(migrate(job="b", node="n1"), config=cfg, state=state, ready_standbys=2, now=T0)
        is None
    )
    state.record_end("a")
    blocked = check(migrate(job="b"), config=cfg, state=state, ready_standbys=2, now=T0 + 50)
    assert blocked and "node_cooldown_s" in blocked
    assert check(migrate(job="b"), config=cfg, state=state, ready_standbys=2, now=T0 + 150) is None
    for i in range(2):
        state.record_start(migrate(job=f"j{i}", node=f"m{i}"), T0 + 200)
    blocked = check(
        migrate(job="c", node="x"), config=cfg, state=state, ready_standbys=2, now=T0 + 300
    )
    assert blocked and "max_per_hour" in blocked
    assert (
        check(migrate(job="c", node="x"), config=cfg, state=state, ready_standbys=2, now=T0 + 3601)
        is None
    )  # the first one left the hour


@pytest.mark.parametrize(
    ("policy", "ready", "allowed"),
    [
        ("rebalance", 1, False),
        ("drain", 1, False),
        ("rebalance", 2, True),
        ("failover", 1, True),
        ("alert", 1, True),
        ("failover", 0, False),
    ],
)
def test_the_standby_pool(policy: str, ready: int, allowed: bool) -> None:
    verdict = check(
        migrate(policy),
        config=GuardrailsConfig(min_standby_pool=1),
        state=GuardState(),
        ready_standbys=ready,
        now=T0,
    )
    assert (verdict is None) == allowed


def test_dry_run_blocks_everything() -> None:
    verdict = check(
        migrate("failover"),
        config=GuardrailsConfig(dry_run=True),
        state=GuardState(),
        ready_standbys=5,
        now=T0,
    )
    assert verdict and verdict.startswith("dry run")


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        GuardrailsConfig(max_per_hour=0).validate()
    assert err.value.key == "guardrails.max_per_hour"


def test_the_cooldown_ends_exactly_node_cooldown_s_after_the_start() -> None:
    cfg = GuardrailsConfig(node_cooldown_s=100, min_standby_pool=0)
    state = GuardState()
    state.record_start(migrate(), T0)
    state.record_end("a")
    blocked = check(migrate(job="b"), config=cfg, state=state, ready_standbys=1, now=T0 + 40)
    assert blocked and "was migrated 40 s ago" in blocked and "node_cooldown_s" in blocked
    blocked = check(migrate(job="b"), config=cfg, state=state, ready_standbys=1, now=T0 + 99.5)
    assert blocked and "node_cooldown_s" in blocked
    assert check(migrate(job="b"), config=cfg, state=state, ready_standbys=1, now=T0 + 100) is None


def test_each_migration_in_flight_holds_one_of_the_jobs_slots() -> None:
    cfg = GuardrailsConfig(max_concurrent_per_job=2, node_cooldown_s=0, min_standby_pool=0)
    state = GuardState()
    state.record_end("a")  # nothing in flight: harmless (a migration ended twice)
    assert state.in_flight == {}
    state.record_start(migrate(node="n0"), T0)
    state.record_start(migrate(node="n1"), T0)
    blocked = check(migrate(node="n2"), config=cfg, state=state, ready_standbys=1, now=T0)
    assert blocked and "max_concurrent_per_job" in blocked
    state.record_end("a")
    assert state.in_flight == {"a": 1}
    assert check(migrate(node="n2"), config=cfg, state=state, ready_standbys=1, now=T0) is None
    state.record_end("a")
    assert state.in_flight == {}


def test_without_a_ready_standby_even_a_failover_is_held() -> None:
    verdict = check(migrate("failover"), config=GuardrailsConfig(), state=GuardState(),
                    ready_standbys=0, now=T0)  # fmt: skip
    assert verdict == "no ready standby"


def test_a_restart_without_a_machine_cools_down_per_job_and_machine() -> None:
    cfg = GuardrailsConfig(node_cooldown_s=100)
    state = GuardState(last_restart={("a", "n0"): T0})

    def restart(job: str, node: str) -> events.CheckpointRestart:
        return events.CheckpointRestart(ts=T0, policy="failover", job=job, node=node, reason="")

    blocked = check_restart(restart("a", "n0"), config=cfg, state=state, now=T0 + 99)
    assert blocked == (
        "job a was asked to restart without n0 99 s ago (guardrails.node_cooldown_s = 100)"
    )
    assert check_restart(restart("a", "n1"), config=cfg, state=state, now=T0 + 1) is None
    assert check_restart(restart("b", "n0"), config=cfg, state=state, now=T0 + 1) is None
    assert check_restart(restart("a", "n0"), config=cfg, state=state, now=T0 + 100) is None
    # A migration of the machine holds a restart only while it runs: it starts no
    # restart cooldown (a restart is what is left when no migration can run).
    state.record_start(migrate(job="c", node="n2"), T0)
    held = check_restart(restart("c", "n2"), config=cfg, state=state, now=T0 + 1)
    assert held == "job c has 1 migration(s) in flight"
    state.record_end("c")
    assert check_restart(restart("c", "n2"), config=cfg, state=state, now=T0 + 1) is None
