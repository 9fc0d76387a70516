"""The ``fpi`` policy: a table trained by ``tmd policy train`` decides, each decision
carries its state, F and Q; a job unlike the one it was trained for is held; a bad
model stops the daemon at start naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tmd import wire
from tmd.clock import SystemClock
from tmd.daemon import events
from tmd.daemon.plugins import Context, configure
from tmd.daemon.view import ClusterView
from tmd.errors import ConfigError
from tmd.policies.fpi import FpiPolicy
from tmd.sim import fpi, train

T0 = 1_800_000_000.0
TICK = 600.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fpi") / "model.json"
    assert train.main(["--out", str(out), "--gpus", "16", "--pool", "3"]) == 0
    return out


def view(ranks: int, standbys: int) -> ClusterView:
    v = ClusterView()
    nodes = [f"n{i}" for i in range(ranks // 8)]
    v.apply_job_status(wire.JobStatus(
        ts=T0, job="j", generation=0, world_size=ranks,
        members=[wire.Member(r, nodes[r // 8], r % 8) for r in range(ranks)],
        standbys=[wire.StandbyInfo(node=f"s{i}", state="ready", slots=8) for i in range(standbys)],
    ), T0)  # fmt: skip
    return v


def policy(model: Path, v: ClusterView) -> FpiPolicy:
    [spec] = configure("policies", {"fpi": {"enabled": True, "model": str(model)}},
                       {"fpi": FpiPolicy})  # fmt: skip
    built = spec.build(Context(view=v, clock=SystemClock()))
    assert isinstance(built, FpiPolicy)
    return built


def slow(p: FpiPolicy, node: str, slowdown: float) -> None:
    found = events.StragglerFound(ts=T0, job="j", node=node, slowdown=slowdown, confidence=1,
                                  since_step=0)  # fmt: skip
    assert list(p.observe(found, T0)) == []


def test_it_migrates_when_the_table_says_so_and_says_why(model: Path) -> None:
    p = policy(model, view(16, standbys=3))
    assert p.tick_interval is not None and p.tick_interval.total_seconds() == TICK
    slow(p, "n1", 0.35)
    [decision] = p.tick(T0 + TICK)
    assert isinstance(decision, events.Migrate) and decision.node == "n1"
    assert decision.reason.startswith("migrate: n1 +35%")
    assert "state (3, 1, 3, 0), F 0 (p 0)" in decision.reason and "vs hold" in decision.reason


def test_it_keeps_a_standby_for_a_failure_in_the_same_tick(model: Path) -> None:
    """Two ready, the pool's minimum one: a migration would leave the minimum, and a
    machine failing before the refill would break it. Held, with F above p."""
    p = policy(model, view(16, standbys=2))
    slow(p, "n1", 0.35)
    [decision] = p.tick(T0 + TICK)
    assert isinstance(decision, events.Hold) and "state (3, 1, 2, 0)" in decision.reason
    assert "G of migrate " in decision.reason and "> p" in decision.reason


@pytest.mark.parametrize("slowdown", [0.06, 0.35])
def test_with_one_standby_left_it_neither_spends_it_nor_restarts_the_job(
    model: Path, slowdown: float
) -> None:
    """One ready, the pool's minimum: a failure may break it whatever the policy does
    (no action lowers that risk), so among the actions tied at the lowest G the best
    Q wins: holding, not a restart of the whole job for a 6% straggler."""
    p = policy(model, view(16, standbys=1))
    slow(p, "n1", slowdown)
    [decision] = p.tick(T0 + TICK)
    assert isinstance(decision, events.Hold), decision.reason


def test_it_holds_once_the_hour_s_migrations_are_spent(model: Path) -> None:
    p = policy(model, view(16, standbys=3))
    for i, node in enumerate(("n0", "n0")):
        p.observe(events.MigrationFinished(ts=T0, migration_id=f"m{i}", job="j", node=node,
                                           to=f"s{i}", outcome="done"), T0 + i)  # fmt: skip
    slow(p, "n1", 0.35)
    [decision] = p.tick(T0 + TICK)
    assert isinstance(decision, events.Hold) and decision.reason.startswith("hold: ")
    assert "2 moved this hour: state (3, 1, 3, 2)" in decision.reason
    # An hour on, the count has gone: it moves the machine.
    [later] = p.tick(T0 + 3601 + TICK)
    assert isinstance(later, events.Migrate)


def test_a_job_unlike_the_one_it_was_trained_for_is_held(model: Path) -> None:
    p = policy(model, view(128, standbys=2))  # trained for 16 GPUs
    slow(p, "n1", 0.35)
    [decision] = p.tick(T0 + TICK)
    assert isinstance(decision, events.Hold)
    assert "outside what the model was trained on: a job of 128 ranks" in decision.reason


def test_no_straggler_no_decision_and_a_moved_one_is_forgotten(model: Path) -> None:
    p = policy(model, view(16, standbys=2))
    assert list(p.tick(T0)) == []
    slow(p, "n1", 0.35)
    done = events.MigrationFinished(ts=T0, migration_id="m", job="j", node="n1", to="s0",
                                    outcome="done")  # fmt: skip
    p.observe(done, T0 + 1)
    assert list(p.tick(T0 + TICK)) == []


def test_a_bad_model_stops_the_daemon_naming_the_key(tmp_path: Path, model: Path) -> None:
    with pytest.raises(ConfigError, match=r"policies\.fpi\.model"):
        configure("policies", {"fpi": {"enabled": True}}, {"fpi": FpiPolicy})
    with pytest.raises(ConfigError, match="cannot read"):
        configure("policies", {"fpi": {"enabled": True, "model": str(tmp_path / "none")}},
                  {"fpi": FpiPolicy})  # fmt: skip
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**json.loads(model.read_text()), "version": 0}))
    with pytest.raises(ConfigError, match="model version 0"):
        configure("policies", {"fpi": {"enabled": True, "model": str(old)}}, {"fpi": FpiPolicy})
    assert configure("policies", {}, {"fpi": FpiPolicy}) == []  # off unless configured


def test_the_table_is_the_trained_policy(model: Path) -> None:
    raw = json.loads(model.read_text())
    mdp = fpi.from_sim(gpus=16, pool=3)
    kept = [i for i, x in enumerate(mdp.states) if not x[-1]]  # no limit broken yet
    assert [tuple(x) for x in raw["states"]] == [mdp.states[i][:-1] for i in kept]
    run = fpi.iterate(mdp, p=0.0, gamma=0.99,
                      start=np.full(mdp.n_states, 1, dtype=np.int64))  # fmt: skip
    assert raw["policy"] == [int(run.policy[i]) for i in kept] and raw["region_monotone"] is True
