"""Ingest shards without processes: who owns a job, the frames between head and shard,
and what a shard's ingest takes of an agent's relayed message."""

from __future__ import annotations

import time
from collections import Counter

from tests.fakes.clock import FakeClock
from tmd import config, wire
from tmd.daemon.bus import Bus
from tmd.daemon.ingest import Ingest
from tmd.daemon.metrics import Metrics
from tmd.daemon.shards import OP_MESSAGE, OP_PROBE, frame, frames, owner
from tmd.daemon.view import ClusterView


def test_owner_is_stable_and_spreads_names_that_differ_in_their_last_character() -> None:
    # The same in every process and run (a value fixed here: not Python's salted hash).
    assert [owner(f"train-{i}", 4) for i in range(8)] == [owner(f"train-{i}", 4) for i in range(8)]
    assert owner("bench-0", 2) == 1 and owner("bench-2", 2) == 0
    for shards in (2, 3, 4):
        spread = Counter(owner(f"job-{i}", shards) for i in range(400))
        assert sorted(spread) == list(range(shards))
        assert min(spread.values()) > 400 / shards * 0.7


def test_frames_come_out_whole_and_in_order_however_the_pipe_splits_them() -> None:
    sent = [
        frame(OP_MESSAGE, "tmd/v1/job/j/rank/0/iter", b'{"x":1}', retained=True),
        frame(OP_PROBE, stamp=12.5),
        frame(OP_MESSAGE, "tmd/v1/node/n\u00e9/iter", b"\x00" * 70_000),
    ]
    data = b"".join(sent)
    for cut in (1, 7, 100, 69_999, len(data)):
        buf, got = bytearray(), []
        for at in range(0, len(data), cut):
            buf += data[at : at + cut]
            got += frames(buf)
        assert not buf
        assert got == [
            (OP_MESSAGE, True, 0.0, "tmd/v1/job/j/rank/0/iter", b'{"x":1}'),
            (OP_PROBE, False, 12.5, "", b""),
            (OP_MESSAGE, False, 0.0, "tmd/v1/node/n\u00e9/iter", b"\x00" * 70_000),
        ]


def _relayed(job: str, ranks: list[int], t: float) -> wire.RelayedBatches:
    k = len(ranks)
    return wire.RelayedBatches(
        job=job, rank=ranks, ts=[t] * k, generation=[0] * k, run=[None] * k, count=[1] * k,
        step=[1] * k, end_ts=[t] * k, step_s=[1.0] * k, compute_s=[0.6] * k,
        allreduce_s=[0.3] * k, optimizer_s=[0.05] * k, data_s=[0.05] * k,
    )  # fmt: skip


def test_a_shard_applies_the_jobs_it_owns_and_leaves_the_machine_to_the_head() -> None:
    """An agent's message reaches the shard of each of its jobs whole: each takes its
    own jobs' steps, and neither the GPU sample nor the machine's numbers (the head
    applied and numbered those)."""
    mine = next(f"j{i}" for i in range(100) if owner(f"j{i}", 2) == 1)
    theirs = next(f"j{i}" for i in range(100) if owner(f"j{i}", 2) == 0)
    view, metrics = ClusterView(), Metrics()
    cfg = config.from_dict({})
    t = time.time()
    ingest = Ingest(mqtt=cfg.mqtt, config=cfg.ingest, view=view, bus=Bus(), metrics=metrics,
                    clock=FakeClock(t))  # fmt: skip
    ingest.shard = (1, 2)
    sample = wire.NodeGpu(ts=t, node="n", gpus=[wire.GpuSample(index=0)])
    for seq in (1, 5):  # a gap the head judges, not the shard
        jobs = [_relayed(mine, [0, 1], t), _relayed(theirs, [0], t)]
        message = wire.NodeIter(ts=t, node="n", seq=seq, gpu=sample, jobs=jobs)
        ingest.handle(wire.node_topic("n", "iter"), wire.encode(message))
    assert set(view.jobs) == {mine} and set(view.jobs[mine].ranks) == {0, 1}
    assert "n" not in view.nodes
    value = metrics.registry.get_sample_value
    assert value("tmd_gpu_samples_total", {"form": "full"}) == 0
    assert value("tmd_messages_lost_total", {"kind": "node_iter"}) == 0
    assert value("tmd_rank_steps_total", {"outcome": "accepted"}) == 2
    assert value("tmd_rank_steps_total", {"outcome": "duplicate"}) == 2
