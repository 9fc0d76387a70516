"""Telemetry batching: bounded, drops oldest with a counter, never raises."""

from __future__ import annotations

from datetime import timedelta

from tmd import wire
from tmd.runtime.telemetry import Telemetry


def _timing(step: int) -> wire.StepTiming:
    return wire.StepTiming(step, 1.0, 0.5, 0.3, 0.1, 0.05, 0.05)


def test_batches_carry_the_steps_in_order_on_the_rank_topic() -> None:
    sent: list[tuple[str, bytes]] = []
    telemetry = Telemetry(lambda t, p: sent.append((t, p)), job="j", node="n0", rank=3,
                          flush_interval=timedelta(hours=1))  # fmt: skip
    for step in range(5):
        telemetry.record(_timing(step))
    telemetry.close()

    assert [t for t, _ in sent] == ["tmd/v1/job/j/rank/3/iter"]
    batch = wire.decode(sent[0][1], wire.IterBatch)
    assert [s.step for s in batch.steps] == [0, 1, 2, 3, 4]
    assert (batch.node, batch.rank) == ("n0", 3)


def test_full_queue_drops_the_oldest_and_counts() -> None:
    sent: list[bytes] = []
    telemetry = Telemetry(lambda t, p: sent.append(p), job="j", node="n0", rank=0,
                          flush_interval=timedelta(hours=1), max_queue=3)  # fmt: skip
    for step in range(5):
        telemetry.record(_timing(step))
    telemetry.close()

    assert telemetry.dropped == 2
    assert [s.step for s in wire.decode(sent[0], wire.IterBatch).steps] == [2, 3, 4]


def test_a_failing_sink_costs_the_batch_not_the_caller() -> None:
    def broken(topic: str, payload: bytes) -> None:
        raise ConnectionError("broker gone")

    telemetry = Telemetry(broken, job="j", node="n0", rank=0, flush_interval=timedelta(hours=1))
    telemetry.record(_timing(0))
    telemetry.close()
    assert telemetry.errors == 1


def test_after_a_switch_the_joiner_reports_under_its_new_rank() -> None:
    sent: list[bytes] = []
    telemetry = Telemetry(lambda t, p: sent.append(p), job="j", node="standby0", rank=0,
                          flush_interval=timedelta(hours=1))  # fmt: skip
    telemetry.set_rank(2, generation=1)
    telemetry.record(_timing(7))
    telemetry.close()
    batch = wire.decode(sent[0], wire.IterBatch)
    assert (batch.rank, batch.generation) == (2, 1)
