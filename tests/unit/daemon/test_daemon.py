"""The daemon's wiring, without a broker: what ``Daemon.emit`` does before the bus."""

from __future__ import annotations

from pathlib import Path

from tmd import config as config_mod
from tmd import wire
from tmd.daemon import events
from tmd.daemon.daemon import Daemon

TS = 1_800_000_000.0


def test_a_fault_is_in_the_view_before_any_policy_or_the_actuator_hears_of_it(
    tmp_path: Path,
) -> None:
    daemon = Daemon(config_mod.from_dict({"journal": {"path": str(tmp_path / "j.sqlite3")}}))
    try:
        standbys = [wire.StandbyInfo(node="s0", state="ready")]
        status = wire.JobStatus(
            ts=TS, job="a", generation=0, world_size=1, members=[wire.Member(rank=0, node="n0")],
            standbys=standbys, state="running", step=1,
        )  # fmt: skip
        daemon.view.apply_job_status(status, TS)
        assert daemon.view.ready_standbys("a") == ["s0"]
        daemon.emit(events.GpuFault(ts=TS, node="s0", gpu=0, cause="xid 79"), "gpu_health")
        assert daemon.view.ready_standbys("a") == []
    finally:
        daemon.journal.close()


def test_a_node_lost_marks_the_machine_lost_and_a_gpu_fault_does_not(tmp_path: Path) -> None:
    daemon = Daemon(config_mod.from_dict({"journal": {"path": str(tmp_path / "j.sqlite3")}}))
    try:
        daemon.emit(events.GpuFault(ts=TS, node="n0", gpu=0, cause="xid 79"), "gpu_health")
        assert not daemon.view.lost("n0")
        daemon.emit(events.NodeLost(ts=TS, node="n1", cause="heartbeat"), "node_lost")
        assert daemon.view.lost("n1")
    finally:
        daemon.journal.close()
