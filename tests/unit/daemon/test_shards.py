"""Ingest shards without processes: who owns a job, the frames between head and shard,
and what a shard's ingest takes of an agent's relayed message."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from multiprocessing.connection import Connection

import msgspec
import pytest

from tests.fakes.clock import FakeClock
from tmd import config, wire
from tmd.daemon.bus import Bus
from tmd.daemon.ingest import Ingest
from tmd.daemon.metrics import Metrics
from tmd.daemon.shards import (
    OP_DROPPED,
    OP_FORGET_JOB,
    OP_MESSAGE,
    OP_PROBE,
    OP_RANKS,
    ShardError,
    Shards,
    _Link,
    _Out,
    _pack,
    _Report,
    _Shard,
    frame,
    frames,
    owner,
)
from tmd.daemon.view import ClusterView
from tmd.errors import ProtocolError


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


# -- the head's side, with pipes for shards (no processes) ------------------------------


class _Pipes:
    """A ``Shards`` of ``count`` links whose pipes the test reads (nothing else does)."""

    def __init__(self, count: int, **ingest: object) -> None:
        cfg = config.from_dict({"ingest": {"shards": count, **ingest}})
        self.view, self.metrics = ClusterView(), Metrics()
        self.clock = FakeClock(time.time())
        self.shards = Shards(config=cfg, specs=[], metrics=self.metrics, view=self.view,
                             emit=lambda event, source: None, clock=self.clock)  # fmt: skip
        self.shards._loop = asyncio.get_running_loop()
        self.readers = []
        for i in range(count):
            r, w = os.pipe()
            back_r, back_w = os.pipe()
            os.set_blocking(w, False)
            os.set_blocking(r, False)
            self.shards.links.append(_Link(i, None, Connection(w), Connection(back_r)))
            self.readers.append((Connection(r), Connection(back_w)))
        self.ingest = Ingest(mqtt=cfg.mqtt, config=cfg.ingest, view=self.view, bus=Bus(),
                             metrics=self.metrics, clock=self.clock)  # fmt: skip
        self.ingest.shards = self.shards
        self.view.on_forget_job = self.shards.forget
        self.bufs = [bytearray() for _ in range(count)]

    async def read(self, shard: int) -> list[tuple[int, bool, float, str, bytes]]:
        """Every frame the head wrote for ``shard``, once it has nothing left waiting."""
        fd, buf, link = self.readers[shard][0].fileno(), self.bufs[shard], self.shards.links[shard]
        await asyncio.sleep(0)  # the flush the head does once this turn is done
        while True:
            try:
                buf += os.read(fd, 1 << 20)
                continue
            except BlockingIOError:
                pass
            if not link.pending:
                return frames(buf)
            await asyncio.sleep(0.01)  # the head writes what waits as the pipe drains

    def close(self) -> None:
        loop = asyncio.get_running_loop()
        for link in self.shards.links:
            if link.writing:
                loop.remove_writer(link.out_fd)
            link.out.close()
            link.back.close()
        for r, w in self.readers:
            r.close()
            w.close()


async def test_the_head_routes_each_job_to_its_shard_and_keeps_each_machine() -> None:
    p = _Pipes(2)
    try:
        t = time.time()
        a = next(f"j{i}" for i in range(100) if owner(f"j{i}", 2) == 0)
        b = next(f"j{i}" for i in range(100) if owner(f"j{i}", 2) == 1)
        handle = p.ingest.handle
        # A job's status: the head's view, and its shard's.
        status = wire.JobStatus(ts=t, job=a, generation=0, world_size=1,
                                members=[wire.Member(0, "n")])  # fmt: skip
        handle(wire.job_topic(a, "status"), wire.encode(status), retained=True)
        # A rank's batch, as it came, even over the size limit (its shard checks it).
        step = wire.StepTiming(1, t, 1.0, 0.6, 0.3, 0.05, 0.05)
        batch = wire.IterBatch(ts=t, job=b, rank=3, node="m", seq=1, steps=[step])
        big = wire.encode(batch)[:-1] + b" " * 300_000 + b"}"
        handle(wire.iter_topic(b, 3), big)
        # An agent's message with both jobs' batches and its GPU sample.
        sample = wire.NodeGpu(ts=t, node="n", gpus=[wire.GpuSample(index=0)])
        both = wire.NodeIter(ts=t, node="n", seq=1, gpu=sample,
                             jobs=[_relayed(a, [0], t), _relayed(b, [0], t)])  # fmt: skip
        handle(wire.node_topic("n", "iter"), wire.encode(both))
        # The job's status cleared: its shard forgets it too.
        handle(wire.job_topic(a, "status"), b"", retained=True)
        got0, got1 = await p.read(0), await p.read(1)
        assert [(op, topic) for op, _, _, topic, _ in got0] == [
            (OP_MESSAGE, wire.job_topic(a, "status")),
            (OP_MESSAGE, wire.node_topic("n", "iter")),
            (OP_FORGET_JOB, a),
        ]
        assert got0[0][1] is True  # retained
        assert [(op, topic, len(data)) for op, _, _, topic, data in got1] == [
            (OP_MESSAGE, wire.iter_topic(b, 3), len(big)),
            (OP_MESSAGE, wire.node_topic("n", "iter"), len(wire.encode(both))),
        ]
        # The head: the machine's sample and number, no rank of its own.
        assert p.view.nodes["n"].sample is not None and p.view.total_ranks == 0
        assert a not in p.view.jobs
        value = p.metrics.registry.get_sample_value
        assert value("tmd_messages_received_total", {"kind": "node_iter"}) == 1
        assert value("tmd_messages_rejected_total", {"reason": "oversize"}) == 0
    finally:
        p.close()


async def test_a_shard_that_falls_behind_loses_telemetry_not_statuses_and_is_told_where() -> None:
    """Past its backlog, a shard's telemetry and probes are dropped (counted) until half
    of it is written; then ``OP_LOST`` comes where the gap is, before what follows."""
    p = _Pipes(1)
    try:
        shards = p.shards
        shards.max_backlog_bytes = 4096
        msg = frame(OP_MESSAGE, "tmd/v1/job/j/rank/0/iter", b"x" * 1000)
        link = shards.links[0]
        dropped = lambda: p.metrics.registry.get_sample_value(  # noqa: E731
            "tmd_shard_dropped_total", {"kind": "iter"}
        )
        for _ in range(5):  # in one turn of the loop, so nothing written yet: the 5th over
            shards.send(0, msg, kind="iter")
        shards.send(0, frame(OP_PROBE, stamp=1.0), kind="probe")  # dropped too
        shards.send(0, frame(OP_MESSAGE, "tmd/v1/job/j/status", b"{}"))  # never dropped
        assert dropped() == 1
        del link.pending[: len(msg)]  # one written: still more than half the backlog waits
        shards.send(0, msg, kind="iter")
        assert dropped() == 2
        got = await p.read(0)  # written and read: the shard caught up
        shards.send(0, msg, kind="iter")
        got += await p.read(0)
        assert [op for op, *_ in got] == [OP_MESSAGE] * 4 + [OP_DROPPED, OP_MESSAGE]
        assert got[3][3] == "tmd/v1/job/j/status"
    finally:
        p.close()


def test_a_relayed_message_with_a_bad_job_is_refused_by_that_jobs_shard_alone() -> None:
    """Each shard decodes and judges its own jobs: the other job's batches are applied,
    and the message is counted refused once."""
    a = next(f"j{i}" for i in range(100) if owner(f"j{i}", 2) == 0)
    b = next(f"j{i}" for i in range(100) if owner(f"j{i}", 2) == 1)
    t = time.time()
    good, bad = _relayed(a, [0], t), _relayed(b, [0], t)
    payload = wire.encode(wire.NodeIter(ts=t, node="n", seq=1, jobs=[good, bad]))
    payload = payload.replace(b'"step_s":[1.0]', b'"step_s":[-1.0]', 2)  # both: b's is last
    payload = payload.replace(b'"step_s":[-1.0]', b'"step_s":[1.0]', 1)  # a's good again
    held, refused = [], 0.0
    for index in (0, 1):
        view, metrics = ClusterView(), Metrics()
        cfg = config.from_dict({})
        ingest = Ingest(mqtt=cfg.mqtt, config=cfg.ingest, view=view, bus=Bus(), metrics=metrics,
                        clock=FakeClock(t))  # fmt: skip
        ingest.shard = (index, 2)
        ingest.handle(wire.node_topic("n", "iter"), payload)
        held += list(view.jobs)
        refused += metrics.registry.get_sample_value("tmd_messages_rejected_total",
                                                     {"reason": "value"}) or 0.0  # fmt: skip
    assert held == [a] and refused == 1


async def test_a_shard_told_its_telemetry_was_dropped_counts_no_loss_and_settles() -> None:
    """The head counted what it dropped (``tmd_shard_dropped_total``): the gap in a rank's
    numbers that follows is not counted again as lost, and the shard's view settles."""
    cfg = config.from_dict({"ingest": {"shards": 1}})
    r, w = os.pipe()
    back_r, back_w = os.pipe()
    shard = _Shard(0, cfg, [], Connection(r), Connection(back_w), Ingest)
    t = time.time()
    fresh = shard.ingest.freshness
    fresh.connection(True, t)
    fresh.answered(t, t)

    def batch(seq: int) -> bytes:
        step = wire.StepTiming(seq, t, 1.0, 0.6, 0.3, 0.05, 0.05)
        data = wire.encode(wire.IterBatch(ts=t, job="j", rank=0, node="n", seq=seq, steps=[step]))
        return frame(OP_MESSAGE, wire.iter_topic("j", 0), data)

    try:
        for data in (batch(1), batch(2), frame(OP_DROPPED), batch(6), batch(8)):
            os.write(w, data)
        shard._readable()
        lost = shard.metrics.registry.get_sample_value
        assert lost("tmd_messages_lost_total", {"kind": "iter"}) == 1  # 7, after: a loss
        assert lost("tmd_rank_steps_total", {"outcome": "accepted"}) == 4
        assert fresh.state(time.time()) == "settling"
    finally:
        for fd in (w, back_r):
            os.close(fd)


async def test_the_head_takes_a_shards_report_but_not_a_job_it_forgot() -> None:
    p = _Pipes(1)
    try:
        now = p.clock.now()
        empty = {"iter": 0}

        def report(jobs: dict[str, tuple[float, int, int]], forgotten: int = 0) -> _Report:
            return _Report(rejected={}, steps={"accepted": 5}, lost=empty, latency=[0] * 12,
                           latency_sum=0.0, lag_s=0.1, stale=False, ranks=2, total_steps=5,
                           jobs=jobs, plugins={"straggler": True}, forgotten=forgotten)  # fmt: skip

        link = p.shards.links[0]
        p.shards._took(link, report({"j": (now - 1, 2, 40)}))
        job = p.view.jobs["j"]
        assert (job.shard, job.last_seen) == ((2, 40), now - 1)
        value = p.metrics.registry.get_sample_value
        assert value("tmd_rank_steps_total", {"outcome": "accepted"}) == 5
        assert value("tmd_messages_received_total", {"kind": "iter"}) == 0  # the head's alone
        assert p.view.reporting_ranks() == 2 and p.view.total_steps() == 5
        assert p.view.forget_job("j")  # the API, say: its shard is told
        p.clock.advance(1.0)
        # Made before it read so, even with a step applied since (in flight then).
        p.shards._took(link, report({"j": (p.clock.now(), 2, 41)}))
        assert "j" not in p.view.jobs
        assert [op for op, *_ in await p.read(0)] == [OP_FORGET_JOB]
        p.shards._took(link, report({"j": (p.clock.now(), 1, 42)}, forgotten=1))  # news
        assert p.view.jobs["j"].shard == (1, 42)
        p.shards._took(link, report({"old": (now - 7200, 1, 1)}))  # silent: not taken up
        assert "old" not in p.view.jobs
    finally:
        p.close()


def test_a_shard_refuses_its_own_job_whose_columns_do_not_line_up_and_applies_the_rest() -> None:
    mine = [f"j{i}" for i in range(100) if owner(f"j{i}", 2) == 0][:2]
    t = time.time()
    bad = msgspec.structs.replace(_relayed(mine[1], [0], t), count=[2])  # one step for two
    payload = wire.encode(wire.NodeIter(ts=t, node="n", jobs=[_relayed(mine[0], [0], t), bad]))
    view, metrics = ClusterView(), Metrics()
    cfg = config.from_dict({})
    ingest = Ingest(mqtt=cfg.mqtt, config=cfg.ingest, view=view, bus=Bus(), metrics=metrics,
                    clock=FakeClock(t))  # fmt: skip
    ingest.shard = (0, 2)
    ingest.handle(wire.node_topic("n", "iter"), payload)
    assert list(view.jobs) == [mine[0]]
    assert (
        metrics.registry.get_sample_value("tmd_messages_rejected_total", {"reason": "schema"}) == 1
    )


def test_a_job_known_only_from_a_shards_report_gives_way_to_a_status_not_to_ranks() -> None:
    view = ClusterView(max_jobs=2)
    t = time.time()
    view.note_shard("a", t, 8, 10)
    view.note_shard("b", t, 8, 10)
    status = wire.JobStatus(ts=t, job="c", generation=0, world_size=1,
                            members=[wire.Member(0, "n")])  # fmt: skip
    view.apply_job_status(status, t)
    assert sorted(view.jobs) == ["b", "c"]
    view.note_shard("d", t, 8, 10)  # full: not taken
    assert sorted(view.jobs) == ["b", "c"]
    with pytest.raises(ProtocolError) as refused:  # a rank's steps of a new job do not evict
        view.apply_steps("e", 0, "n", 0, None, [(1, t, 1.0, 0.6, 0.3, 0.05, 0.05)], t)
    assert refused.value.reason == "limit"


async def test_rank_rows_are_asked_of_the_jobs_shard_and_its_answer_passed_on() -> None:
    p = _Pipes(1)
    try:
        link = p.shards.links[0]
        back = p.readers[0][1].fileno()
        asked = asyncio.create_task(p.shards.rank_rows("j"))
        failed = asyncio.create_task(p.shards.rank_rows("k"))
        got = await p.read(0)
        assert [(op, topic, stamp) for op, _, stamp, topic, _ in got] == [
            (OP_RANKS, "j", 1.0),
            (OP_RANKS, "k", 2.0),
        ]
        os.write(back, _pack(_Out("rows", source="1", dump=b'[{"rank":0}]')))
        os.write(back, _pack(_Out("rows_failed", source="2", dump=b"RuntimeError()")))
        p.shards._readable(link)
        assert bytes(await asked) == b'[{"rank":0}]'  # as the shard wrote it
        with pytest.raises(ShardError, match="RuntimeError"):
            await failed
        waiting = asyncio.create_task(p.shards.rank_rows("j"))
        await asyncio.sleep(0)
        p.shards._fail_asked("stopped")  # as when a shard dies or the shards stop
        with pytest.raises(ShardError):
            await waiting
    finally:
        p.close()
