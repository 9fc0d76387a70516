"""``tmd sim --live``, end to end: ``tmd run`` in its own process and a real mosquitto,
against four simulated machines of two ranks and two standby machines, one failure of
each kind. Every failure is found by the finding that names it, decided by the policy
that owns it, and ended as the runtime would end it; the daemon's view of the job
agrees with the job's own; no message was rejected or lost on QoS 1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

EXPECTED = {
    # signal: (the finding, the decision, how it ends)
    "straggler": ("StragglerFound", "Migrate:rebalance", "live_migrated"),
    "planned": ("DrainRequested", "Migrate:drain", "live_migrated"),
    "xid": ("GpuFault", "Migrate:failover", "failed_over"),
    "node_lost": ("NodeLost", "Migrate:failover", "failed_over"),
}


def test_the_daemon_handles_every_kind_of_failure_of_a_live_simulated_cluster() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tmd.cli", "sim", "--live", "--json", "--seconds", "28",
         "--step-s", "0.05", "--machines", "4", "--per-node", "2", "--pool", "2",
         "--failures", "4", "--seed", "0"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    assert r["errors"] == []
    assert r["injected"] == r["found"] == r["decided"] == r["ended"] == 4, r["failures"]
    assert r["ended_by"] == {"daemon": 2, "runtime": 2}
    assert sorted(f["signal"] for f in r["failures"]) == sorted(EXPECTED)
    for f in r["failures"]:
        finding, decision, outcome = EXPECTED[f["signal"]]
        assert (f["found_by"], f["decision"], f["outcome"]) == (finding, decision, outcome), f
        assert f["found_s"] is not None and f["found_s"] >= 0
    # Each migration the daemon journaled ended once; one per failure ended done, the
    # two failovers' too, on the runtime's own answer (not at the switch timeout). A
    # migration whose job's membership changed under it (a failover elsewhere) ends
    # aborted, and its policy decides again.
    assert r["exactly_once"] and r["migrations"]["done"] == 4, r["migrations"]
    assert set(r["migrations"]) <= {"done", "aborted"}, r["migrations"]
    assert r["view_agrees"], r["view"]
    assert r["generation"] == 4 and r["run"] == 0
    assert r["rejected"] == {}
    sent, got = r["sent"], r["received"]
    assert (got["job_status"], got["ack"], got["xid"]) == (
        sent["JobStatus"], sent["Ack"], sent["XidEvent"]
    )  # fmt: skip
    assert 0 < r["ettr"] < 1
