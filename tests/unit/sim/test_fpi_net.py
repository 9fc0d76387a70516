"""Feasible Policy Iteration with networks, and the environment it learns in: the
limits break where they should, the constraint decay function's backup finds
``gamma^N``, a briefly trained policy keeps limits an untrained one breaks, and
evaluation never runs on a training seed."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from tmd.sim import fpi, fpi_net, job_env
from tmd.tools.bench import policy as bench

NOOP, MIGRATE, CHECKPOINT, RESTART = (
    job_env.ACTIONS.index(a) for a in ("noop", "migrate_1", "checkpoint", "restart")
)
HOUR, POOL, BUDGET = range(3)


def busy(**changes: float) -> fpi.SimModel:
    """A job with a straggler after every tick and no failures: only decisions count."""
    base = fpi.sim_model(gpus=1024)
    return replace(base, episodes_per_tick=50.0, failures_per_tick=0.0, rollbacks_per_tick=0.0,
                   **changes)  # fmt: skip


def run(sm: fpi.SimModel, limits: fpi.Limits, actions: list[int]) -> list[list[bool]]:
    """Each tick's breaches, one copy acting ``actions`` in turn."""
    env = job_env.JobEnv(sm, limits, job_env.Outside.draw(sm, [5000], len(actions)))
    return [env.step(np.array([a])).breach[0].tolist() for a in actions]


def test_spending_the_last_standby_breaks_the_pool_minimum_though_it_comes_back() -> None:
    sm = busy(pool=1, refill_per_tick=1.0)
    breaches = run(sm, fpi.Limits(min_pool=1), [NOOP, MIGRATE, NOOP])
    assert breaches == [[False] * 3, [False, True, False], [False] * 3]
    # With a spare beyond the minimum, the same migration breaks nothing.
    assert not any(map(any, run(busy(pool=2), fpi.Limits(min_pool=1), [NOOP, MIGRATE])))


def test_more_migrations_than_the_hour_allows_break_that_limit_for_the_hour() -> None:
    sm = busy(pool=5, refill_per_tick=1.0)
    breaches = run(sm, fpi.Limits(max_per_hour=2), [NOOP] + [MIGRATE] * 3 + [NOOP] * 6)
    # Migrations on ticks 1-3: the third is one too many, and is counted until the
    # hour (six ticks of ten minutes) after the first has passed.
    assert [b[HOUR] for b in breaches] == [False] * 3 + [True] * 4 + [False] * 3
    assert not any(b[POOL] or b[BUDGET] for b in breaches)


def test_downtime_beyond_the_budget_breaks_it() -> None:
    sm = busy()
    assert 600 / 2 < sm.restart_s < 600
    breaches = run(sm, fpi.Limits(downtime_per_day_s=600), [RESTART, RESTART, NOOP])
    assert [b[BUDGET] for b in breaches] == [False, True, True]  # earned back slowly
    assert [b[BUDGET] for b in run(sm, fpi.Limits(), [CHECKPOINT] * 20)] == [False] * 20


def test_the_g_backup_converges_to_gamma_to_the_steps_before_a_breach() -> None:
    # x0 -> x1 -> x2, whose tick breaks a limit, then x2 again: both actions alike.
    learner = fpi_net.Learner(3, 2, fpi_net.NetConfig(gamma=0.9, tau=0.05, lr=3e-3))
    x, x2 = torch.eye(3).repeat(2, 1), torch.eye(3)[[1, 2, 2]].repeat(2, 1)
    a, c = torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([0.0, 0, 1, 0, 0, 1])
    for _ in range(300):
        learner.update(x, a, torch.zeros(6), c, x2)
    _, g = learner.values(np.eye(3))
    assert g.numpy() == pytest.approx(np.array([[0.81] * 2, [0.9] * 2, [1.0] * 2]), abs=0.02)


def test_a_briefly_trained_policy_keeps_the_limits_and_moves_stragglers() -> None:
    """Trained briefly, it breaks fewer limits than its untrained self and than always
    migrating, and still migrates: it wins goodput over doing nothing (a policy that
    only holds, or only checkpoints, would keep the limits too)."""
    sm, limits = fpi.sim_model(), fpi.Limits()
    small = fpi_net.NetConfig(copies=16, batch=64, warmup_ticks=20, epochs=2, seed=1)
    untrained = fpi_net.train(sm, limits, replace(small, updates=1))
    trained = fpi_net.train(sm, limits, replace(small, updates=3000))
    seeds = job_env.held_out(2)
    policies = {"always": job_env.constant("migrate_1"), "untrained": untrained.policy(),
                "trained": trained.policy(), "noop": job_env.constant("noop")}  # fmt: skip
    out = job_env.evaluate(policies, sm, limits, days=2, seeds=seeds)
    violations = {name: r["violations"] for name, r in out.items()}
    assert violations["untrained"] > 0 and violations["always"] > 0
    assert violations["trained"] < min(violations["untrained"], violations["always"])
    assert out["trained"]["migrations"] > 0
    assert out["trained"]["goodput_gpu_h"] > out["noop"]["goodput_gpu_h"]
    assert set(trained.seeds) <= set(job_env.TRAIN_SEEDS) and not set(trained.seeds) & set(seeds)
    actions, F, Q = trained.decide(np.zeros((3, len(job_env.FEATURES))))
    assert actions.shape == F.shape == (3,) and Q.shape == (3, len(job_env.ACTIONS))
    assert np.all((F >= 0) & (F <= 1))


def test_evaluation_refuses_a_training_seed() -> None:
    sm = fpi.sim_model(gpus=1024)
    with pytest.raises(ValueError, match="held out"):
        job_env.evaluate({"noop": job_env.constant("noop")}, sm, fpi.Limits(), days=1,
                         seeds=[job_env.HELD_OUT, job_env.TRAIN_SEEDS[-1]])  # fmt: skip
    assert job_env.held_out(8).start >= job_env.TRAIN_SEEDS.stop


def test_a_table_acts_in_the_environment_through_the_model_s_state() -> None:
    limits = fpi.Limits(max_per_hour=2, min_pool=1)
    mdp = fpi.from_sim(gpus=1024, pool=3, limits=limits)
    act = job_env.table_policy(mdp, bench.rebalance_table(mdp, limits), limits)
    n = 5
    obs = job_env.Obs(
        slowdown=np.array([[0.35, 0.0], [0.35, 0.0], [0.35, 0.3], [0.07, 0.0], [0.0, 0.0]]),
        age=np.array([[1, 0], [1, 0], [9, 2], [3, 0], [0, 0]]), pool=np.array([2, 1, 7, 3, 3]),
        recent=np.array([0, 0, 2, 0, 0]), budget_s=np.zeros(n), since_checkpoint_s=np.zeros(n),
        features=np.zeros((n, len(job_env.FEATURES))),
    )  # fmt: skip
    # A 35% straggler a tick old with a spare: the worst candidate moved. The pool's
    # minimum, the hour's limit (an old straggler, a pool beyond the model's: capped),
    # 7% (under the threshold), no straggler: held.
    assert [job_env.ACTIONS[a] for a in act(obs)] == ["migrate_1"] + ["noop"] * 4
    restarts = np.full(mdp.n_states, fpi.ACTIONS.index("restart"), dtype=np.int64)
    assert set(job_env.table_policy(mdp, restarts, limits)(obs)) == {RESTART}
