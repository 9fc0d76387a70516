"""``tmd bench policy`` at its smallest: one short rollout per policy. It prints the
fields issue 14 names, FPI's feasible region grew from the always-migrate start, and
on the model none of the three breaks a limit the guardrails would not."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tmd.sim import fpi
from tmd.tools.bench import policy


def test_bench_policy_prints_every_policy_s_fields(capsys: pytest.CaptureFixture[str]) -> None:
    # A network trained for a few hundred updates: the env section's plumbing, not
    # its result (tests/unit/sim/test_fpi_net.py holds the network to one).
    assert policy.main(["--days", "2", "--seeds", "1", "--net-updates", "200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for name in ("fpi", "rebalance", "lagrangian"):
        assert set(out[name]) == {"violations", "goodput_gpu_h", "migrations", "decisions_per_day"}
        assert out[name]["goodput_gpu_h"] > 0
    assert out["feasible_region_monotone"] is True and out["value_monotone"] is True
    sizes = out["region_sizes"]
    assert sizes[0] == 0 and sizes[-1] > 0 and sizes == sorted(sizes)
    assert out["fpi"]["violations"] <= out["rebalance"]["violations"]
    assert out["train_s"] >= 0 and out["seeds"] == "1000..1000"
    env = out["env"]
    for name in ("fpi", "rebalance", "lagrangian", "noop", "always_migrate", "fpi_net"):
        assert set(env[name]["violations_by_limit"]) == {"migrations_per_hour", "min_pool",
                                                         "downtime_budget"}  # fmt: skip
        assert env[name]["goodput_gpu_h"] > 0
    assert env["noop"]["migrations"] == 0 and env["always_migrate"]["violations"] > 0
    assert env["net_updates"] == 200 and env["seeds"] == "1000..1000"


def test_the_rebalance_table_is_the_threshold_policy_behind_the_guardrails() -> None:
    limits = fpi.Limits(max_per_hour=2, min_pool=1)
    mdp = fpi.from_sim(gpus=1024, pool=2, limits=limits)
    table = dict(zip(mdp.states, (fpi.ACTIONS[a] for a in policy.rebalance_table(mdp, limits)),
                     strict=True))  # fmt: skip
    assert table[(2, 1, 2, 0, 0)] == "migrate"  # 15%, a tick old, a spare standby, hour free
    assert table[(2, 0, 2, 0, 0)] == "noop"  # not yet persistent
    assert table[(1, 3, 2, 0, 0)] == "noop"  # 7.5%: under the threshold
    assert table[(3, 1, 1, 0, 0)] == "noop"  # the pool's minimum
    assert table[(3, 1, 2, 2, 0)] == "noop"  # the hour's limit


def test_a_rollout_is_the_same_for_the_same_seed() -> None:
    mdp = fpi.from_sim(gpus=1024, pool=2)
    table = np.zeros(mdp.n_states, dtype=np.int64)
    start = mdp.states.index((0, 0, 2, 0, 0))
    a, b = (policy.rollout(mdp, table, start=start, ticks=500, seed=3) for _ in range(2))
    assert a == b and a["migrations"] == 0
