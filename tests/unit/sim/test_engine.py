"""``tmd sim``'s engine: the daemon's real parts decide, the simulated job answers, and
a seed gives one result."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numpy")  # the `sim` extra

from tmd.daemon.actuator import Actuator
from tmd.detectors.gpu_health import GpuHealthDetector
from tmd.detectors.straggler import StragglerDetector
from tmd.policies.drain import DrainPolicy
from tmd.policies.failover import FailoverPolicy
from tmd.policies.rebalance import RebalancePolicy
from tmd.sim import cost, mixes
from tmd.sim.engine import (
    CHUNK_STEPS,
    RUNTIME_DETECT_S,
    Settings,
    Simulation,
    unmitigated_slowdown_s,
)

SMALL = Settings(gpus=1024, days=3.0, seed=7)


def scripted(failures: list[mixes.Failure], tmp_path: Path, **settings: object) -> Simulation:
    """A simulation that meets only ``failures``."""
    sim = Simulation(Settings(gpus=1024, days=1.0, **settings), journal_dir=tmp_path)  # type: ignore[arg-type]
    sim.failures = failures
    sim.phase = [0.5] * len(failures)
    sim.since_checkpoint = [0.5 * sim.checkpoint_s] * len(failures)
    return sim


def migrations(tmp_path: Path) -> list[tuple[str, str, str]]:
    db = sqlite3.connect(tmp_path / "journal.sqlite3")
    try:
        rows = db.execute("SELECT leaver, state, reason FROM migrations ORDER BY created_ts")
        return [(str(a), str(b), str(c)) for a, b, c in rows]
    finally:
        db.close()


def test_a_seed_gives_one_result_and_another_seed_another() -> None:
    first = Simulation(SMALL).run()
    again = Simulation(SMALL).run()
    other = Simulation(Settings(gpus=1024, days=3.0, seed=8)).run()
    assert first == again
    assert first != other


def test_the_daemon_s_own_classes_decide(tmp_path: Path) -> None:
    """Not copies: the plug-ins are the built-ins ``tmd run`` builds from the same
    config, the actuator is the daemon's, and what they decided is in a real journal."""
    sim = Simulation(SMALL, journal_dir=tmp_path)
    kinds = {type(p) for p in sim.plugins}
    for cls in (GpuHealthDetector, StragglerDetector, FailoverPolicy, RebalancePolicy,
                DrainPolicy):  # fmt: skip
        assert cls in kinds, cls
    assert type(sim.actuator) is Actuator
    result = sim.run()
    assert "tmd.policies.rebalance.RebalancePolicy" in result["plugins"]
    moved = migrations(tmp_path)
    assert moved and sum(result["migration_outcomes"].values()) == len(moved)


def test_a_slow_machine_is_found_and_moved_live_by_the_rebalance_policy(tmp_path: Path) -> None:
    slow = mixes.Failure(t_s=600.0, cause="network_congestion", signal="straggler", machine=3,
                         xid=None, slowdown=0.3, duration_s=4 * 3600.0)  # fmt: skip
    sim = scripted([slow], tmp_path)
    result = sim.run()
    [(leaver, state, reason)] = migrations(tmp_path)
    assert (leaver, state) == ("node-00003", "done") and reason.startswith("rebalance")
    assert result["stragglers"] == {"shown": 1, "found": 1} and result["live_migrations"] == 1
    # Found from steps that ran after the onset (not from steps timed before it), and
    # moved at the next rebalance tick: slow for at most that, not the four hours.
    [latency] = sim.tally.latencies["straggler"]
    assert latency >= CHUNK_STEPS * sim.costs.step_s
    lost = result["lost_s"]["fail_slow"]
    assert 0 < lost <= (latency + sim.s.rebalance_min * 60 + 60) * 0.3 / 1.3
    assert result["ettr"] > result["ettr_checkpoint_restart"]


def test_with_policy_fpi_the_learned_table_moves_the_slow_machine(tmp_path: Path) -> None:
    """``tmd sim --policy fpi``: the ``fpi`` policy, with a table trained for this run,
    decides in place of ``rebalance``, through the same actuator."""
    slow = mixes.Failure(t_s=600.0, cause="network_congestion", signal="straggler", machine=3,
                         xid=None, slowdown=0.3, duration_s=4 * 3600.0)  # fmt: skip
    sim = scripted([slow], tmp_path, policy="fpi")
    assert not any(isinstance(p, RebalancePolicy) for p in sim.plugins)
    result = sim.run()
    assert "tmd.policies.fpi.FpiPolicy" in result["plugins"] and result["policy"] == "fpi"
    [(leaver, state, reason)] = migrations(tmp_path)
    assert (leaver, state) == ("node-00003", "done") and reason.startswith("fpi: migrate")
    assert "F 0 (p 0)" in reason and result["live_migrations"] == 1


def test_a_fatal_xid_is_found_and_the_machine_replaced_from_the_pool(tmp_path: Path) -> None:
    fault = mixes.Failure(t_s=3600.0, cause="faulty_gpu", signal="xid", machine=1, xid=79,
                          slowdown=0.0, duration_s=0.0)  # fmt: skip
    sim = scripted([fault], tmp_path)
    result = sim.run()
    assert result["findings"] == {"GpuFault": 1}
    assert result["failovers"] == 1 and result["restarts"] == 0
    assert "node-00001" not in sim.nodes and sim.nodes[1].startswith("standby-")
    # The job's processes notice a killed peer at once, then fail over.
    noticed = RUNTIME_DETECT_S["xid"]
    want = noticed + sim.costs.machine_failover_s + 0.5 * sim.costs.step_s
    assert sim.tally.lost_s["faulty_gpu"] == pytest.approx(want)


def test_with_the_pool_empty_a_lost_machine_costs_a_restart(tmp_path: Path) -> None:
    lost = mixes.Failure(t_s=3600.0, cause="nic", signal="node_lost", machine=2, xid=None,
                         slowdown=0.0, duration_s=0.0)  # fmt: skip
    sim = scripted([lost], tmp_path, pool=0)
    result = sim.run()
    assert result["findings"] == {"NodeLost": 1} and result["pool_exhausted"] == 1
    assert result["restarts"] == 1 and result["failovers"] == 0
    # The failover policy asked for a checkpoint restart: no standby to move to.
    assert result["decisions"].get("CheckpointRestart:failover") == 1
    c = sim.costs
    noticed = RUNTIME_DETECT_S["node_lost"]  # a silent host: the collective times out
    want = noticed + c.requeue_s + c.restart_init_s + c.checkpoint_load_s
    want += 0.5 * sim.checkpoint_s
    assert sim.tally.lost_s["nic"] == pytest.approx(want)


def test_overlapping_slow_machines_cost_the_slowest_one_not_the_sum() -> None:
    def slow(t: float, d: float, s: float) -> mixes.Failure:
        return mixes.Failure(t_s=t, cause="x", signal="straggler", machine=0, xid=None,
                             slowdown=s, duration_s=d)  # fmt: skip

    # 0-100 at 0.5, 50-150 at 0.25: 100 s at 0.5, then 50 s at 0.25.
    lost = unmitigated_slowdown_s([slow(0, 100, 0.5), slow(50, 100, 0.25)], end=1000)
    assert lost == pytest.approx(100 * 0.5 / 1.5 + 50 * 0.25 / 1.25)
    assert unmitigated_slowdown_s([slow(0, 100, 0.5)], end=40) == pytest.approx(40 / 3)


def test_every_method_is_measured_in_the_same_run() -> None:
    result = Simulation(SMALL).run()
    for method in cost.METHODS:
        key = "ettr" if method == "tmd" else f"ettr_{method}"
        assert 0 < result[key] <= 1, key
        assert method in result["by_cause"]
    assert (
        result["checkpoint_interval_s"]["warm_standby_restart"]
        < result["checkpoint_interval_s"]["checkpoint_restart"]
    )


def test_tmd_sim_prints_the_fields_its_issue_names() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tmd.cli", "sim", "--gpus", "1024", "--days", "1", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    [line] = out.stdout.splitlines()  # one JSON object, nothing else on stdout
    r = json.loads(line)
    for key in ("ettr", "ettr_checkpoint_restart", "ettr_torchft_style",
                "ettr_warm_standby_restart", "ettr_no_standby", "wall_s", "by_cause",
                "pool_exhausted", "detection_latency_s", "migration_outcomes"):  # fmt: skip
        assert key in r, key
    assert out.stderr == ""  # progress only on a terminal


def test_every_member_answers_the_switch_so_no_migration_waits_for_a_timeout(
    tmp_path: Path,
) -> None:
    drain = mixes.Failure(t_s=600.0, cause="planned_maintenance", signal="planned",
                          machine=5, xid=None, slowdown=0.0, duration_s=0.0)  # fmt: skip
    scripted([drain], tmp_path).run()
    db = sqlite3.connect(tmp_path / "journal.sqlite3")
    [(state, detail)] = db.execute("SELECT state, detail FROM migrations").fetchall()
    db.close()
    assert state == "done" and "missing" not in detail, detail


def test_a_standby_named_by_a_migration_is_not_also_taken_by_a_failover(
    tmp_path: Path,
) -> None:
    """A slow machine is being moved to the first standby when another machine dies:
    the job's own failover takes another standby, and no machine holds two places."""
    slow = mixes.Failure(t_s=600.0, cause="x", signal="straggler", machine=0, xid=None,
                         slowdown=0.3, duration_s=4 * 3600.0)  # fmt: skip
    sim = scripted([slow], tmp_path)
    dead: list[str] = []

    def kill_during_the_prepare() -> None:
        if sim._flights and not dead:
            prepare = next(iter(sim._flights.values()))
            dead.append(prepare.joiner)
            fault = mixes.Failure(t_s=sim.clock.t, cause="faulty_gpu", signal="xid",
                                  machine=1, xid=79, slowdown=0.0, duration_s=0.0)  # fmt: skip
            sim._failure(0, fault)

    real = sim._dispatch

    def dispatch() -> None:
        real()
        kill_during_the_prepare()

    sim._dispatch = dispatch  # type: ignore[method-assign]
    result = sim.run()
    assert dead, "the migration never started"
    assert len(set(sim.nodes)) == len(sim.nodes), sim.nodes
    assert result["live_migrations"] == 1 and result["failovers"] == 1
    assert sim.nodes[0] == dead[0] and sim.nodes[1] != dead[0]


def test_a_failure_elsewhere_does_not_end_a_shown_slowdown(tmp_path: Path) -> None:
    """Machine 11 folds onto window machine 3 (11 mod 8), which shows machine 3's
    slowdown: the XID is shown on another one, and the slowdown goes on."""
    slow = mixes.Failure(t_s=600.0, cause="x", signal="straggler", machine=3, xid=None,
                         slowdown=0.05, duration_s=4 * 3600.0)  # fmt: skip
    fault = mixes.Failure(t_s=1200.0, cause="faulty_gpu", signal="xid", machine=11, xid=79,
                          slowdown=0.0, duration_s=0.0)  # fmt: skip
    sim = scripted([slow, fault], tmp_path)
    result = sim.run()
    assert sim.nodes[3] == "node-00003"  # still the slow one: 5% is not found
    assert result["lost_s"]["fail_slow"] >= 0.95 * 4 * 3600 * 0.05 / 1.05


def test_the_sweep_draws_ettr_against_size_and_pool(tmp_path: Path) -> None:
    png = tmp_path / "sweep.png"
    out = subprocess.run(
        [sys.executable, "-m", "tmd.cli", "sim", "--days", "0.5", "--gpus", "1024",
         "--sizes", "1024,2048", "--pools", "0,4", "--sweep", str(png), "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    r = json.loads(out.stdout)
    assert [x["gpus"] for x in r["sizes"]] == [1024, 2048]
    assert [x["pool"] for x in r["pools"]] == [0, 4]
    for row in [*r["sizes"], *r["pools"]]:
        assert {"ettr", "ettr_checkpoint_restart", "ettr_no_standby"} <= set(row)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
