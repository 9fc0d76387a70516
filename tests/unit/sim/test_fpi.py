"""Feasible Policy Iteration, tabular: the constraint decay function, the paper's
theorem where it holds (``p = 0``) and where it does not (``p > 0``), and the
migration model's policy."""

from __future__ import annotations

import numpy as np
import pytest

from tmd.sim import fpi


def random_mdp(rng: np.random.Generator, n: int = 12, actions: int = 3) -> fpi.MDP:
    P = rng.random((actions, n, n)) ** 4  # sparse-ish: a few likely successors
    P /= P.sum(axis=2, keepdims=True)
    return fpi.MDP(P, rng.random((n, actions)), (rng.random(n) < 0.2).astype(float))


def test_the_constraint_decay_function_is_gamma_to_the_steps_before_a_breach() -> None:
    # x0 -> x1 -> x2, where a limit is broken; x2 stays. One action.
    P = np.array([[[0, 1, 0], [0, 0, 1], [0, 0, 1]]], dtype=float)
    mdp = fpi.MDP(P, np.zeros((3, 1)), np.array([0.0, 0.0, 1.0]))
    ev = fpi.evaluate(mdp, np.zeros(3, dtype=np.int64), gamma=0.9)
    assert list(ev.F) == pytest.approx([0.81, 0.9, 1.0])
    assert ev.G[:, 0] == pytest.approx(ev.F)


def test_with_p_zero_the_region_never_shrinks_and_the_value_inside_never_falls() -> None:
    rng = np.random.default_rng(7)
    for _ in range(60):
        mdp = random_mdp(rng)
        start = rng.integers(0, mdp.n_actions, mdp.n_states)
        run = fpi.iterate(mdp, p=0.0, gamma=0.9, start=start)
        assert run.region_monotone and run.value_monotone
        assert run.region_sizes == sorted(run.region_sizes)


def test_with_p_above_zero_the_theorem_does_not_hold_in_general() -> None:
    rng = np.random.default_rng(0)
    runs = [fpi.iterate(m, p=0.3, gamma=0.9, start=rng.integers(0, 3, 12))
            for m in (random_mdp(rng) for _ in range(60))]  # fmt: skip
    assert any(not (r.region_monotone and r.value_monotone) for r in runs)


def test_the_migration_model_s_policy_keeps_the_limits_and_moves_slow_machines() -> None:
    limits = fpi.Limits(max_per_hour=2, min_pool=1)
    mdp = fpi.migration_mdp(episodes_per_tick=0.05, slowdown_weights=(0.4, 0.3, 0.2, 0.1),
                            recover_hazard=(0.5, 0.3, 0.2, 0.1), pool=3, limits=limits)  # fmt: skip
    always = np.full(mdp.n_states, fpi.ACTIONS.index("migrate"), dtype=np.int64)
    run = fpi.iterate(mdp, p=0.0, gamma=0.99, start=always)
    assert run.region_monotone and run.value_monotone
    assert run.region_sizes[-1] > run.region_sizes[0]  # migrating always breaks limits
    final = run.evaluations[-1]
    policy = {x: fpi.ACTIONS[a] for x, a in zip(mdp.states, run.policy, strict=True)}
    feasible = {x for x, f in zip(mdp.states, final.F, strict=True) if f <= fpi.TOL}
    # A 35% straggler, two standbys ready, none moved this hour: moved.
    assert policy[(3, 0, 2, 0, 0)] == "migrate"
    # The last standby the pool keeps, or the hour's last migration: not spent.
    assert policy[(3, 0, 1, 0, 0)] != "migrate" and policy[(3, 0, 3, 2, 0)] != "migrate"
    # Inside its region the policy never breaks a limit: F is 0 there.
    assert (3, 0, 2, 0, 0) in feasible and (0, 0, 1, 0, 0) in feasible
    assert all(x[2] >= limits.min_pool and x[3] <= limits.max_per_hour for x in feasible)


def test_a_model_must_be_a_model() -> None:
    with pytest.raises(ValueError, match="sum to 1"):
        fpi.MDP(np.ones((1, 2, 2)), np.zeros((2, 1)), np.zeros(2))
    with pytest.raises(ValueError, match="shapes"):
        fpi.MDP(np.full((1, 2, 2), 0.5), np.zeros((3, 1)), np.zeros(2))
    with pytest.raises(ValueError, match="gamma"):
        fpi.iterate(random_mdp(np.random.default_rng(1)), p=0.0, gamma=1.0)
