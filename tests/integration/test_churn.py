"""Bounded state under churn (issue 12, item 8): a real daemon against a real mosquitto,
fed a flood of distinct job and node names (node statuses, GPU samples, XIDs, step
batches, job statuses, answers to migrations nobody started), keeps every table those
names key within its cap, and its memory does not grow with the names it has seen.

The caps are small (64 jobs, 256 nodes, 1024 ranks) and jobs and nodes are forgotten
0.3 s after they fall silent, so the view fills, refuses, forgets and fills again
many times over, and the actuator and the journal forget with it. ``TMD_CHURN_NAMES``
sets how many names of each kind are sent (default 100,000: about 25 s on two busy
cores); memory is compared after the first tenth of them and after all.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
from typing import Any

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.conftest import DaemonFactory
from tests.helpers import eventually
from tmd import wire
from tmd.daemon import daemon as daemon_mod
from tmd.daemon.actuator.membership import MAX_EARLY_ACKS
from tmd.daemon.daemon import Daemon
from tmd.tools.mosquitto import Mosquitto

NAMES = int(os.environ.get("TMD_CHURN_NAMES", "100000"))
MAX_JOBS, MAX_NODES, MAX_RANKS = 64, 256, 1024
RSS_GROWTH_MB = 8.0
"""What the daemon's process may grow by from a tenth of the names to all of them: what
stays (caps, caches, the allocator's arenas) is reached by then (it grew by about 1 MB
from 10,000 to 100,000 names); 90 bytes kept per name seen would not pass."""


def messages(i: int) -> list[tuple[str, bytes]]:
    """Name ``i``'s messages: one of its node, one of its job, each of one of 3 kinds."""
    ts, node, job = time.time(), f"cn{i}", f"cj{i}"
    if i % 3 == 0:
        on = wire.NodeStatus(ts=ts, node=node, state="online", gpus=[wire.GpuInfo(index=0)])
        node_msg = (wire.node_topic(node, "status"), wire.encode(on))
    elif i % 3 == 1:
        sample = wire.NodeGpu(ts=ts, node=node, gpus=[wire.GpuSample(index=0, temp_c=60.0)])
        node_msg = (wire.node_topic(node, "gpu"), wire.encode(sample))
    else:
        xid = wire.XidEvent(ts=ts, node=node, gpu=0, xid=79)
        node_msg = (wire.node_topic(node, "xid"), wire.encode(xid))
    if i % 3 == 0:
        rank = i % 8
        step = wire.StepTiming(i, ts, 1.0, 0.6, 0.3, 0.05, 0.05)
        batch = wire.IterBatch(ts=ts, job=job, rank=rank, node=node, steps=[step])
        job_msg = (wire.iter_topic(job, rank), wire.encode(batch))
    elif i % 3 == 1:
        status = wire.JobStatus(
            ts=ts, job=job, generation=i % 5, world_size=8,
            members=[wire.Member(r, f"cn{i + r}") for r in range(8)],
            standbys=[wire.StandbyInfo(node=f"cs{i}", state="ready")],
        )  # fmt: skip
        job_msg = (wire.job_topic(job, "status"), wire.encode(status))
    else:  # of a job that sent its status (the one before), or of one that did not
        job, mid, kind = (
            (f"cj{i - 1}", f"failover-g{i}", "failed") if i % 2 else (job, f"m{i}", "switched")
        )
        answer = wire.Ack(ts=ts, job=job, migration_id=mid, kind=kind, node=node)  # type: ignore[arg-type]
        job_msg = (wire.job_topic(job, "ack"), wire.encode(answer))
    return [node_msg, job_msg]


CHUNK = 2500  # names a chunk: the publisher runs at most two chunks ahead of the daemon


def publish(host: str, port: int, start: int, stop: int, go: Any) -> None:
    """Publish names ``start..stop``' messages at QoS 0, a chunk each time ``go`` says
    so (a separate process: its CPU is not the daemon's, and a broker would drop what a
    subscriber cannot keep up with)."""
    client = paho.Client(CallbackAPIVersion.VERSION2)
    client.max_queued_messages_set(0)
    client.connect(host, port)
    client.loop_start()
    for first in range(start, stop, CHUNK):
        go.get(timeout=60)
        last = None
        for i in range(first, min(first + CHUNK, stop)):
            for topic, payload in messages(i):
                last = client.publish(topic, payload, qos=0)
        if last is not None:
            last.wait_for_publish(60)
    client.disconnect()
    client.loop_stop()


def received(daemon: Daemon) -> int:
    return sum(int(t.value) for t in daemon.metrics.received_by.values())


async def feed(daemon: Daemon, broker: Mosquitto, start: int, stop: int) -> None:
    """Publish names ``start..stop`` and wait until the daemon has read them all."""
    ctx = mp.get_context("spawn")
    go = ctx.Queue()
    proc = ctx.Process(
        target=publish, args=(broker.host, broker.port, start, stop, go), daemon=True
    )
    proc.start()
    base = received(daemon)
    chunks = range(start, stop, CHUNK)
    for _ in chunks[:2]:
        go.put(1)
    for n, first in enumerate(chunks):
        want = base + 2 * (min(first + CHUNK, stop) - start)  # two messages a name
        got, moved = received(daemon), time.monotonic()
        while got < want and time.monotonic() - moved < 10:
            await asyncio.sleep(0.01)
            if (now := received(daemon)) != got:
                got, moved = now, time.monotonic()
        if n + 2 < len(chunks):
            go.put(1)
    proc.join(10)
    # QoS 0 all the way: the broker may drop a few, but the flood arrived.
    want = 2 * (stop - start)
    got = received(daemon) - base
    assert got >= want * 0.99, f"the daemon read {got} of {want} messages"


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


class Sizes:
    """The largest size each table reached, sampled on the daemon's event loop."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.most: dict[str, int] = {}
        self.jobs_entered = 0  # jobs new to the view since the sample before
        self._jobs: set[str] = set()

    def sample(self) -> None:
        d = self.daemon
        view, act = d.view, d.actuator
        now = {
            "view.jobs": len(view.jobs),
            "view.nodes": len(view.nodes),
            "view.held_ranks": view.held_ranks,
            "view.total_ranks": view.total_ranks,
            "view.lost": len(view._lost),
            "actuator.memberships": len(act.memberships),
            "actuator.failover_acks": len(act.failover_acks),
            "actuator.flights": len(act.flights),
            "actuator.replaced": len(act.ledger.replaced),
            "actuator.restarts_asked": len(act.ledger.restarts_asked),
            "guard.last_on_node": len(act.guard_state.last_on_node),
            "guard.last_restart": len(act.guard_state.last_restart),
        }
        for key, value in now.items():
            self.most[key] = max(self.most.get(key, 0), value)
        jobs = set(view.jobs)
        self.jobs_entered += len(jobs - self._jobs)
        self._jobs = jobs

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(0.02)


def journal_rows(daemon: Daemon, table: str) -> int:
    return int(daemon.journal._db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])


async def test_a_flood_of_names_leaves_every_table_within_its_cap(
    own_broker: Mosquitto,
    start_daemon: DaemonFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(daemon_mod, "HOUSEKEEPING_INTERVAL_S", 0.1)
    daemon = await start_daemon(
        own_broker,
        ingest={
            "max_jobs": MAX_JOBS, "max_nodes": MAX_NODES, "max_ranks": MAX_RANKS,
            "max_ranks_per_job": 64, "forget_after_s": 0.3,
            # The flood's own backlog is not what is tested: the view stays trusted, so
            # the detectors judge silences and the actuator decides as it would.
            "stale_lag_s": 60.0,
        },
        journal={"retention_days": 1.0 / 86400},  # a second
        # Each detector forgets on its own horizon, as long as the view's by default;
        # here they are as short as this view's. gpu_health forgets only on its 30 s
        # tick, longer than this test: it is left out.
        detectors={
            "node_lost": {"heartbeat_timeout_s": 0.5, "forget_after_s": 1.0},
            "gpu_health": {"enabled": False},
        },
    )  # fmt: skip
    sizes = Sizes(daemon)
    sampler = asyncio.create_task(sizes.run())
    try:
        started = time.monotonic()
        tenth = NAMES // 10
        await feed(daemon, own_broker, 0, tenth)
        await asyncio.sleep(0.5)  # housekeeping settles what the first names left
        before = rss_mb()
        await feed(daemon, own_broker, tenth, NAMES)
        await asyncio.sleep(0.5)
        after = rss_mb()
        took = time.monotonic() - started
        # Everyone is silent now: the view forgets them, and what is kept of them goes,
        # in memory and, past the journal's retention, on disk.
        tables = ("events", "migrations", "memberships")
        act = daemon.actuator
        await eventually(
            lambda: not daemon.view.jobs and not daemon.view.nodes
            and len(act.memberships) == len(act.failover_acks) == 0
            and not any(journal_rows(daemon, t) for t in tables),
            timeout_s=15,
        )  # fmt: skip
    finally:
        sampler.cancel()
    print(  # the numbers, for ``pytest -s``
        f"\nchurn: {NAMES} names of each kind in {took:.1f} s; RSS {before:.1f} MB after "
        f"{tenth}, {after:.1f} MB after {NAMES} (+{after - before:.1f}); jobs through the "
        f"view: {sizes.jobs_entered}; largest: {sizes.most}"
    )
    most = sizes.most
    assert most["view.jobs"] <= MAX_JOBS and most["view.nodes"] <= MAX_NODES
    assert most["view.total_ranks"] <= most["view.held_ranks"] <= MAX_RANKS
    assert most["view.lost"] <= MAX_NODES
    assert most["actuator.memberships"] <= MAX_JOBS
    assert most["actuator.failover_acks"] <= 2 * MAX_EARLY_ACKS
    assert sizes.jobs_entered > 10 * MAX_JOBS  # the caps were churned through, often
    rejected = daemon.metrics.rejected_by["limit"].value
    assert rejected > NAMES  # and refused the rest
    assert after - before < RSS_GROWTH_MB, f"RSS grew {after - before:.1f} MB"
