"""Ingest shards (``ingest.shards``) as processes, against a real mosquitto: a cluster of
two jobs, each owned by its own shard, through its agents (steps and GPU samples in
one message per machine); a slow rank is found in its shard and acted on by the head;
a shard that dies ends the daemon."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import DaemonFactory
from tests.helpers import eventually
from tmd import config as config_mod
from tmd.daemon.daemon import Daemon
from tmd.daemon.shards import ShardDied, owner
from tmd.tools import synth
from tmd.tools.mosquitto import Mosquitto


async def test_each_shard_takes_its_jobs_and_the_head_hears_their_findings(
    own_broker: Mosquitto, start_daemon: DaemonFactory
) -> None:
    """On a broker of its own: what other tests left retained is not in the view."""
    broker = own_broker
    assert [owner(f"train-{j}", 2) for j in (0, 1)] == [1, 0]  # a job each
    daemon = await start_daemon(broker, ingest={"shards": 2})
    assert daemon.shards is not None
    spec = synth.SynthSpec(
        host=broker.host, port=broker.port, job="train", jobs=2, ranks=16, ranks_per_node=2,
        step_s=0.05, flush_s=0.2, seconds=30, via="agent", relay_sample=True,
        slow={13: 1.3},  # train-1's rank 5, on node-00006
    )  # fmt: skip
    proc, _ = synth.start(spec)
    try:
        rows = await eventually(lambda: daemon.journal.events(kind="StragglerFound"), timeout_s=40)
        # Each shard holds the ranks of its own job, and no other.
        reports = [link.report for link in daemon.shards.links]
        assert all(r is not None and r.ranks == 8 for r in reports)
        assert [set(r.jobs) for r in reports if r is not None] == [{"train-1"}, {"train-0"}]
    finally:
        proc.kill()
        proc.join()
    assert {(r.job, r.node) for r in rows} == {("train-1", "node-00006")}
    # The head: every machine's GPU sample, the jobs' statuses, no rank of its own; the
    # shards' counts in its /metrics, its plug-ins and theirs up.
    view = daemon.view
    assert len(view.nodes) == 8 and all(n.sample is not None for n in view.nodes.values())
    assert set(view.jobs) == {"train-0", "train-1"}
    jobs = view.snapshot(time.time())["jobs"]  # what the API and `tmd status` show
    assert [(j["job"], j["reporting_ranks"]) for j in jobs] == [("train-0", 8), ("train-1", 8)]
    assert all(j["step"] > 0 for j in jobs)
    assert view.total_ranks == 0 and view.reporting_ranks() == 16
    value = daemon.metrics.registry.get_sample_value
    assert value("tmd_view_ranks") == 16
    assert (value("tmd_rank_steps_total", {"outcome": "accepted"}) or 0) > 16
    assert value("tmd_messages_rejected_total", {"reason": "mismatch"}) == 0
    assert (value("tmd_ingest_latency_seconds_count") or 0) > 0  # a batch each
    # The API's rank rows, from the job's shard.
    url = f"http://127.0.0.1:{daemon.api.port}/api/v1/status?job=train-1"
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        (job,) = (await resp.json())["jobs"]
    assert [r["rank"] for r in job["ranks"]] == list(range(8))
    assert {r["node"] for r in job["ranks"]} == {f"node-{n:05d}" for n in range(4, 8)}
    health = daemon.health()
    assert health["plugins"]["straggler"] and health["plugins"]["gpu_health"]
    assert [r.spec.name for r in daemon.runners if r.spec.name == "straggler"] == []


async def test_a_stuck_shard_makes_the_view_stale_and_a_dead_one_ends_the_daemon(
    broker: Mosquitto, tmp_path: Path
) -> None:
    """A stop signal is the head's to handle, not a shard's; a shard that stops reporting
    is behind, so the daemon's view is stale until it reports again; a shard that dies
    took its jobs' view with it: the daemon fails, for systemd to restart it whole."""
    raw = {
        "mqtt": {"host": broker.host, "port": broker.port},
        "api": {"port": 0},
        "journal": {"path": str(tmp_path / "journal.sqlite3")},
        "ingest": {"shards": 2, "probe_interval_s": 0.2, "stale_lag_s": 1.0,
                   "stale_settle_s": 0.2},
    }  # fmt: skip
    daemon = Daemon(config_mod.from_dict(raw))
    task = asyncio.create_task(daemon.run())
    try:
        await asyncio.wait_for(daemon.ready.wait(), 20)
        assert daemon.shards is not None
        links = daemon.shards.links
        await eventually(lambda: daemon.health()["view"] == "current", timeout_s=20)
        os.kill(links[0].process.pid, signal.SIGTERM)
        os.kill(links[1].process.pid, signal.SIGSTOP)
        await eventually(lambda: daemon.health()["view"] == "stale", timeout_s=10)
        await eventually(lambda: daemon.metrics.registry.get_sample_value("tmd_view_stale") == 1)
        os.kill(links[1].process.pid, signal.SIGCONT)
        await eventually(lambda: daemon.health()["view"] == "current", timeout_s=10)
        assert links[0].process.is_alive() and not task.done()
        pids = [link.process.pid for link in links]
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(ExceptionGroup) as caught:
            await asyncio.wait_for(task, 20)
        assert caught.group_contains(ShardDied)
        # The other shard ended with the daemon: no process left behind.
        assert not any(_alive(pid) for pid in pids)
    finally:
        task.cancel()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
