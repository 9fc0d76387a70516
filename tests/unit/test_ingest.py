"""Ingest edge without a broker: topic classification and the handler's verdicts."""

from __future__ import annotations

import time

import pytest

from tests.fakes.clock import FakeClock
from tmd import config, wire
from tmd.bus import Bus
from tmd.errors import ProtocolError
from tmd.ingest import Ingest, classify
from tmd.metrics import Metrics
from tmd.view import ClusterView


@pytest.mark.parametrize(
    ("topic", "expected"),
    [
        ("tmd/v1/node/n-1/status", ("node_status", "n-1", None)),
        ("tmd/v1/node/n-1/gpu", ("gpu", "n-1", None)),
        ("tmd/v1/node/n-1/xid", ("xid", "n-1", None)),
        ("tmd/v1/job/j/rank/0/iter", ("iter", "j", 0)),
        ("tmd/v1/job/j/rank/4095/iter", ("iter", "j", 4095)),
        ("tmd/v1/job/j/status", ("job_status", "j", None)),
        ("tmd/v1/job/j/ack", ("ack", "j", None)),
    ],
)
def test_classify(topic: str, expected: tuple[str, str, int | None]) -> None:
    assert classify(topic) == expected


@pytest.mark.parametrize(
    "topic",
    [
        "tmd/v2/node/n/gpu",
        "tmd/v1/node/n/temp",
        "tmd/v1/job/j/ctl",
        "tmd/v1/job/j/rank/-1/iter",
        "tmd/v1/job/j/rank/01/iter",
        "tmd/v1/job/j/rank/123456789/iter",
        "tmd/v1/job/j/rank/1/x",
        "other/topic",
        "",
        "tmd/v1",
    ],
)
def test_classify_rejects(topic: str) -> None:
    with pytest.raises(ProtocolError) as err:
        classify(topic)
    assert err.value.reason == "topic"


def make_ingest(**ingest: object) -> tuple[Ingest, ClusterView, Metrics, Bus]:
    view, metrics, bus = ClusterView(), Metrics(), Bus()
    cfg = config.from_dict({"ingest": ingest})
    return (
        Ingest(
            mqtt=cfg.mqtt,
            config=cfg.ingest,
            view=view,
            bus=bus,
            metrics=metrics,
            clock=FakeClock(time.time()),
        ),
        view,
        metrics,
        bus,
    )


def test_handler_applies_publishes_and_counts() -> None:
    ingest, view, metrics, bus = make_ingest()
    seen = bus.subscribe("t", (wire.IterBatch,))
    t = time.time()
    batch = wire.IterBatch(
        ts=t, job="j", rank=2, node="n", steps=[wire.StepTiming(1, t, 1, 1, 0, 0, 0)]
    )
    ingest.handle(wire.iter_topic("j", 2), wire.encode(batch))
    ingest.handle(wire.iter_topic("j", 2), wire.encode(batch))  # a duplicate delivery
    assert view.jobs["j"].ranks[2].total_steps == 1
    assert len(seen) == 2
    sample = metrics.registry.get_sample_value
    assert sample("tmd_rank_steps_total", {"outcome": "accepted"}) == 1
    assert sample("tmd_rank_steps_total", {"outcome": "duplicate"}) == 1
    assert sample("tmd_messages_received_total", {"kind": "iter"}) == 2


def test_cleared_retained_status_is_not_a_rejection() -> None:
    ingest, _, metrics, _ = make_ingest()
    ingest.handle(wire.job_topic("j", "status"), b"")
    ingest.handle(wire.node_topic("n", "status"), b"")
    ingest.handle(wire.node_topic("n", "gpu"), b"")  # not retained: empty is malformed
    total = sum(
        metrics.registry.get_sample_value("tmd_messages_rejected_total", {"reason": r}) or 0
        for r in ("json", "schema")
    )
    assert total == 1


def test_status_has_its_own_size_limit() -> None:
    ingest, view, metrics, _ = make_ingest(max_payload_bytes=4096)
    members = [wire.Member(r, f"node-{r:05d}") for r in range(1000)]
    status = wire.JobStatus(
        ts=time.time(), job="big", generation=0, world_size=1000, members=members
    )
    payload = wire.encode(status)
    assert len(payload) > 4096
    ingest.handle(wire.job_topic("big", "status"), payload)
    assert view.jobs["big"].world_size == 1000
    ingest.handle(wire.node_topic("n", "gpu"), b" " * 5000)
    assert (
        metrics.registry.get_sample_value("tmd_messages_rejected_total", {"reason": "oversize"})
        == 1
    )
