"""The daemon's wiring, without a broker: what ``Daemon.emit`` does before the bus."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from tmd import config as config_mod
from tmd import wire
from tmd.daemon import events
from tmd.daemon.daemon import FULL_COLLECTION_EVERY, Daemon, collect_rarely

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


def test_full_collections_come_rarely_and_other_thresholds_stay() -> None:
    """``collect_rarely`` (run by ``Daemon.run``): a full collection every 100 middle
    ones at least, the young and middle thresholds as they were."""
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        if gc.get_threshold()[2] == 0:  # CPython 3.14.0-3.14.4's incremental collector
            pytest.skip("this interpreter has no full-collection threshold")
        collect_rarely()
        assert gc.get_threshold() == (700, 10, FULL_COLLECTION_EVERY)
        gc.set_threshold(700, 10, 5000)
        collect_rarely()  # a higher one is left as it is
        assert gc.get_threshold() == (700, 10, 5000)
    finally:
        gc.set_threshold(*before)
